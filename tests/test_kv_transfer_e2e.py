"""Disaggregated prefill and decode end to end, as processes: a producer engine
(--kv-role producer), a consumer engine (--kv-role consumer), a frontend with
--disaggregated and, on the same engines, an aggregated frontend as the reference.
The tokens agree, the consumer pulled the KV (its kv_transfer metrics), every block is
free afterwards on both engines; a consumer killed mid-decode migrates its requests; a
producer killed between its prefill and the consumer's pull costs the consumer a
recomputed prompt, not the request."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import (
    ENGINE_ARGS,
    ServiceProcess,
    Stack,
    free_port,
    serve_ports,
    start_engine,
    start_frontend,
)

CALL_TIMEOUT = 120.0
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog and then " * 4,
    "In a hole in the ground there lived a hobbit. " * 6,
]


class DisaggregatedStack:
    def __init__(self, model_dir: str, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_ports = [free_port(), free_port()]
        self.producer = start_engine(
            model_dir,
            0,
            log_dir,
            (*ENGINE_ARGS, "--kv-role", "producer"),
            metrics_port=self.metrics_ports[0],
        )
        self.consumer = start_engine(
            model_dir,
            1,
            log_dir,
            (*ENGINE_ARGS, "--kv-role", "consumer"),
            metrics_port=self.metrics_ports[1],
        )
        engines = [self.producer.address, self.consumer.address]
        self.disaggregated = start_frontend(
            model_dir,
            engines,
            log_dir,
            name="frontend-disagg",
            env=_env_with(TANDEM_DISAGGREGATED="1"),
        )
        self.aggregated = start_frontend(model_dir, engines, log_dir, name="frontend-agg")
        self.procs: list[ServiceProcess] = [
            self.producer,
            self.consumer,
            self.disaggregated,
            self.aggregated,
        ]
        for proc in self.procs:
            proc.wait_serving()
        self.stack = Stack(model_dir, [self.producer, self.consumer], self.disaggregated)

    def stop(self) -> None:
        self.stack.stop()
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.stop()

    def metric(self, engine: int, name: str) -> float:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_ports[engine]}/metrics", timeout=10
        ) as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)
        )


def _env_with(**values: str) -> dict[str, str]:
    from tests.e2e_helpers import child_env

    env = child_env()
    env.update(values)
    return env


@pytest.fixture(scope="module")
def stack(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DisaggregatedStack]:
    s = DisaggregatedStack(tiny_llama_dir, tmp_path_factory.mktemp("kv_transfer_e2e"))
    try:
        yield s
    finally:
        s.stop()


def _generate(
    address: str, prompt: str, params: common_pb2.SamplingParams
) -> tuple[list[int], str]:
    with grpc.insecure_channel(address) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)
        responses = list(
            stub.Generate(
                frontend_pb2.GenerateRequest(prompt=prompt, sampling_params=params),
                timeout=CALL_TIMEOUT,
            )
        )
    assert responses and responses[-1].finished
    tokens = [t for r in responses for o in r.outputs for t in o.token_ids]
    return tokens, responses[-1].outputs[0].finish_reason


def _params(max_tokens: int, seed: int | None = None) -> common_pb2.SamplingParams:
    if seed is None:
        return common_pb2.SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            output_kind=common_pb2.OUTPUT_KIND_DELTA,
        )
    return common_pb2.SamplingParams(
        temperature=1.0,
        top_p=0.9,
        seed=seed,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=common_pb2.OUTPUT_KIND_DELTA,
    )


def test_engines_report_their_kv_role(stack: DisaggregatedStack) -> None:
    roles = []
    for engine in (stack.producer, stack.consumer):
        with grpc.insecure_channel(engine.address) as channel:
            info = engine_pb2_grpc.EngineCoreStub(channel).GetEngineInfo(
                engine_pb2.GetEngineInfoRequest(), timeout=10
            )
        roles.append(info.kv_role)
    assert roles == ["producer", "consumer"]


def test_disaggregated_tokens_equal_aggregated(stack: DisaggregatedStack) -> None:
    before = stack.metric(1, 'tandem:kv_transfer_bytes_total{direction="received"')
    for i, prompt in enumerate(PROMPTS):
        for seed in (None, 100 + i):
            want = _generate(stack.aggregated.address, prompt, _params(12, seed))
            got = _generate(stack.disaggregated.address, prompt, _params(12, seed))
            assert got == want and len(got[0]) == 12 and got[1] == "length"
    assert stack.metric(1, 'tandem:kv_transfer_bytes_total{direction="received"') > before
    assert stack.metric(0, 'tandem:kv_transfer_bytes_total{direction="sent"') > 0
    assert stack.metric(1, "tandem:kv_transfer_failures_total") == 0
    stack.stack.wait_engines_idle()  # the producer freed what was pulled: every block free


def test_one_token_requests_stay_aggregated(stack: DisaggregatedStack) -> None:
    tokens, reason = _generate(stack.disaggregated.address, PROMPTS[0], _params(1))
    assert len(tokens) == 1 and reason == "length"
    stack.stack.wait_engines_idle()


def test_serve_with_prefill_and_decode_engines(
    stack: DisaggregatedStack, tiny_llama_dir: str, tmp_path: Path
) -> None:
    port, engine_port = serve_ports(engines=2)
    args = [
        "serve",
        "--model",
        tiny_llama_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--engine-base-port",
        str(engine_port),
        "--metrics-port",
        "0",
        "--engine-metrics-base-port",
        "0",
        "--http-port",
        "0",
        "--prefill-engines",
        "1",
        "--decode-engines",
        "1",
        "--",
        *ENGINE_ARGS,
    ]
    serve = ServiceProcess.spawn("serve", args, f"127.0.0.1:{port}", tmp_path)
    try:
        serve.wait_serving()
        roles = []
        for i in range(2):
            with grpc.insecure_channel(f"127.0.0.1:{engine_port + i}") as channel:
                info = engine_pb2_grpc.EngineCoreStub(channel).GetEngineInfo(
                    engine_pb2.GetEngineInfoRequest(), timeout=10
                )
            roles.append(info.kv_role)
        assert roles == ["producer", "consumer"]
        for prompt in PROMPTS[1:]:
            assert _generate(serve.address, prompt, _params(10)) == _generate(
                stack.aggregated.address, prompt, _params(10)
            )
        assert "serves its KV to consumers" in serve.log()
    finally:
        serve.stop(timeout=60)


def test_consumer_killed_mid_decode_migrates(stack: DisaggregatedStack) -> None:
    want = _generate(stack.aggregated.address, PROMPTS[2], _params(600))
    with grpc.insecure_channel(stack.disaggregated.address) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(
            frontend_pb2.GenerateRequest(prompt=PROMPTS[2], sampling_params=_params(600)),
            timeout=CALL_TIMEOUT,
        )
        tokens: list[int] = []
        killed = False
        for response in call:
            tokens += [t for o in response.outputs for t in o.token_ids]
            if not killed and len(tokens) >= 5:
                stack.consumer.kill()
                killed = True
    assert killed
    assert tokens == want[0]
    assert "migrated from engine" in stack.disaggregated.log()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the producer computed the rest itself; all free
        with grpc.insecure_channel(stack.producer.address) as channel:
            info = engine_pb2_grpc.EngineCoreStub(channel).GetEngineInfo(
                engine_pb2.GetEngineInfoRequest(), timeout=10
            )
        if info.num_free_blocks == info.num_kv_blocks:
            break
        time.sleep(0.2)
    assert info.num_free_blocks == info.num_kv_blocks


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (SIGSTOP took effect)."""
    task_dir = Path(f"/proc/{pid}/task")
    states = []
    for task in task_dir.iterdir():
        with contextlib.suppress(OSError):  # a thread that just exited
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in ("T", "t") for state in states)


def test_producer_killed_before_the_pull_recomputes_on_the_consumer(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    """The producer dies (SIGKILL) after its prefill's first token reached the frontend
    and before the consumer pulls: the consumer cannot pull, so it computes the prompt
    itself; the request is not migrated, its tokens are the aggregated run's, the
    consumer's blocks all go free and the client sees no error.

    The order is forced, not raced: the consumer is stopped (SIGSTOP, every thread
    checked stopped) before the request is sent, so it cannot even receive the
    hand-off; the producer's first token streams to the client (the frontend handed
    the request to the consumer in the same callback), then the producer is killed
    and reaped, and only then does the consumer go on (SIGCONT) and try its pull."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    s = DisaggregatedStack(tiny_llama_dir, tmp_path / "logs")
    consumer_pid = s.consumer.proc.pid
    stopped = False
    try:
        with grpc.insecure_channel(s.disaggregated.address) as channel:
            vocab = (
                frontend_pb2_grpc.GenerationStub(channel)
                .GetModelInfo(frontend_pb2.GetModelInfoRequest(), timeout=10)
                .vocab_size
            )
        # Several full KV blocks and a partial one (block size 16).
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(40, 200))]
        request = frontend_pb2.GenerateRequest(
            prompt_token_ids=frontend_pb2.TokenIds(token_ids=prompt), sampling_params=_params(16)
        )
        with grpc.insecure_channel(s.aggregated.address) as channel:
            reference = list(
                frontend_pb2_grpc.GenerationStub(channel).Generate(request, timeout=CALL_TIMEOUT)
            )
        want = [t for r in reference for o in r.outputs for t in o.token_ids]
        assert len(want) == 16, f"seed {seed}: aggregated run gave {want}"
        # The reference may have run on the consumer: without its cached prefix the
        # consumer must pull the whole prompt.
        s.stack.wait_engines_idle()
        s.stack.reset_prefix_caches()
        failures_before = s.metric(1, "tandem:kv_transfer_failures_total")
        received_before = s.metric(1, 'tandem:kv_transfer_bytes_total{direction="received"')

        os.kill(consumer_pid, signal.SIGSTOP)
        stopped = True
        deadline = time.monotonic() + 30  # a safety bound, not a timing assert
        while not _all_threads_stopped(consumer_pid):
            assert time.monotonic() < deadline, "SIGSTOP did not stop the consumer"
            time.sleep(0.01)
        with grpc.insecure_channel(s.disaggregated.address) as channel:
            responses = []
            call = frontend_pb2_grpc.GenerationStub(channel).Generate(request, timeout=CALL_TIMEOUT)
            for response in call:  # the producer's first token, then the consumer's rest
                responses.append(response)
                if stopped and any(o.token_ids for o in response.outputs):
                    s.producer.kill()  # SIGKILL and reap: its held KV is gone
                    os.kill(consumer_pid, signal.SIGCONT)
                    stopped = False
        got = [t for r in responses for o in r.outputs for t in o.token_ids]
        assert not stopped, f"seed {seed}: no token came from the producer"
        assert s.producer.proc.returncode == -signal.SIGKILL, f"seed {seed}"
        assert responses[-1].finished, f"seed {seed}: the stream ended unfinished"
        assert responses[-1].outputs[0].finish_reason == "length", f"seed {seed}"
        assert got == want, f"seed {seed}: prompt {prompt}: {got} != aggregated {want}"
        # The consumer tried its pull, failed it and computed the prompt itself: the
        # request stayed on the consumer (nothing migrated) and nothing was received.
        assert s.metric(1, "tandem:kv_transfer_failures_total") == failures_before + 1, (
            f"seed {seed}"
        )
        assert (
            s.metric(1, 'tandem:kv_transfer_bytes_total{direction="received"') == received_before
        ), f"seed {seed}"
        pull_failed = f"pulling its KV from {s.producer.address} failed"
        assert pull_failed in s.consumer.log(), f"seed {seed}"
        assert "migrated from engine" not in s.disaggregated.log(), f"seed {seed}"
        (info,) = s.stack.wait_engines_idle()  # the consumer alone is left: every block free
        assert info.num_free_blocks == info.num_kv_blocks, f"seed {seed}"
    finally:
        if stopped:
            os.kill(consumer_pid, signal.SIGCONT)
        s.stop()
