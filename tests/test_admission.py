"""Admission control and deadlines over real processes (tiny Llama).

One engine with room for one running request and two waiting ones, behind a frontend:
a flood gets RESOURCE_EXHAUSTED (RetryInfo in the status details, the pushback
trailer) for what does not fit, and completes the rest; requests with 200 ms
deadlines under load end DEADLINE_EXCEEDED, and the engine is left with nothing
running or waiting and every KV block free.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client.parser import text_string_to_metric_families

from tandem.protocol import convert
from tandem.protocol.outputs import EngineCoreOutput, EngineCoreRequest, ErrorCode, FinishReason
from tandem.protocol.sampling_params import SamplingParams
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2
from tests.e2e_helpers import (
    ENGINE_ARGS,
    START_TIMEOUT,
    Stack,
    free_port,
    start_engine,
    start_frontend,
)

pytestmark = pytest.mark.timeout(240)

MAX_PENDING = 2
LONG_TOKENS = 900  # fits max_model_len 1024 with a short prompt; runs for seconds
CALL_TIMEOUT = 120.0


def _request(max_tokens: int, prompt: str = "Tell me a long story") -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(
        prompt=prompt,
        sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
            output_kind=common_pb2.OUTPUT_KIND_DELTA,
        ),
    )


def _call(stack: Stack, request: frontend_pb2.GenerateRequest, timeout: float) -> tuple[int, object]:
    """(number of tokens, None) when the call completed, else (-1, the RpcError)."""
    stub = stack.generation_stub()
    try:
        responses = list(stub.Generate(request, timeout=timeout))
    except grpc.RpcError as err:
        return -1, err
    return sum(len(o.token_ids) for r in responses for o in r.outputs), None


def _first_token_then_rest(stack: Stack, request: frontend_pb2.GenerateRequest) -> tuple[threading.Event, list[int]]:
    """Start a call on a thread; the event is set once its first response arrived."""
    started, result = threading.Event(), []

    def run() -> None:
        count = 0
        for response in stack.generation_stub().Generate(request, timeout=CALL_TIMEOUT):
            count += sum(len(o.token_ids) for o in response.outputs)
            started.set()
        result.append(count)

    threading.Thread(target=run, daemon=True).start()
    return started, result


def _result(result: list[int], timeout: float = 30.0) -> list[int]:
    """``result`` once the call's thread has read its last response (the engine goes idle
    a moment before the client has the final message)."""
    deadline = time.monotonic() + timeout
    while not result and time.monotonic() < deadline:
        time.sleep(0.02)
    return result


def _scrape(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, int, int]]:
    log_dir: Path = tmp_path_factory.mktemp("admission_logs")
    engine_metrics, frontend_metrics = free_port(), free_port()
    engine = start_engine(
        tiny_llama_dir, 0, log_dir,
        (*ENGINE_ARGS, "--max-num-seqs", "1", "--max-pending-requests", str(MAX_PENDING)),
        metrics_port=engine_metrics,
    )
    frontend = start_frontend(tiny_llama_dir, [engine.address], log_dir, metrics_port=frontend_metrics)
    built = Stack(tiny_llama_dir, [engine], frontend)
    try:
        engine.wait_serving(START_TIMEOUT)
        frontend.wait_serving(START_TIMEOUT)
        yield built, engine_metrics, frontend_metrics
    finally:
        built.stop()


def test_a_full_queue_answers_resource_exhausted_with_retry_info(stack: tuple[Stack, int, int]) -> None:
    stack_, engine_metrics, _ = stack
    stack_.wait_engines_idle()
    # One long request holds the only running slot, so the flood meets a full queue.
    started, blocker = _first_token_then_rest(stack_, _request(LONG_TOKENS))
    assert started.wait(CALL_TIMEOUT)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _call(stack_, _request(24), CALL_TIMEOUT), range(8)))
    completed = [n for n, err in results if err is None]
    refused = [err for _, err in results if err is not None]
    assert completed and refused, results
    assert all(n == 24 for n in completed)  # admitted ones run to the end
    for err in refused:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert f"max_pending_requests={MAX_PENDING}" in err.details()
        status = rpc_status.from_call(err)
        assert status is not None and status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        infos = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
        assert len(infos) == 1
        info = error_details_pb2.RetryInfo()
        infos[0].Unpack(info)
        trailers = dict(err.trailing_metadata())
        pushback = int(trailers["grpc-retry-pushback-ms"])
        assert pushback > 0 and info.retry_delay.ToMilliseconds() == pushback
    assert _scrape(engine_metrics, "tandem:request_rejected_total") >= len(refused)
    stack_.wait_engines_idle(CALL_TIMEOUT)
    assert _result(blocker) == [LONG_TOKENS]


def test_requests_past_their_deadline_end_deadline_exceeded_and_free_everything(
    stack: tuple[Stack, int, int],
) -> None:
    stack_, _, frontend_metrics = stack
    stack_.wait_engines_idle()
    started, blocker = _first_token_then_rest(stack_, _request(LONG_TOKENS))
    assert started.wait(CALL_TIMEOUT)
    # Under load: these wait behind the blocker until their 200 ms run out.
    with ThreadPoolExecutor(MAX_PENDING) as pool:
        results = list(pool.map(lambda _: _call(stack_, _request(LONG_TOKENS), 0.2), range(MAX_PENDING)))
    for _, err in results:
        assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, results
    stack_.wait_engines_idle(CALL_TIMEOUT)  # 0 running, 0 waiting, every block free
    assert _result(blocker) == [LONG_TOKENS]
    assert _scrape(frontend_metrics, "tandem:request_success_total") > 0


@dataclass
class _EngineRun:
    finished: dict[str, EngineCoreOutput]
    tokens: dict[str, int]
    elapsed: float  # seconds from sending the first request to the last finish


def _engine_run(address: str, first: EngineCoreRequest, then: EngineCoreRequest | None = None) -> _EngineRun:
    """Send ``first`` straight to the engine's Stream (as a frontend would), and ``then``
    once ``first`` produced its first token; wait until both finished."""
    requests = [r for r in (first, then) if r is not None]
    run = _EngineRun({}, {r.request_id: 0 for r in requests}, 0.0)
    first_token, done = threading.Event(), threading.Event()

    def inputs() -> Iterator[engine_pb2.EngineCoreInput]:
        yield convert.hello_input(99)
        yield convert.add_input(first)
        if then is not None:
            first_token.wait(CALL_TIMEOUT)
            yield convert.add_input(then)
        done.wait(CALL_TIMEOUT)  # closing the input side would end the stream

    start = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineCoreStub(channel).Stream(inputs(), timeout=CALL_TIMEOUT)
        try:
            for msg in call:
                for out in convert.engine_core_outputs_from_proto(msg).all_outputs():
                    run.tokens[out.request_id] += len(out.new_token_ids)
                    if out.new_token_ids:
                        first_token.set()
                    if out.finished:
                        run.finished[out.request_id] = out
                if len(run.finished) == len(requests):
                    break
        finally:
            done.set()
            call.cancel()
    run.elapsed = time.monotonic() - start
    return run


def test_engine_drops_a_waiting_request_and_aborts_a_running_one_at_their_deadlines(
    stack: tuple[Stack, int, int],
) -> None:
    """Straight to the engine's Stream: the engine itself reports DEADLINE_EXCEEDED."""
    stack_, engine_metrics, _ = stack
    address = stack_.engines[0].address
    stack_.wait_engines_idle()
    params = SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)
    # How long a whole long request takes here; the deadlines below are fractions of it.
    full = _engine_run(address, EngineCoreRequest("dl-calibrate", [1, 2, 3, 4], params)).elapsed
    before = _scrape(engine_metrics, "tandem:request_deadline_exceeded_total")
    # The running one expires halfway; the one sent after its first token waits
    # (max_num_seqs 1) and expires first, at a sixth.
    running = EngineCoreRequest("dl-running", [1, 2, 3, 4], params, timeout_s=full / 2)
    waiting = EngineCoreRequest("dl-waiting", [5, 6, 7, 8], params, timeout_s=full / 6)
    run = _engine_run(address, running, waiting)
    for rid in ("dl-running", "dl-waiting"):
        out = run.finished[rid]
        assert out.finish_reason == FinishReason.ERROR
        assert out.error is not None and out.error.code == ErrorCode.DEADLINE_EXCEEDED, out
    assert run.tokens["dl-waiting"] == 0, (run, full)
    assert 0 < run.tokens["dl-running"] < LONG_TOKENS, (run, full)
    infos = stack_.wait_engines_idle(CALL_TIMEOUT)
    assert infos[0].num_free_blocks == infos[0].num_kv_blocks
    assert _scrape(engine_metrics, "tandem:request_deadline_exceeded_total") >= before + 2
