"""Graceful drain over real processes: SIGTERM to a frontend, an engine, ``tandem serve``.

Each test starts its own small stack on the tiny Llama, opens streams long enough to
still run when the signal arrives (greedy, ``ignore_eos``, ~900 tokens), signals once
every stream has produced a token, and checks that nothing is lost: every stream ends
with all its tokens and finish reason ``length``, new calls during the drain get
UNAVAILABLE (frontend) or go to the other engine (engine), health says draining
(readiness NOT_SERVING, liveness SERVING), and the process exits 0.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import (
    ENGINE_ARGS,
    START_TIMEOUT,
    ServiceProcess,
    serve_ports,
    start_stack,
)

pytestmark = pytest.mark.timeout(300)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NUM_STREAMS = 8
LONG_TOKENS = 900  # with the prompt, within max_model_len 1024: seconds per stream
CALL_TIMEOUT = 120.0
EXIT_TIMEOUT = 90.0


def greedy_request(max_tokens: int, prompt: str = "Tell me a long story") -> frontend_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(
        output_kind=common_pb2.OUTPUT_KIND_DELTA, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
    )
    return frontend_pb2.GenerateRequest(prompt=prompt, sampling_params=params)


@dataclass
class StreamResult:
    """What one Generate stream delivered (filled by its reader thread)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: grpc.RpcError | None = None
    first_token: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


def start_streams(address: str, count: int, max_tokens: int) -> tuple[list[StreamResult], grpc.Channel]:
    """``count`` Generate streams on one channel, each read by its own thread."""
    channel = grpc.insecure_channel(address)
    stub = frontend_pb2_grpc.GenerationStub(channel)
    results = [StreamResult() for _ in range(count)]

    def read(result: StreamResult, index: int) -> None:
        try:
            for response in stub.Generate(greedy_request(max_tokens, f"Story number {index}:"), timeout=CALL_TIMEOUT):
                for out in response.outputs:
                    result.tokens += out.token_ids
                    if out.finish_reason:
                        result.finish_reason = out.finish_reason
                if result.tokens:
                    result.first_token.set()
        except grpc.RpcError as exc:
            result.error = exc
        finally:
            result.first_token.set()
            result.done.set()

    for i, result in enumerate(results):
        threading.Thread(target=read, args=(result, i), daemon=True).start()
    return results, channel


def wait_all(events: list[threading.Event], timeout: float = CALL_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    for event in events:
        if not event.wait(max(0.0, deadline - time.monotonic())):
            raise AssertionError(f"streams still running after {timeout:.0f}s")


def wait_any(events: list[threading.Event], timeout: float = CALL_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not any(e.is_set() for e in events):
        if time.monotonic() > deadline:
            raise AssertionError(f"no stream produced a token within {timeout:.0f}s")
        time.sleep(0.05)


def assert_complete(results: list[StreamResult], max_tokens: int) -> None:
    """Every stream ended normally with all its tokens: nothing lost to the drain."""
    wait_all([r.done for r in results])
    problems = [
        (i, r.error.code().name if r.error else "", len(r.tokens), r.finish_reason)
        for i, r in enumerate(results)
        if r.error is not None or len(r.tokens) != max_tokens or r.finish_reason != "length"
    ]
    assert not problems, f"(stream, error, tokens, finish reason) of streams that lost work: {problems}"


def wait_exit(proc: ServiceProcess, timeout: float = EXIT_TIMEOUT) -> int:
    try:
        return proc.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{proc.name} did not exit {timeout:.0f}s after SIGTERM:\n{proc.log_tail()}") from None


def generate_error(address: str, max_tokens: int = 4) -> grpc.RpcError | None:
    with grpc.insecure_channel(address) as channel:
        try:
            list(frontend_pb2_grpc.GenerationStub(channel).Generate(greedy_request(max_tokens), timeout=30))
        except grpc.RpcError as exc:
            return exc
    return None


def health_at(address: str, service: str = "") -> int | None:
    """The health status at ``address``, or None if nothing answers."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            ).status
        except grpc.RpcError:
            return None


def engine_info(address: str) -> engine_pb2.GetEngineInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineCoreStub(channel).GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=10)


def wait_admitted(address: str, count: int, timeout: float = CALL_TIMEOUT) -> None:
    """Until the engine at ``address`` holds ``count`` requests (running or waiting)."""
    deadline = time.monotonic() + timeout
    while True:
        info = engine_info(address)
        if info.num_running_reqs + info.num_waiting_reqs >= count:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine holds {info.num_running_reqs + info.num_waiting_reqs} of {count} requests")
        time.sleep(0.05)


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "logs"


# ---- the frontend drains -------------------------------------------------------------


def test_sigterm_frontend_finishes_streams_refuses_new_calls_exits_0(tiny_llama_dir: str, log_dir: Path) -> None:
    with start_stack(tiny_llama_dir, 1, log_dir) as stack:
        results, channel = start_streams(stack.address, NUM_STREAMS, LONG_TOKENS)
        with channel:
            wait_all([r.first_token for r in results])
            assert not any(r.done.is_set() for r in results), "streams ended before the drain began"
            stack.frontend.proc.send_signal(signal.SIGTERM)
            stack.frontend.wait_health(NOT_SERVING, timeout=30)  # readiness ("") at once
            assert stack.frontend.health("readiness") == NOT_SERVING
            assert stack.frontend.health("liveness") == SERVING
            refused = generate_error(stack.address)
            assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE, refused
            assert "draining" in (refused.details() or "")
            assert_complete(results, LONG_TOKENS)
        assert wait_exit(stack.frontend) == 0
        assert stack.engines[0].alive and stack.engines[0].health() == SERVING
        assert "Traceback" not in stack.frontend.log()


# ---- an engine drains; the other takes over ------------------------------------------------


def test_sigterm_engine_drains_while_the_other_takes_new_requests(tiny_llama_dir: str, log_dir: Path) -> None:
    with start_stack(tiny_llama_dir, 2, log_dir) as stack:
        draining, other = stack.engines
        results, channel = start_streams(stack.address, NUM_STREAMS, LONG_TOKENS)
        with channel:
            wait_all([r.first_token for r in results])
            before = engine_info(draining.address)
            on_draining = before.num_running_reqs + before.num_waiting_reqs
            assert on_draining > 0, "least-load placement put nothing on engine 0"
            draining.proc.send_signal(signal.SIGTERM)
            draining.wait_health(NOT_SERVING, timeout=30)
            assert draining.health("readiness") == NOT_SERVING
            assert draining.health("liveness") == SERVING
            info = engine_info(draining.address)
            assert info.draining
            # New calls while it drains: served in full by the other engine, none lost.
            late, late_channel = start_streams(stack.address, 4, 64)
            with late_channel:
                assert_complete(late, 64)
            after = engine_info(draining.address) if draining.alive else None
            if after is not None:  # it took nothing new while draining
                assert after.num_running_reqs + after.num_waiting_reqs <= on_draining
            assert_complete(results, LONG_TOKENS)
        assert wait_exit(draining) == 0
        assert other.alive and stack.frontend.alive
        assert stack.frontend.health() == SERVING
        assert generate_error(stack.address) is None  # the remaining engine serves
        assert "Traceback" not in draining.log()


def test_drain_timeout_aborts_leftovers_with_a_clear_status(tiny_llama_dir: str, log_dir: Path) -> None:
    # One sequence at a time: 8 x 900 tokens cannot finish in a 1 s drain.
    # No waiting-queue bound: all 8 must be admitted to be left over by the drain.
    engine_args = (*ENGINE_ARGS, "--max-num-seqs", "1", "--max-pending-requests", "0", "--drain-timeout", "1")
    with start_stack(tiny_llama_dir, 1, log_dir, engine_args) as stack:
        (engine,) = stack.engines
        results, channel = start_streams(stack.address, NUM_STREAMS, LONG_TOKENS)
        with channel:
            wait_any([r.first_token for r in results])
            # All admitted before the drain starts: one that arrived after would be refused
            # ("engine 0 is draining"), not left over (seen once in a fresh-clone run).
            wait_admitted(engine.address, NUM_STREAMS)
            engine.proc.send_signal(signal.SIGTERM)
            wait_all([r.done for r in results])
        assert wait_exit(engine) == 0
        failed = [r for r in results if r.error is not None]
        assert failed, "a 1 s drain cannot have finished 8 sequential 900-token streams"
        for r in failed:
            assert r.error.code() == grpc.StatusCode.UNAVAILABLE, r.error
            assert "drain timeout: aborted" in (r.error.details() or ""), r.error.details()
        for r in results:
            if r.error is None:  # finished inside the drain: all its tokens
                assert (len(r.tokens), r.finish_reason) == (LONG_TOKENS, "length")
        assert "Traceback" not in engine.log()


# ---- tandem serve: the frontend first, then the engines -------------------------------------


@pytest.fixture
def serve_process(tiny_llama_dir: str, log_dir: Path) -> Iterator[tuple[ServiceProcess, int]]:
    log_dir.mkdir(parents=True, exist_ok=True)
    port, engine_port = serve_ports()
    args = [
        "serve", "--model", tiny_llama_dir, "--engines", "1", "--host", "127.0.0.1",
        "--port", str(port), "--engine-base-port", str(engine_port), "--metrics-port", "0",
        "--engine-metrics-base-port", "0", "--http-port", "0", "--connect-timeout", str(START_TIMEOUT),
        "--", *ENGINE_ARGS,
    ]
    proc = ServiceProcess.spawn("serve", args, f"127.0.0.1:{port}", log_dir)
    try:
        proc.wait_serving()
        yield proc, engine_port
    finally:
        proc.stop(timeout=30)


def test_sigterm_serve_drains_frontend_then_engines(serve_process: tuple[ServiceProcess, int]) -> None:
    serve, engine_port = serve_process
    engine_address = f"127.0.0.1:{engine_port}"
    assert health_at(engine_address) == SERVING
    results, channel = start_streams(serve.address, NUM_STREAMS, LONG_TOKENS)
    with channel:
        wait_all([r.first_token for r in results])
        assert not any(r.done.is_set() for r in results), "streams ended before the drain began"
        serve.proc.send_signal(signal.SIGTERM)
        serve.wait_health(NOT_SERVING, timeout=30)
        refused = generate_error(serve.address)
        assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        assert health_at(engine_address) == SERVING  # engines drain only after the frontend
        assert_complete(results, LONG_TOKENS)
    assert wait_exit(serve) == 0
    assert health_at(engine_address) is None, "the engine outlived tandem serve"
    assert "Traceback" not in serve.log()
