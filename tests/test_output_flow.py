"""Flow control of an engine's outputs (Hello.output_window): steps made while the
frontend is behind reach it merged, each request once, tokens in order."""

from __future__ import annotations

import queue
import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.protocol import convert
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    SchedulerStats,
    TokenColumns,
    UnmergeableError,
    merge_steps,
)
from tandem.protocol.sampling_params import SamplingParams
from tandem.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e_helpers import start_engine

CALL_TIMEOUT = 120.0


def _replay(steps: list[EngineCoreOutputs]) -> tuple[dict[str, list[int]], dict[str, FinishReason]]:
    """Each request's tokens in order, and how it finished, as a reader sees them."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    for step in steps:
        for out in step.all_outputs():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    return tokens, finished


def _random_steps(rng: random.Random, num_requests: int, num_steps: int) -> list[EngineCoreOutputs]:
    """Decode steps of ``num_requests`` requests that finish at random steps, some with
    logprobs (always, as a request that asked for them gets them every step)."""
    ends = {f"r{i}": rng.randint(1, num_steps) for i in range(num_requests)}
    with_logprobs = {rid for rid in ends if rng.random() < 0.3}
    steps = []
    for s in range(1, num_steps + 1):
        live = [rid for rid, end in ends.items() if s <= end]
        rng.shuffle(live)
        plain = [rid for rid in live if rid not in with_logprobs and s < ends[rid]]
        columns = TokenColumns(plain, [rng.randrange(1000) for _ in plain]) if plain else None
        outputs = []
        for rid in live:
            if rid in plain:
                continue
            token = rng.randrange(1000)
            lp = Logprobs([[token, 7]], [[-0.5, -1.5]], [1]) if rid in with_logprobs else None
            outputs.append(EngineCoreOutput(
                rid, [token], new_logprobs=lp, num_cached_tokens=s,
                finish_reason=FinishReason.LENGTH if s == ends[rid] else None,
            ))
        steps.append(EngineCoreOutputs(
            outputs=outputs, token_columns=columns, scheduler_stats=SchedulerStats(num_running_reqs=len(live)),
            finished_requests={o.request_id for o in outputs if o.finished} or None,
        ))
    return steps


def test_merged_steps_read_as_the_steps_one_by_one() -> None:
    rng = random.Random()
    for _ in range(20):
        steps = _random_steps(rng, rng.randint(1, 12), rng.randint(2, 8))
        merged = merge_steps(steps)
        assert merged.num_steps == len(steps)
        assert _replay([merged]) == _replay(steps)
        # Each request at most once, and the last step's stats.
        ids = [o.request_id for o in merged.outputs] + list(
            merged.token_columns.request_ids if merged.token_columns else []
        )
        assert len(ids) == len(set(ids))
        assert merged.scheduler_stats == steps[-1].scheduler_stats
        # Logprob rows stay aligned with tokens.
        for out in merged.outputs:
            if out.new_logprobs is not None:
                assert [row[0] for row in out.new_logprobs.token_ids] == out.new_token_ids
        # And the same through protobuf.
        wire = convert.engine_core_outputs_from_proto(convert.engine_core_outputs_to_proto(merged))
        assert wire.num_steps == len(steps)
        assert _replay([wire]) == _replay(steps)


def test_steps_that_cannot_merge_are_refused() -> None:
    done = EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1], finish_reason=FinishReason.STOP)])
    again = EngineCoreOutputs(token_columns=TokenColumns(["a"], [2]))  # a session's next turn
    with pytest.raises(UnmergeableError):
        merge_steps([done, again])
    lp = EngineCoreOutputs(outputs=[EngineCoreOutput("b", [1], new_logprobs=Logprobs([[1]], [[-0.1]], [1]))])
    plain = EngineCoreOutputs(token_columns=TokenColumns(["b"], [2]))
    with pytest.raises(UnmergeableError):
        merge_steps([lp, plain])
    # A later step that only finishes the request (no tokens) merges.
    end = EngineCoreOutputs(outputs=[EngineCoreOutput("b", [], finish_reason=FinishReason.ABORT)])
    merged = merge_steps([lp, end])
    assert merged.outputs[0].new_token_ids == [1] and merged.outputs[0].finish_reason == FinishReason.ABORT


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc = start_engine(tiny_llama_dir, 0, Path(tmp_path_factory.mktemp("flow")))
    try:
        proc.wait_health(1)
        yield proc.address
    finally:
        proc.proc.terminate()
        proc.proc.wait(30)


def _run(address: str, window: int, hold_s: float) -> tuple[dict[str, list[int]], list[int]]:
    """Four greedy requests on a raw Stream with ``window``; the reader acknowledges
    each message, but the first only after ``hold_s``. Every request's tokens, and the
    num_steps of each message with outputs."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    requests = [EngineCoreRequest(f"flow-{window}-{i}", [5 + i, 6, 7, 8 + i], params) for i in range(4)]
    inputs: queue.Queue[engine_pb2.EngineCoreInput | None] = queue.Queue()
    inputs.put(convert.hello_input(7, output_window=window))
    for r in requests:
        inputs.put(convert.add_input(r))

    def feed() -> Iterator[engine_pb2.EngineCoreInput]:
        while (item := inputs.get()) is not None:
            yield item

    steps: list[EngineCoreOutputs] = []
    num_steps: list[int] = []
    with grpc.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineCoreStub(channel).Stream(feed(), timeout=CALL_TIMEOUT)
        try:
            for msg in call:
                outs = convert.engine_core_outputs_from_proto(msg)
                if outs.num_outputs:
                    if not steps:
                        time.sleep(hold_s)  # the engine goes on stepping meanwhile
                    steps.append(outs)
                    num_steps.append(outs.num_steps)
                inputs.put(convert.ack_input(1))
                if len(_replay(steps)[1]) == len(requests):
                    break
        finally:
            inputs.put(None)
            call.cancel()
    tokens, finished = _replay(steps)
    assert set(finished.values()) == {FinishReason.LENGTH}
    return {rid.rsplit("-", 1)[1]: t for rid, t in tokens.items()}, num_steps


def test_a_frontend_that_falls_behind_gets_merged_steps_with_the_same_tokens(engine: str) -> None:
    plain, plain_steps = _run(engine, window=0, hold_s=0.5)
    assert set(plain_steps) == {1}  # without flow control: one message per step
    merged, merged_steps = _run(engine, window=1, hold_s=0.5)
    assert merged == plain
    assert all(len(t) == 24 for t in merged.values())
    # While the reader held the first message, the engine's later steps waited and came
    # as one message.
    assert max(merged_steps) > 1, merged_steps
    assert len(merged_steps) < len(plain_steps)


def test_inputs_sent_as_one_batch_are_applied_in_order(engine: str) -> None:
    """A frontend sends what queued up as one InputBatch: hello, adds and an abort of one
    of them, in that order; the engine says it reads batches."""
    with grpc.insecure_channel(engine) as channel:
        stub = engine_pb2_grpc.EngineCoreStub(channel)
        assert stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=CALL_TIMEOUT).accepts_input_batches
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        adds = [convert.add_input(EngineCoreRequest(f"batch-{i}", [5 + i, 6, 7], params)) for i in range(3)]
        batch = convert.batch_input(
            [convert.hello_input(8, output_window=2), *adds, convert.abort_input(["batch-1"])]
        )
        inputs: queue.Queue[engine_pb2.EngineCoreInput | None] = queue.Queue()
        inputs.put(batch)

        def feed() -> Iterator[engine_pb2.EngineCoreInput]:
            while (item := inputs.get()) is not None:
                yield item

        steps = []
        call = stub.Stream(feed(), timeout=CALL_TIMEOUT)
        try:
            for msg in call:
                steps.append(convert.engine_core_outputs_from_proto(msg))
                inputs.put(convert.ack_input(1))
                if len(_replay(steps)[1]) == 3:
                    break
        finally:
            inputs.put(None)
            call.cancel()
    tokens, finished = _replay(steps)
    assert finished == {"batch-0": FinishReason.LENGTH, "batch-1": FinishReason.ABORT, "batch-2": FinishReason.LENGTH}
    assert len(tokens["batch-0"]) == len(tokens["batch-2"]) == 8
