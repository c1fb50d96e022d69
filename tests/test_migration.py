"""Request migration over real processes: ``tandem serve --engines 2``, one engine lost
mid-stream (SIGKILL, then a SIGTERM drain past its drain timeout), and every stream
completes exactly as an undisturbed run of the same requests.

Eight streams mix greedy and seeded temperature-0.8 sampling, n=1 and n=2, a stop string
and logprobs. Compared per sequence: text, token ids, finish reason, logprob token ids
and ranks exactly, logprob values to 1e-4 (the continuation computes its first token in a
prefill instead of a decode step: the same math in another order).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import (
    ADMIN_METADATA,
    ENGINE_ARGS,
    START_TIMEOUT,
    ServiceProcess,
    serve_ports,
)

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 240
CALL_TIMEOUT = 180.0
DRAIN_TIMEOUT = 0.02  # the engines' (and frontend's) drain: far shorter than any stream (a tiny-model
# step takes ~0.5 ms on a fast CPU, so 240 tokens outlast 0.3 s no longer)
LOGPROB_TOLERANCE = 1e-4


@dataclass
class Sequence:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    lp_token_ids: list[int] = field(default_factory=list)
    lp_ranks: list[int] = field(default_factory=list)
    lp_values: list[float] = field(default_factory=list)
    finish_reason: str = ""


@dataclass
class Stream:
    """What one Generate stream delivered (filled by its reader thread)."""

    sequences: dict[int, Sequence] = field(default_factory=dict)
    error: grpc.RpcError | None = None
    messages: int = 0
    finished: bool = False
    done: threading.Event = field(default_factory=threading.Event)


def _params(**kw: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(output_kind=common_pb2.OUTPUT_KIND_DELTA, max_tokens=MAX_TOKENS, **kw)


def _requests(stop: str) -> list[frontend_pb2.GenerateRequest]:
    seeded = dict(temperature=0.8)
    params = [
        _params(temperature=0.0),
        _params(temperature=0.0, logprobs=3),
        _params(seed=11, **seeded),
        _params(seed=12, n=2, **seeded),
        _params(seed=13, logprobs=2, **seeded),
        _params(temperature=0.0, stop=[stop]),
        _params(seed=14, n=2, presence_penalty=0.5, repetition_penalty=1.1, **seeded),
        _params(seed=15, top_k=20, top_p=0.9, min_tokens=MAX_TOKENS // 2, **seeded),
    ]
    return [frontend_pb2.GenerateRequest(prompt=f"Story number {i}:", sampling_params=p) for i, p in enumerate(params)]


def _read(stub: frontend_pb2_grpc.GenerationStub, request: frontend_pb2.GenerateRequest, stream: Stream) -> None:
    try:
        for response in stub.Generate(request, timeout=CALL_TIMEOUT):
            stream.messages += 1
            for out in response.outputs:
                seq = stream.sequences.setdefault(out.index, Sequence())
                seq.text += out.text
                seq.token_ids += out.token_ids
                lp = out.logprobs.logprobs
                if lp.num_columns:
                    seq.lp_token_ids += lp.token_ids
                    seq.lp_ranks += lp.ranks
                    seq.lp_values += lp.logprobs
                if out.finish_reason:
                    seq.finish_reason = out.finish_reason
            stream.finished = response.finished
    except grpc.RpcError as exc:
        stream.error = exc
    finally:
        stream.done.set()


def _start(address: str, requests: list[frontend_pb2.GenerateRequest]) -> tuple[list[Stream], grpc.Channel]:
    channel = grpc.insecure_channel(address)
    stub = frontend_pb2_grpc.GenerationStub(channel)
    streams = [Stream() for _ in requests]
    for request, stream in zip(requests, streams):
        threading.Thread(target=_read, args=(stub, request, stream), daemon=True).start()
    return streams, channel


def _wait(condition, what: str, timeout: float = CALL_TIMEOUT) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _run(address: str, requests: list[frontend_pb2.GenerateRequest], disturb=None) -> list[Stream]:  # type: ignore[no-untyped-def]
    streams, channel = _start(address, requests)
    with channel:
        if disturb is not None:
            # Mid-stream: every stream has tokens and none has finished.
            _wait(lambda: all(s.messages >= 2 or s.done.is_set() for s in streams), "every stream to start")
            assert not any(s.done.is_set() for s in streams), "a stream ended before the engine was lost"
            disturb()
        _wait(lambda: all(s.done.is_set() for s in streams), "every stream to end")
    return streams


def _assert_same(expected: list[Stream], got: list[Stream]) -> None:
    for i, (want, have) in enumerate(zip(expected, got)):
        assert have.error is None, f"stream {i} failed: {have.error.code().name}: {have.error.details()}"
        assert have.finished and want.finished
        assert sorted(have.sequences) == sorted(want.sequences)
        for index, seq in want.sequences.items():
            other = have.sequences[index]
            where = f"stream {i} sequence {index}"
            assert other.token_ids == seq.token_ids, where
            assert other.text == seq.text, where
            assert other.finish_reason == seq.finish_reason, where
            assert other.lp_token_ids == seq.lp_token_ids and other.lp_ranks == seq.lp_ranks, where
            assert other.lp_values == pytest.approx(seq.lp_values, abs=LOGPROB_TOLERANCE), where


def _engine_pid(log: str, index: int) -> int:
    return [int(p) for p in re.findall(rf"engine {index} started \(pid (\d+)\)", log)][-1]


def _serve(model_dir: str, log_dir: Path, *engine_args: str) -> Iterator[ServiceProcess]:
    """``tandem serve --engines 2`` on the model, SERVING; ``engine_args`` after ENGINE_ARGS."""
    port, engine_port = serve_ports(2)
    args = [
        "serve", "--model", model_dir, "--engines", "2", "--host", "127.0.0.1", "--port", str(port),
        "--engine-base-port", str(engine_port), "--metrics-port", "0", "--engine-metrics-base-port", "0",
        "--http-port", "0", "--connect-timeout", str(START_TIMEOUT), "--drain-timeout", str(DRAIN_TIMEOUT),
        "--restart-backoff", "0.5", "--", *ENGINE_ARGS, *engine_args,
    ]
    proc = ServiceProcess.spawn("serve", args, f"127.0.0.1:{port}", log_dir)
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.stop(timeout=60)


@pytest.fixture(scope="module")
def serve(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    yield from _serve(tiny_llama_dir, Path(tmp_path_factory.mktemp("migration")))


@pytest.fixture(scope="module")
def undisturbed(serve: ServiceProcess) -> tuple[list[frontend_pb2.GenerateRequest], list[Stream]]:
    # A stop string the greedy text reaches late (after the engine is lost): taken from
    # the text of a plain greedy run of the same prompt.
    prompt = _requests("unused")[5].prompt
    (probe,) = _run(serve.address, [frontend_pb2.GenerateRequest(prompt=prompt, sampling_params=_params(temperature=0.0))])
    text = probe.sequences[0].text
    start = next(i for i in range(len(text) * 2 // 3, len(text) - 6) if text.find(text[i : i + 6]) == i)
    requests = _requests(text[start : start + 6])
    streams = _run(serve.address, requests)
    assert all(s.error is None and s.finished for s in streams)
    assert streams[5].sequences[0].finish_reason == "stop"
    assert streams[1].sequences[0].lp_token_ids and streams[4].sequences[0].lp_token_ids
    return requests, streams


def _migrations(log: str) -> int:
    return len(re.findall(r"request \S+ migrated from engine", log))


def _engines_back(serve: ServiceProcess) -> None:
    """Wait until the frontend places on both engines again (a killed or drained one is
    restarted by serve and rejoins): FrontendAdmin.ListEngines says SERVING twice."""
    def serving() -> int:
        with grpc.insecure_channel(serve.address) as channel:
            reply = frontend_pb2_grpc.FrontendAdminStub(channel).ListEngines(
                frontend_pb2.ListEnginesRequest(), timeout=10, metadata=ADMIN_METADATA
            )
        return sum(e.state == frontend_pb2.ENGINE_STATE_SERVING for e in reply.engines)
    _wait(lambda: not serve.alive or serving() == 2, "both engines to serve this frontend", START_TIMEOUT)
    assert serve.alive, serve.log_tail()


def _lose_engine_mid_stream(
    serve: ServiceProcess, undisturbed: tuple[list[frontend_pb2.GenerateRequest], list[Stream]],
    index: int, sig: signal.Signals, reason: str,
) -> None:
    """Run the requests again, send ``sig`` to engine ``index`` mid-stream: every stream
    equals the undisturbed run, and some moved off that engine for ``reason``."""
    requests, expected = undisturbed
    _engines_back(serve)
    before = _migrations(serve.log())
    victim = _engine_pid(serve.log(), index)
    got = _run(serve.address, requests, lambda: os.kill(victim, sig))
    _assert_same(expected, got)
    log = serve.log()
    assert _migrations(log) > before, f"no stream moved off engine {index}"
    assert reason in log


def test_a_sigkilled_engine_s_streams_continue_exactly(
    serve: ServiceProcess, undisturbed: tuple[list[frontend_pb2.GenerateRequest], list[Stream]]
) -> None:
    _lose_engine_mid_stream(serve, undisturbed, 0, signal.SIGKILL, "engine_dead")


def test_a_drained_engine_s_leftovers_continue_exactly(
    serve: ServiceProcess, undisturbed: tuple[list[frontend_pb2.GenerateRequest], list[Stream]]
) -> None:
    """SIGTERM: the engine drains for --drain-timeout 0.02 s, then aborts what is left
    with UNAVAILABLE; the frontend moves those streams on."""
    _lose_engine_mid_stream(serve, undisturbed, 1, signal.SIGTERM, "engine_drained")


SPECULATIVE = {
    "ngram": '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}',
    "suffix": '{"method": "suffix", "num_speculative_tokens": 4, "draft_token_cost": 0.01}',
    # the target's own weights in int8 as the draft model
    "draft_model": '{"model": "%s", "num_speculative_tokens": 4, "quantization": "int8", "draft_model_cost": 0.01}',
}


@pytest.fixture(scope="module", params=list(SPECULATIVE))
def spec_serve(
    request: pytest.FixtureRequest, tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """The same deployment with speculative decoding in both engines, by each proposer."""
    spec = SPECULATIVE[request.param].replace("%s", tiny_llama_dir)
    yield from _serve(tiny_llama_dir, Path(tmp_path_factory.mktemp("spec_migration")), "--speculative-config", spec)


def test_with_speculation_streams_equal_and_continue_exactly_after_a_sigkill(
    spec_serve: ServiceProcess, undisturbed: tuple[list[frontend_pb2.GenerateRequest], list[Stream]]
) -> None:
    """Drafts change no stream (greedy and seeded token for token, stop string, logprobs
    requests), and a stream that loses its engine mid-way continues on the other exactly."""
    requests, expected = undisturbed
    _engines_back(spec_serve)
    streams = _run(spec_serve.address, requests)
    _assert_same(expected, streams)
    _lose_engine_mid_stream(spec_serve, undisturbed, 0, signal.SIGKILL, "engine_dead")
