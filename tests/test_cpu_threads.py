"""The engine's CPU thread count: the cgroup quota read (v1 and v2), the default it gives,
and the governor that shrinks the team while its threads wait for a CPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine_service.cpu import cpu_quota, default_num_threads, threads_per_engine
from engine_service.thread_governor import ThreadGovernor, process_run_delay_s


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(tmp_path / "self_cgroup", "0::/kubepods/pod1/ctr\n")
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "kubepods" / "cpu.max", "400000 100000\n")
    _write(root / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    _write(root / "kubepods" / "pod1" / "ctr" / "cpu.max", "max 100000\n")
    assert cpu_quota(str(root), str(tmp_path / "self_cgroup")) == pytest.approx(1.5)


def test_cgroup_v1_quota_and_no_quota(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(tmp_path / "self_cgroup", "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "250000\n")
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota(str(root), str(tmp_path / "self_cgroup")) == pytest.approx(2.5)
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "-1\n")
    assert cpu_quota(str(root), str(tmp_path / "self_cgroup")) is None
    assert cpu_quota(str(root), str(tmp_path / "missing")) is None


def test_default_threads_are_the_cpus_allowed_a_quota_rounded_up(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine_service.cpu as cpu

    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for quota, expected in ((None, 4), (1.5, 2), (0.5, 1), (2.0, 2), (2.2, 3), (16.0, 4)):
        monkeypatch.setattr(cpu, "cpu_quota", lambda q=quota: q)
        assert default_num_threads() == expected, quota


def test_serve_splits_the_cpus_allowed_among_its_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """An affinity mask of 4 of the host's cores, with and without a CPU quota."""
    import engine_service.cpu as cpu

    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {2, 3, 5, 7})
    cases = {(None, 1): 4, (None, 2): 2, (None, 3): 1, (None, 8): 1,
             (1.5, 1): 2, (1.5, 2): 1, (3.0, 2): 1, (2.5, 2): 2, (6.0, 2): 2}
    for (quota, engines), expected in cases.items():
        monkeypatch.setattr(cpu, "cpu_quota", lambda q=quota: q)
        assert threads_per_engine(engines) == expected, (quota, engines)
    with pytest.raises(ValueError):
        threads_per_engine(0)


class FakeProcess:
    """A clock and a run-delay counter: ``run(s, waiting)`` advances both, as if the team
    spent ``s`` seconds with ``waiting`` of its threads runnable but not running."""

    def __init__(self) -> None:
        self.now = 0.0
        self.delay = 0.0
        self.sizes: list[int] = []

    def run(self, seconds: float, waiting: float) -> None:
        self.now += seconds
        self.delay += seconds * waiting


def _governor(proc: FakeProcess, threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(
        threads, window_s=0.5, probe_s=5.0, high=0.15,
        run_delay=lambda: proc.delay, set_threads=proc.sizes.append, clock=lambda: proc.now,
    )


def test_a_busy_neighbour_shrinks_the_team_and_its_leaving_grows_it_back() -> None:
    proc = FakeProcess()
    gov = _governor(proc)
    rng = random.Random()
    for _ in range(40):  # quiet: a few percent of waiting at most
        proc.run(0.05, rng.uniform(0.0, 0.1))
        gov.observe()
    assert gov.threads == 2 and proc.sizes == []
    for _ in range(20):  # a neighbour on one core: one thread waits half the time
        proc.run(0.05, 0.5 * gov.threads / 2)
        gov.observe()
    assert gov.threads == 1 and proc.sizes == [1]
    # Still there: each probe back to two threads is undone within a window.
    for _ in range(300):
        proc.run(0.05, 0.5 if gov.threads == 2 else 0.0)
        gov.observe()
    assert gov.threads == 1
    probes = proc.sizes.count(2)
    assert 2 <= probes <= 4  # one probe per probe_s (15 s here), not one per window
    # The neighbour leaves: the next probe keeps two threads.
    for _ in range(200):
        proc.run(0.05, 0.0)
        gov.observe()
    assert gov.threads == 2 and proc.sizes[-1] == 2


def test_one_thread_is_never_shrunk() -> None:
    proc = FakeProcess()
    gov = _governor(proc, threads=1)
    for _ in range(100):
        proc.run(0.05, 1.0)
        gov.observe()
    assert gov.threads == 1 and proc.sizes == []


def test_the_run_delay_of_this_process_is_read() -> None:
    first = process_run_delay_s()
    assert first >= 0.0
    assert process_run_delay_s() >= first  # a counter: never goes back
