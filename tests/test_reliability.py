"""Reliability over real processes (2 engines + a frontend on the tiny Llama), CI-sized.

The full-size run with printed figures is ``python -m benchmarks.chaos``; this runs the
same scenarios (``benchmarks.chaos.scenarios``) small enough for CI and asserts:
- fuzzed requests (hypothesis over every request field, raw random bodies to the
  frontend's methods and to the engines' Stream / GetEngineInfo) are answered only
  with allowed status codes, never INTERNAL or UNKNOWN, and the services are healthy
  after: SERVING, a normal request completes, engines idle with every block free;
- streams cancelled mid-generation leave no request and no KV block behind;
- an engine SIGKILLed under load: its streams migrate to the other engine and every
  stream completes (the time from the kill to each stream's next token is printed, only
  a hang-catching bound is asserted), and the engine restarted on its port is used again.
The kill runs last: it restarts the engine it killed, but the stack is not the same after.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from benchmarks.chaos import scenarios, strategies
from benchmarks.chaos.procs import ChaosStack

pytestmark = pytest.mark.timeout(600)

FUZZ_CALLS = 300
CANCELS = 100
KILL_STREAMS = 6
HANG_BOUND_S = 30.0  # a migrated stream resumes in about a second; this only catches hangs


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    with ChaosStack(tiny_llama_dir, 2, Path(tmp_path_factory.mktemp("reliability_logs"))) as chaos:
        yield chaos


def _seed() -> int:
    seed = random.SystemRandom().randrange(2**31)
    print(f"fuzz seed {seed}")  # shown by pytest on failure, to replay the same draws
    return seed


def _assert_healthy(stack: ChaosStack) -> None:
    for service in stack.services:
        assert service.alive, f"{service.name} died:\n{service.log_tail()}"
        service.wait_serving(60.0)  # polls: a loaded CI core may answer a check late
    assert asyncio.run(scenarios.normal_request_completes(stack))
    loads = stack.wait_idle(60.0)
    assert all(load == (0, 0, 0) for load in loads), f"(running, waiting, blocks in use): {loads}"


def test_strategies_cover_the_edges() -> None:
    """The generators do reach what they are meant to: huge n, NaN, huge prompts, no input."""
    requests = strategies.collect(strategies.generate_requests(), 300, seed=1)
    assert len(requests) == 300
    params = [r.sampling_params for r in requests if r.HasField("sampling_params")]
    assert any(p.n == 2**32 - 1 for p in params)
    doubles = [getattr(p, f) for p in params for f in ("temperature", "top_p", "min_p") if p.HasField(f)]
    assert any(math.isnan(x) for x in doubles) and any(math.isinf(x) for x in doubles)
    assert any(len(r.prompt) >= min(strategies.HUGE_TEXT_CHARS) for r in requests)
    assert any(r.WhichOneof("input") is None for r in requests)
    bodies = strategies.random_bodies(40, seed=1)
    assert len(bodies) == 40 and any(len(b) < 8 for b in bodies)


def test_fuzzed_requests_get_allowed_codes_and_leave_services_healthy(stack: ChaosStack) -> None:
    result = asyncio.run(scenarios.fuzz(stack, FUZZ_CALLS, _seed(), concurrency=8))
    print(f"fuzz: {result.total} calls in {result.seconds:.1f}s: {dict(result.by_code())}")
    assert result.total == FUZZ_CALLS
    assert not result.bad, "\n".join(result.bad[:10])
    by_code = result.by_code()
    assert by_code["INVALID_ARGUMENT"] > 0 and by_code["OK"] > 0  # both kinds were reached
    raw_methods = {method for method, _ in result.counts}
    assert {"Generate", "Tokenize", "Detokenize", "Stream", "GetEngineInfo"} <= raw_methods
    _assert_healthy(stack)


def test_unparseable_bodies_are_invalid_argument(stack: ChaosStack) -> None:
    """Bytes that are no protobuf message (a truncated varint) for every kind of method."""

    async def codes() -> list[grpc.StatusCode]:
        body = b"\x08\xff"
        out = []
        async with grpc.aio.insecure_channel(stack.address) as front, \
                grpc.aio.insecure_channel(stack.engines[0].address) as engine:
            calls = [
                front.unary_stream("/tandem.v1.Generation/Generate")(body, timeout=30),
                front.unary_unary("/tandem.v1.Generation/Tokenize")(body, timeout=30),
                engine.unary_unary("/tandem.v1.EngineCore/GetEngineInfo")(body, timeout=30),
                engine.stream_stream("/tandem.v1.EngineCore/Stream")(iter([body]), timeout=30),
            ]
            for call in calls:
                try:
                    if hasattr(call, "__aiter__"):
                        async for _ in call:
                            pass
                    else:
                        await call
                    out.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    assert "does not parse" in (exc.details() or ""), exc.details()
                    out.append(exc.code())
        return out

    assert asyncio.run(codes()) == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    _assert_healthy(stack)


def test_mid_stream_cancels_leak_nothing(stack: ChaosStack) -> None:
    result = asyncio.run(scenarios.cancels(stack, CANCELS, _seed(), concurrency=16, settle=60.0))
    print(f"cancels: {result.cancelled} in {result.seconds:.1f}s, ended first: {dict(result.other_endings)}")
    assert result.cancelled + sum(result.other_endings.values()) == CANCELS
    assert set(result.other_endings) <= {"finished"}, result.other_endings
    assert result.cancelled > CANCELS // 2
    assert all(load == (0, 0, 0) for load in result.leftover), result.leftover
    _assert_healthy(stack)


def test_engine_sigkill_under_load(stack: ChaosStack) -> None:
    result = asyncio.run(scenarios.engine_kill(stack, KILL_STREAMS, victim=0))
    times = result.resumed_after_s
    print(
        f"engine kill: load before {result.load_before}, endings {dict(result.endings)}, "
        f"kill -> next token {sorted(round(t * 1000) for t in times)} ms, "
        f"restarted engine used {result.restarted_used_after_s} s after SERVING"
    )
    assert all(running > 0 for running, _, _ in result.load_before), result.load_before
    assert not result.other_failures, result.other_failures
    assert dict(result.endings) == {"completed": KILL_STREAMS}, result.endings  # migrated, not failed
    assert len(times) == KILL_STREAMS and max(times) < HANG_BOUND_S, times
    assert result.restarted_used_after_s is not None, "the restarted engine got no request"
    _assert_healthy(stack)
