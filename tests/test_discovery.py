"""Engine discovery and runtime scaling: resolvers, placement, and real processes.

Unit tests: the ``--engine`` target parser, the file and DNS resolvers, tie rotation
and prefix-aware placement, and admin errors of ``EngineGroup``. End to end (tiny
Llama, real processes): a frontend on a ``file:///`` target list picks up a second
engine when the list gains it and stops using the first when the list drops it, under
a steady trickle of requests none of which fails; ``FrontendAdmin`` Add/Remove/List.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from frontend_service.discovery import (
    DnsTarget,
    FileTarget,
    FixedTarget,
    InvalidTargetError,
    ResolveError,
    parse_address,
    parse_address_list,
    parse_target,
)
from frontend_service.engine_group import EngineGroup, EngineNotFoundError, EngineState
from frontend_service.placement import (
    Placement,
    PlacementConfig,
    PlacementPolicy,
    PrefixMemory,
    block_hashes,
)
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import (
    ADMIN_METADATA,
    ServiceProcess,
    free_port,
    start_engine,
    start_frontend,
)

pytest_plugins = ["tests.e2e_helpers"]

WAIT = 120.0  # seconds a condition may take on a loaded machine


# ---- resolvers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:50061", ("127.0.0.1", 50061)),
        (" engine-0.engines.svc:1 ", ("engine-0.engines.svc", 1)),
        ("[::1]:65535", ("::1", 65535)),
    ],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    "text", ["", "host", ":50061", "host:", "host:0", "host:65536", "host:x1", "::1:5", "[nope]:1",
             "[::1]5", "a b:1", "h/x:1"],
)
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(InvalidTargetError):
        parse_address(text)


def test_parse_target_kinds(tmp_path: Path) -> None:
    assert parse_target("localhost:7") == FixedTarget("localhost:7")
    assert not parse_target("localhost:7").dynamic
    dns = parse_target("dns:///engines.example:50061")
    assert dns == DnsTarget("engines.example", 50061) and dns.dynamic
    assert str(dns) == "dns:///engines.example:50061"
    path = tmp_path / "engines.txt"
    target = parse_target(f"file://{path}")
    assert target == FileTarget(path) and target.dynamic
    for bad in ("dns://8.8.8.8/engines:1", "dns:///engines", "file://relative/x", "http://h:1"):
        with pytest.raises(InvalidTargetError):
            parse_target(bad)


def test_address_list_parsing() -> None:
    text = "# engines\n\n10.0.0.2:50061\n 10.0.0.1:50061  # the first\n10.0.0.2:50061\n[::1]:9\n"
    assert parse_address_list(text) == ["10.0.0.1:50061", "10.0.0.2:50061", "[::1]:9"]
    assert parse_address_list("") == []
    with pytest.raises(ResolveError, match="line 2"):
        parse_address_list("10.0.0.1:1\nnot an address\n")


def test_file_target_reads_the_file_each_time(tmp_path: Path) -> None:
    path = tmp_path / "engines.txt"
    target = FileTarget(path)
    with pytest.raises(ResolveError):
        asyncio.run(target.resolve())  # missing: the caller keeps its previous list
    path.write_text("127.0.0.1:1\n")
    assert asyncio.run(target.resolve()) == ["127.0.0.1:1"]
    path.write_text("127.0.0.1:1\n127.0.0.1:2\n")
    assert asyncio.run(target.resolve()) == ["127.0.0.1:1", "127.0.0.1:2"]


def test_dns_target_resolves_localhost() -> None:
    addresses = asyncio.run(DnsTarget("localhost", 4321).resolve())
    assert addresses, "localhost resolved to nothing"
    assert set(addresses) <= {"127.0.0.1:4321", "[::1]:4321"}
    with pytest.raises(ResolveError):
        asyncio.run(DnsTarget("no-such-host.invalid", 1).resolve())


# ---- placement ----------------------------------------------------------------------------


@dataclass
class FakeLoad:
    score: int = 0


@dataclass
class FakeEngine:
    index: int
    load: FakeLoad = field(default_factory=FakeLoad)


def test_ties_rotate_and_the_least_loaded_wins() -> None:
    engines = [FakeEngine(0), FakeEngine(1), FakeEngine(2)]
    placement = Placement()
    assert [placement.choose(engines).index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    engines[1].load.score = 4
    picked = {placement.choose(engines).index for _ in range(4)}
    assert picked == {0, 2}
    engines[0].load.score = 5
    engines[2].load.score = 5
    assert [placement.choose(engines).index for _ in range(3)] == [1, 1, 1]


def test_block_hashes_chain_and_salt() -> None:
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the partial third block is never cached
    assert block_hashes(list(range(32)) + [99] * 8, 16) == a
    assert block_hashes([7, *list(range(1, 40))], 16)[1] != a[1]  # the chain carries the past
    assert block_hashes(list(range(40)), 16, cache_salt="tenant")[0] != a[0]


def test_prefix_memory_is_an_lru() -> None:
    memory = PrefixMemory(capacity=3)
    memory.remember([b"a", b"b"])
    memory.remember([b"c"])
    assert memory.matched_blocks([b"a", b"b", b"c"]) == 3
    memory.remember([b"a"])  # a is fresh again; b is now the oldest
    memory.remember([b"d"])
    assert len(memory) == 3
    assert memory.matched_blocks([b"a", b"b"]) == 1
    assert memory.matched_blocks([b"c", b"d"]) == 2


def test_prefix_aware_follows_the_prefix_within_the_slack() -> None:
    engines = [FakeEngine(0), FakeEngine(1)]
    placement = Placement(PlacementConfig(policy=PlacementPolicy.PREFIX_AWARE, load_slack=4))
    for engine in engines:
        placement.add_engine(engine.index, block_size=4, num_kv_blocks=100)
    shared = list(range(100, 120))
    first = placement.choose(engines, [*shared, 1, 2, 3, 4]).index
    other = 1 - first
    engines[first].load.score = 4  # busier, but within the slack
    assert placement.choose(engines, [*shared, 5, 6, 7, 8]).index == first
    engines[first].load.score = 5  # beyond the slack: least load wins
    assert placement.choose(engines, [*shared, 9, 9, 9, 9]).index == other
    # A new prefix, sent to `first` only (the other engine is busy then).
    engines[first].load.score, engines[other].load.score = 0, 9
    fresh = list(range(200, 220))
    assert placement.choose(engines, fresh).index == first
    engines[first].load.score, engines[other].load.score = 1, 0
    assert placement.choose(engines, [*fresh, 7, 7, 7, 7]).index == first
    # Another tenant's salt makes other hashes: no match, so the least loaded engine.
    assert placement.choose(engines, fresh, cache_salt="other tenant").index == other
    placement.remove_engine(first)  # it left: its prefixes are forgotten
    assert placement.choose(engines, [*fresh, 1, 2, 3, 4]).index == other


def _group(*targets: str) -> EngineGroup:
    def ignore(*args: object) -> None:
        return None

    return EngineGroup(list(targets), 0, ignore, ignore)


def test_group_admin_errors() -> None:
    group = _group("127.0.0.1:1")
    with pytest.raises(InvalidTargetError):
        group.add("not an address")
    with pytest.raises(EngineNotFoundError):
        group.remove("127.0.0.1:2")
    assert group.add("127.0.0.1:2").state is EngineState.CONNECTING
    with pytest.raises(ValueError):
        _group()
    with pytest.raises(InvalidTargetError):
        _group("dns://server/name:1")


# ---- end to end ---------------------------------------------------------------------------


def _write_targets(path: Path, addresses: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{a}\n" for a in addresses))
    os.replace(tmp, path)  # the frontend never sees a half-written list


def finished_requests(metrics_port: int) -> float:
    """Requests an engine finished, from its Prometheus endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        if line.startswith("tandem:request_inference_time_seconds_count"):
            return float(line.split()[-1])
    raise AssertionError("tandem:request_inference_time_seconds_count not exported")


def wait_for(condition: Callable[[], bool], what: str, proc: ServiceProcess, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if not proc.alive:
            raise AssertionError(f"{proc.name} exited while waiting for {what}:\n{proc.log_tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{proc.log_tail()}")
        time.sleep(0.1)


class Trickle:
    """A steady stream of small Generate calls from a thread; counts outcomes."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = frontend_pb2_grpc.GenerationStub(self.channel)
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            request = frontend_pb2.GenerateRequest(
                prompt=f"request {i} of the trickle",
                sampling_params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
            )
            try:
                responses = list(self.stub.Generate(request, timeout=60))
                if not responses or not responses[-1].finished:
                    self.failures.append(f"request {i}: stream ended unfinished")
                else:
                    self.ok += 1
            except grpc.RpcError as exc:
                self.failures.append(f"request {i}: {exc.code().name}: {exc.details()}")

    def __enter__(self) -> Trickle:
        self._thread.start()
        return self

    def wait_ok(self, at_least: int, proc: ServiceProcess) -> None:
        wait_for(lambda: self.ok >= at_least or bool(self.failures), f"{at_least} trickle requests", proc)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=90)
        self.channel.close()


@dataclass
class Engines:
    procs: list[ServiceProcess]
    metrics_ports: list[int]


@pytest.fixture(scope="module")
def two_engines(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    log_dir = tmp_path_factory.mktemp("discovery_logs")
    ports = [free_port(), free_port()]
    procs = [start_engine(tiny_llama_dir, i, log_dir, metrics_port=ports[i]) for i in range(2)]
    try:
        for proc in procs:
            proc.wait_serving()
        yield Engines(procs, ports)
    finally:
        for proc in procs:
            proc.stop()


def admin_stub(frontend: ServiceProcess) -> tuple[grpc.Channel, frontend_pb2_grpc.FrontendAdminStub]:
    channel = grpc.insecure_channel(frontend.address)
    return channel, frontend_pb2_grpc.FrontendAdminStub(channel)


def listed(stub: frontend_pb2_grpc.FrontendAdminStub) -> dict[str, int]:
    """address -> EngineState of every engine the frontend lists."""
    reply = stub.ListEngines(frontend_pb2.ListEnginesRequest(), timeout=10, metadata=ADMIN_METADATA)
    return {e.address: e.state for e in reply.engines}


def test_file_discovery_scales_up_and_down_without_failures(
    two_engines: Engines, tiny_llama_dir: str, tmp_path: Path
) -> None:
    (a, b), (a_metrics, b_metrics) = two_engines.procs, two_engines.metrics_ports
    targets = tmp_path / "engines.txt"
    _write_targets(targets, [a.address])
    frontend = start_frontend(
        tiny_llama_dir, [f"file://{targets}"], tmp_path, name="frontend-file",
        env={"TANDEM_DISCOVERY_INTERVAL": "0.3"},
    )
    channel, admin = admin_stub(frontend)
    try:
        frontend.wait_serving()
        assert listed(admin) == {a.address: frontend_pb2.ENGINE_STATE_SERVING}
        with Trickle(frontend.address) as trickle:
            trickle.wait_ok(3, frontend)
            b_before = finished_requests(b_metrics)

            _write_targets(targets, [a.address, b.address])
            wait_for(lambda: listed(admin).get(b.address) == frontend_pb2.ENGINE_STATE_SERVING,
                     "the second engine to join", frontend)
            wait_for(lambda: finished_requests(b_metrics) >= b_before + 2 or bool(trickle.failures),
                     "requests on the second engine", frontend)

            _write_targets(targets, [b.address])
            wait_for(lambda: a.address not in listed(admin), "the first engine to leave", frontend)
            a_after_leave = finished_requests(a_metrics)
            b_after_leave = finished_requests(b_metrics)
            wait_for(lambda: finished_requests(b_metrics) >= b_after_leave + 3 or bool(trickle.failures),
                     "more requests on the second engine", frontend)
            assert finished_requests(a_metrics) == a_after_leave, "a removed engine got new requests"
        assert trickle.failures == []
        assert trickle.ok >= 8
        assert listed(admin) == {b.address: frontend_pb2.ENGINE_STATE_SERVING}
    finally:
        channel.close()
        frontend.stop()


def test_admin_add_remove_list(two_engines: Engines, tiny_llama_dir: str, tmp_path: Path) -> None:
    (a, b), b_metrics = two_engines.procs, two_engines.metrics_ports[1]
    frontend = start_frontend(tiny_llama_dir, [a.address], tmp_path, name="frontend-admin",
                              env={"TANDEM_CLIENT_INDEX": "1"})
    channel, admin = admin_stub(frontend)
    try:
        frontend.wait_serving()
        add_b = frontend_pb2.AddEngineRequest(address=b.address)
        wrong = (("authorization", "Bearer not-the-token"),)
        for bad, code in (
            # Without the admin token nothing changes: the call never reaches the servicer.
            (lambda: admin.AddEngine(add_b, timeout=10), grpc.StatusCode.UNAUTHENTICATED),
            (lambda: admin.AddEngine(add_b, timeout=10, metadata=wrong), grpc.StatusCode.PERMISSION_DENIED),
            (lambda: admin.ListEngines(frontend_pb2.ListEnginesRequest(), timeout=10),
             grpc.StatusCode.UNAUTHENTICATED),
            (lambda: admin.AddEngine(frontend_pb2.AddEngineRequest(address="nope"), timeout=10, metadata=ADMIN_METADATA),
             grpc.StatusCode.INVALID_ARGUMENT),
            (lambda: admin.AddEngine(frontend_pb2.AddEngineRequest(address=a.address), timeout=10, metadata=ADMIN_METADATA),
             grpc.StatusCode.ALREADY_EXISTS),
            (lambda: admin.RemoveEngine(frontend_pb2.RemoveEngineRequest(address=b.address), timeout=10, metadata=ADMIN_METADATA),
             grpc.StatusCode.NOT_FOUND),
        ):
            with pytest.raises(grpc.RpcError) as info:
                bad()
            assert info.value.code() == code, info.value.details()

        added = admin.AddEngine(frontend_pb2.AddEngineRequest(address=b.address), timeout=10, metadata=ADMIN_METADATA).engine
        assert (added.address, added.state) == (b.address, frontend_pb2.ENGINE_STATE_CONNECTING)
        wait_for(lambda: listed(admin).get(b.address) == frontend_pb2.ENGINE_STATE_SERVING,
                 "the added engine to serve", frontend)
        engines = admin.ListEngines(frontend_pb2.ListEnginesRequest(), timeout=10, metadata=ADMIN_METADATA).engines
        assert [(e.address, e.index) for e in engines] == [(a.address, 0), (b.address, 1)]

        # Idle engines tie: sequential requests take turns instead of all landing on engine 0.
        b_before = finished_requests(b_metrics)
        with Trickle(frontend.address) as trickle:
            trickle.wait_ok(4, frontend)
        assert trickle.failures == []
        assert finished_requests(b_metrics) >= b_before + 1

        removed = admin.RemoveEngine(frontend_pb2.RemoveEngineRequest(address=a.address), timeout=10, metadata=ADMIN_METADATA).engine
        assert removed.state == frontend_pb2.ENGINE_STATE_DRAINING
        wait_for(lambda: a.address not in listed(admin), "the removed engine to leave", frontend)
        with pytest.raises(grpc.RpcError) as info:
            admin.RemoveEngine(frontend_pb2.RemoveEngineRequest(address=a.address), timeout=10, metadata=ADMIN_METADATA)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with Trickle(frontend.address) as trickle:
            trickle.wait_ok(2, frontend)
        assert trickle.failures == []
    finally:
        channel.close()
        frontend.stop()


def _cached_tokens(stub: frontend_pb2_grpc.GenerationStub, prompt: list[int]) -> int:
    request = frontend_pb2.GenerateRequest(
        prompt_token_ids=frontend_pb2.TokenIds(token_ids=prompt),
        sampling_params=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
    )
    return list(stub.Generate(request, timeout=60))[-1].usage.cached_tokens


@pytest.mark.parametrize("policy", ["least-load", "prefix-aware"])
def test_prefix_aware_placement_finds_the_cached_prefix(
    two_engines: Engines, tiny_llama_dir: str, tmp_path: Path, policy: str
) -> None:
    """Sequential requests on idle engines: least-load alternates, so a shared prefix is
    computed on both engines; prefix-aware sends the repeats where it is cached."""
    a, b = two_engines.procs
    for proc in (a, b):  # earlier tests may have cached anything
        with grpc.insecure_channel(proc.address) as channel:
            assert engine_pb2_grpc.EngineCoreStub(channel).ResetPrefixCache(
                engine_pb2.ResetPrefixCacheRequest(), timeout=60, metadata=ADMIN_METADATA
            ).success
    frontend = start_frontend(tiny_llama_dir, [a.address, b.address], tmp_path, name=f"frontend-{policy}",
                              env={"TANDEM_PLACEMENT": policy, "TANDEM_CLIENT_INDEX": "2"})
    try:
        frontend.wait_serving()
        with grpc.insecure_channel(frontend.address) as channel:
            stub = frontend_pb2_grpc.GenerationStub(channel)
            prefix = [(7 * i) % 900 + 10 for i in range(64)]  # 4 full blocks of 16
            cached = [_cached_tokens(stub, [*prefix, 500 + i, 600 + i]) for i in range(4)]
        assert cached[0] == 0
        if policy == "prefix-aware":
            assert cached[1:] == [64, 64, 64]
        else:  # the second request lands on the other, cold engine
            assert cached[1] == 0
            assert cached[2:] == [64, 64]
    finally:
        frontend.stop()
