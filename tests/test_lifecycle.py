"""Drain and health without processes: the step-loop watchdog, the engine's life after
start-up (drain, drain timeout, hung loop -> exit 1), the frontend's placement around
draining engines, and AsyncLLM's drain."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health

from engine_service import core_loop, lifecycle
from engine_service.core_loop import EngineCoreLoop, EngineDead
from engine_service.watchdog import StepWatchdog
from frontend_service.admission import RequestFailedError
from frontend_service.async_llm import AsyncLLM
from frontend_service.engine_client import EngineConnection, EngineUnavailableError
from frontend_service.engine_group import EngineGroup
from frontend_service.errors import status_for
from frontend_service.input_processor import InputProcessor
from frontend_service.migration import MigrationConfig
from tandem.health import LIVENESS, NOT_SERVING, READINESS, SERVING, ServiceHealth
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    RequestError,
    TokenColumns,
)
from tandem.protocol.sampling_params import SamplingParams
from tandem.signals import StopSignals
from tests.test_async_llm import FakeEngine

pytestmark = pytest.mark.timeout(60)

WAIT = 30.0  # generous bound for conditions on a loaded machine (never a timed assert)


# ---- the watchdog ---------------------------------------------------------------------


class Beats:
    def __init__(self, heartbeat: float, busy: bool) -> None:
        self.heartbeat = heartbeat
        self.busy = busy


@pytest.mark.parametrize(
    ("busy", "silent", "hung"),
    [(False, 1000.0, False), (True, 5.0, False), (True, 10.0, True), (True, 1000.0, True)],
)
def test_watchdog_counts_only_a_busy_silent_loop_as_hung(busy: bool, silent: float, hung: bool) -> None:
    watchdog = StepWatchdog(Beats(100.0, busy), step_timeout=10.0, clock=lambda: 100.0 + silent)
    reason = watchdog.check()
    assert (reason is not None) == hung
    if hung:
        assert "hung" in reason and "--step-timeout 10s" in reason


def test_watchdog_rejects_a_non_positive_timeout() -> None:
    with pytest.raises(ValueError, match="step_timeout"):
        StepWatchdog(Beats(0.0, False), step_timeout=0)


class HangingCore:
    """Stands in for EngineCore: a step blocks until ``release`` is set."""

    engine_index = 0

    def __init__(self) -> None:
        self.unfinished = 0
        self.release = threading.Event()

    def has_unfinished_requests(self) -> bool:
        return self.unfinished > 0

    def admit_request(self, request: EngineCoreRequest) -> None:
        self.unfinished += 1

    def step(self) -> EngineCoreOutputs:
        self.release.wait()
        self.unfinished = 0
        return EngineCoreOutputs()

    def take_ended_outputs(self) -> None:
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        pass

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _request(rid: str = "r", max_tokens: int = 4) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


def test_watchdog_finds_a_real_loop_hung_in_a_step_but_not_an_idle_one() -> None:
    async def scenario() -> str:
        core = HangingCore()
        loop = EngineCoreLoop(lambda: core)  # type: ignore[arg-type, return-value]
        loop.start()
        await asyncio.wrap_future(loop.started)
        watchdog = StepWatchdog(loop, step_timeout=0.2)
        verdicts: list[str] = []
        try:
            # Idle: the loop blocks on its inputs without beating, and that is fine.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(watchdog.watch(verdicts.append, interval=0.02), timeout=0.6)
            assert verdicts == []
            loop.add_request(_request())  # the next step never returns
            await asyncio.wait_for(watchdog.watch(verdicts.append, interval=0.02), timeout=WAIT)
            return verdicts[0]
        finally:
            core.release.set()
            loop.shutdown()

    assert "engine step loop hung" in asyncio.run(scenario())


def test_an_idle_loop_gives_free_memory_back_once_per_idle_spell(monkeypatch: pytest.MonkeyPatch) -> None:
    released = threading.Semaphore(0)
    calls: list[float] = []

    def release() -> bool:
        calls.append(time.monotonic())
        released.release()
        return True

    monkeypatch.setattr(core_loop, "release_free_memory", release)
    monkeypatch.setattr(core_loop, "IDLE_RELEASE_S", 0.05)
    core = HangingCore()
    core.release.set()  # steps return at once
    loop = EngineCoreLoop(lambda: core)  # type: ignore[arg-type, return-value]
    loop.start()
    try:
        loop.started.result(timeout=WAIT)
        assert released.acquire(timeout=WAIT)  # after start-up, once idle
        time.sleep(0.3)
        assert len(calls) == 1  # still idle: not again
        loop.add_request(_request())
        assert released.acquire(timeout=WAIT)  # the step ran, then idle again
        time.sleep(0.3)
        assert len(calls) == 2
    finally:
        loop.shutdown()


# ---- the engine's life after start-up -----------------------------------------------------


class FakeEngineServicer:
    """What lifecycle.run_until_stopped drives (EngineServicer's drain surface)."""

    def __init__(self, requests_left: int, health_servicer: health.aio.HealthServicer) -> None:
        self.died = asyncio.Event()
        self.drained = asyncio.Event()
        self.dead: EngineDead | None = None
        self.requests_left = requests_left
        self.health_servicer = health_servicer
        self.aborted_with: list[str] = []
        self.closed = False
        self.health_while_draining: dict[str, int] = {}

    def fail(self, reason: str) -> None:
        self.dead = EngineDead(reason)
        self.died.set()

    def start_drain(self) -> None:
        self.health_while_draining = _statuses(self.health_servicer)
        if self.requests_left == 0:
            self.drained.set()

    def abort_all(self, message: str) -> int:
        self.aborted_with.append(message)
        left, self.requests_left = self.requests_left, 0
        return left

    def close_streams(self) -> None:
        self.closed = True


def _statuses(servicer: health.aio.HealthServicer) -> dict[str, int]:
    return {name: servicer._server_status[name] for name in (LIVENESS, READINESS, "")}


async def _run_engine(
    *, requests_left: int, signals_sent: int, drain_timeout: float = WAIT, hung: bool = False
) -> tuple[int, FakeEngineServicer, dict[str, int]]:
    health_servicer = health.aio.HealthServicer()
    service_health = ServiceHealth(health_servicer, "tandem.v1.EngineCore")
    await service_health.ready()
    servicer = FakeEngineServicer(requests_left, health_servicer)
    core = HangingCore()
    loop = EngineCoreLoop(lambda: core)  # type: ignore[arg-type, return-value]
    loop.start()
    await asyncio.wrap_future(loop.started)
    signals = StopSignals()
    config = lifecycle.LifecycleConfig(drain_timeout=drain_timeout, step_timeout=0.2)
    if hung:
        loop.add_request(_request())
    for _ in range(signals_sent):
        signals.on_signal(signal.SIGTERM)
    try:
        status = await asyncio.wait_for(
            lifecycle.run_until_stopped(servicer, service_health, loop, 0, config, signals),  # type: ignore[arg-type]
            timeout=WAIT,
        )
    finally:
        core.release.set()
        loop.shutdown()
    return status, servicer, _statuses(health_servicer)


@pytest.fixture(autouse=True)
def _no_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "ANNOUNCE_SECONDS", 0.0)
    monkeypatch.setattr(lifecycle, "FLUSH_SECONDS", 0.0)


def test_a_hung_step_loop_makes_the_engine_unhealthy_and_exit_non_zero() -> None:
    status, servicer, health_after = asyncio.run(_run_engine(requests_left=1, signals_sent=0, hung=True))
    assert status != 0
    assert servicer.dead is not None and "hung" in servicer.dead.message
    assert health_after == {LIVENESS: NOT_SERVING, READINESS: NOT_SERVING, "": NOT_SERVING}
    assert not servicer.closed


def test_sigterm_drains_not_ready_but_alive_then_exits_0() -> None:
    status, servicer, health_after = asyncio.run(_run_engine(requests_left=0, signals_sent=1))
    assert status == 0
    assert servicer.health_while_draining == {LIVENESS: SERVING, READINESS: NOT_SERVING, "": NOT_SERVING}
    assert servicer.aborted_with == []  # nothing was left to abort
    assert servicer.closed
    assert health_after[LIVENESS] == SERVING


def test_drain_timeout_aborts_what_is_left_and_exits_0() -> None:
    status, servicer, _ = asyncio.run(_run_engine(requests_left=3, signals_sent=1, drain_timeout=0.1))
    assert status == 0
    assert servicer.aborted_with == ["drain timeout: aborted"]
    assert servicer.closed


def test_a_second_signal_cuts_the_drain_short_and_still_exits_0() -> None:
    status, servicer, _ = asyncio.run(_run_engine(requests_left=3, signals_sent=2))
    assert status == 0
    assert len(servicer.aborted_with) == 1 and servicer.aborted_with[0].endswith(": aborted")
    assert "drain timeout" not in servicer.aborted_with[0]


# ---- the frontend's placement around draining engines ----------------------------------------


def _unavailable(rid: str, tokens: list[int] | None = None, message: str = "engine 0 is draining") -> EngineCoreOutput:
    return EngineCoreOutput(
        rid, tokens or [], finish_reason=FinishReason.ERROR, stop_reason=message,
        error=RequestError(ErrorCode.UNAVAILABLE, message),
    )


def _sent_adds(engine: EngineConnection) -> list[str]:
    ids = []
    while not engine._send.empty():
        item = engine._send.get_nowait()
        if item is not None and item.WhichOneof("kind") == "add":
            ids.append(item.add.request_id)
    return ids


def _group(n: int = 2) -> EngineGroup:
    """Members that joined (no sockets: adds queue up on each connection's send queue)."""
    addresses = [f"127.0.0.1:{9 + i}" for i in range(n)]
    group = EngineGroup(addresses, 0, lambda e, o: None, lambda e, r: None)
    for address in addresses:
        engine = group._new_member(address)
        group._admitted.add(address)
        engine.alive = True
    return group


def test_pick_skips_draining_engines_and_fails_when_all_drain() -> None:
    async def scenario() -> None:
        group = _group()
        a, b = group.engines
        a.draining = True
        assert group.pick() is b
        b.draining = True
        with pytest.raises(EngineUnavailableError, match="draining"):
            group.pick()
        await group.close()

    asyncio.run(scenario())


async def _one_request_on_the_first_of_two(
    tokenizer: Any,
) -> tuple[EngineGroup, EngineConnection, EngineConnection, AsyncLLM, asyncio.Future, str]:
    """Two engines, an AsyncLLM over them and one request sent to the first; the future
    is the stream's first output."""
    group = _group()
    a, b = group.engines
    processor = InputProcessor(tokenizer, 512, len(tokenizer), 5, tokenizer.eos_token_id)
    llm = AsyncLLM(tokenizer, group, processor)
    stream = llm.generate(SamplingParams(max_tokens=4), prompt_token_ids=[5, 6, 7], request_id="r")
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    (rid,) = _sent_adds(a)
    return group, a, b, llm, first, rid


def test_a_draining_refusal_moves_once_per_engine_and_the_caller_never_sees_it(tokenizer: Any) -> None:
    async def scenario() -> BaseException:
        group, a, b, llm, first, rid = await _one_request_on_the_first_of_two(tokenizer)
        # a started draining while the add was on the wire: it refuses, b gets the request.
        llm.on_engine_outputs(a, EngineCoreOutputs(outputs=[_unavailable(rid)], draining=True))
        assert _sent_adds(b) == [rid] and not first.done()
        # b refuses too and a already did: the refusal reaches the caller.
        llm.on_engine_outputs(b, EngineCoreOutputs(outputs=[_unavailable(rid, message="engine 1 is draining")]))
        with pytest.raises(RequestFailedError) as info:
            await first
        assert _sent_adds(a) == [] and llm.num_unfinished == 0
        await group.close()
        return info.value

    error = asyncio.run(scenario())
    assert status_for(error) == (grpc.StatusCode.UNAVAILABLE, "engine 1 is draining")


def test_column_outputs_of_a_moved_request_count_only_from_its_new_engine(tokenizer: Any) -> None:
    async def scenario() -> list[int]:
        group, a, b, llm, first, rid = await _one_request_on_the_first_of_two(tokenizer)
        llm.on_engine_outputs(a, EngineCoreOutputs(outputs=[_unavailable(rid)], draining=True))
        assert _sent_adds(b) == [rid]
        # A step a sent before the abort reached it is stale; b's is the request's.
        llm.on_engine_outputs(a, EngineCoreOutputs(token_columns=TokenColumns([rid, "other"], [11, 12])))
        await asyncio.sleep(0)
        assert not first.done()
        llm.on_engine_outputs(b, EngineCoreOutputs(token_columns=TokenColumns([rid], [13])))
        out = await first
        await group.close()
        return out.outputs[0].token_ids

    assert asyncio.run(scenario()) == [13]


# ---- AsyncLLM: engine statuses and the frontend's drain -----------------------------------------


def _llm(tokenizer: Any) -> tuple[AsyncLLM, FakeEngine]:
    """One fake engine that never dies; migration off, so an engine's status reaches the
    caller (migration has its own tests: test_migration_frontend.py)."""
    engine = FakeEngine()
    processor = InputProcessor(tokenizer, 512, len(tokenizer), 5, tokenizer.eos_token_id)
    llm = AsyncLLM(tokenizer, engine, processor, migration=MigrationConfig(enabled=False))  # type: ignore[arg-type]
    return llm, engine


def test_an_engine_status_reaches_the_caller_as_that_status(tokenizer: Any) -> None:
    async def scenario() -> BaseException:
        llm, engine = _llm(tokenizer)
        stream = llm.generate(SamplingParams(max_tokens=8), prompt_token_ids=[5, 6, 7], request_id="r")
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        (request,) = engine.added
        llm.on_engine_outputs(engine, EngineCoreOutputs(outputs=[EngineCoreOutput(request.request_id, [9])]))  # type: ignore[arg-type]
        await first
        failure = _unavailable(request.request_id, message="drain timeout: aborted")
        llm.on_engine_outputs(engine, EngineCoreOutputs(outputs=[failure]))  # type: ignore[arg-type]
        with pytest.raises(RequestFailedError) as info:
            await stream.__anext__()
        assert llm.num_unfinished == 0
        return info.value

    error = asyncio.run(scenario())
    assert status_for(error) == (grpc.StatusCode.UNAVAILABLE, "drain timeout: aborted")


def test_frontend_drain_fails_leftovers_unavailable_and_aborts_them(tokenizer: Any) -> None:
    async def scenario() -> tuple[int, BaseException, list[str]]:  # failed, error, aborted
        llm, engine = _llm(tokenizer)
        stream = llm.generate(SamplingParams(max_tokens=8), prompt_token_ids=[5, 6, 7], request_id="r")
        pending = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        failed = await llm.drain(timeout=0.05)
        with pytest.raises(EngineUnavailableError) as info:
            await pending
        return failed, info.value, engine.aborted

    failed, error, aborted = asyncio.run(scenario())
    assert failed == 1 and len(aborted) == 1  # its engine request was aborted
    assert status_for(error)[0] == grpc.StatusCode.UNAVAILABLE and "drain timeout" in str(error)


def test_frontend_drain_of_an_idle_frontend_fails_nothing(tokenizer: Any) -> None:
    llm, _ = _llm(tokenizer)
    assert asyncio.run(llm.drain(timeout=WAIT)) == 0


def test_health_names_follow_the_states() -> None:
    async def scenario() -> list[dict[str, int]]:
        servicer = health.aio.HealthServicer()
        states = ServiceHealth(servicer, "tandem.v1.Generation")
        seen = []
        for step in (states.loading, states.ready, states.draining, states.broken):
            await step()
            seen.append({**_statuses(servicer), "full": servicer._server_status["tandem.v1.Generation"]})
        return seen

    loading, ready, draining, broken = asyncio.run(scenario())
    assert loading == {LIVENESS: SERVING, READINESS: NOT_SERVING, "": NOT_SERVING, "full": NOT_SERVING}
    assert ready == {LIVENESS: SERVING, READINESS: SERVING, "": SERVING, "full": SERVING}
    assert draining == loading
    assert broken == {LIVENESS: NOT_SERVING, READINESS: NOT_SERVING, "": NOT_SERVING, "full": NOT_SERVING}
