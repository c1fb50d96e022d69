"""AsyncLLM without an engine service: outputs a slow reader has not taken are merged."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Collection
from typing import Any

import pytest

from frontend_service.async_llm import AsyncLLM
from frontend_service.engine_client import EngineUnavailableError
from frontend_service.input_processor import InputProcessor
from frontend_service.outputs import CompletionOutput, Logprob, RequestOutput, merge_request_outputs
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from tandem.protocol.sampling_params import RequestOutputKind, SamplingParams


class FakeEngine:
    """Stands in for an EngineConnection and its group: records what AsyncLLM sends."""

    def __init__(self) -> None:
        self.address = "fake"
        self.added: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.closes = 0

    def pick(self, request: EngineCoreRequest | None = None, exclude: Collection[object] = ()) -> FakeEngine:
        if self in exclude:
            raise EngineUnavailableError("no other engine")
        return self

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request)

    def place(self, requests: list[EngineCoreRequest]) -> FakeEngine:
        for request in requests:
            self.add_request(request)
        return self

    def requests_on(self, engine: FakeEngine) -> set[str]:
        return {r.request_id for r in self.added}

    def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def close(self) -> None:
        self.closes += 1


def _llm(tokenizer: Any) -> tuple[AsyncLLM, FakeEngine]:
    engine = FakeEngine()
    processor = InputProcessor(tokenizer, 512, len(tokenizer), 5, tokenizer.eos_token_id)
    return AsyncLLM(tokenizer, engine, processor), engine  # type: ignore[arg-type]


def _step(request_id: str, token: int, finish: FinishReason | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, [token], finish_reason=finish)])


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_reader_that_fell_behind_gets_one_merged_output(
    tokenizer: Any, rng: random.Random, kind: RequestOutputKind
) -> None:
    async def scenario() -> tuple[list[RequestOutput], list[int]]:
        llm, engine = _llm(tokenizer)
        params = SamplingParams(max_tokens=6, output_kind=kind)
        stream = llm.generate(params, prompt_token_ids=[5, 6, 7], request_id="r")
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the request reaches the (fake) engine
        (request,) = engine.added
        tokens = [rng.randrange(10, len(tokenizer)) for _ in range(6)]
        llm.on_engine_outputs(engine, _step(request.request_id, tokens[0]))  # type: ignore[arg-type]
        outs = [await first]
        for token in tokens[1:4]:  # three steps before the reader comes back
            llm.on_engine_outputs(engine, _step(request.request_id, token))  # type: ignore[arg-type]
        outs.append(await stream.__anext__())
        llm.on_engine_outputs(engine, _step(request.request_id, tokens[4]))  # type: ignore[arg-type]
        llm.on_engine_outputs(engine, _step(request.request_id, tokens[5], FinishReason.LENGTH))  # type: ignore[arg-type]
        outs += [out async for out in stream]
        assert engine.aborted == []  # finished normally: nothing to abort
        return outs, tokens

    outs, tokens = asyncio.run(scenario())
    assert len(outs) == 3  # 6 engine steps, 3 reads
    assert [o.finished for o in outs] == [False, False, True]
    assert all(o.request_id == "r" for o in outs)
    ids = [o.outputs[0].token_ids for o in outs]
    if kind == RequestOutputKind.DELTA:
        assert ids == [tokens[:1], tokens[1:4], tokens[4:]]
        assert "".join(o.outputs[0].text for o in outs) == tokenizer.decode(tokens, skip_special_tokens=True)
    else:
        assert ids == [tokens[:1], tokens[:4], tokens]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert outs[-1].usage.completion_tokens == 6


def _completion(index: int, ids: list[int], finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(
        index=index, text="".join(f"<{t}>" for t in ids), token_ids=ids,
        cumulative_logprob=-float(len(ids)), logprobs=[{t: Logprob(-1.0, 1)} for t in ids],
        finish_reason=finish,  # type: ignore[arg-type]
    )


def test_merge_of_delta_outputs_concatenates_per_completion_index() -> None:
    earlier = RequestOutput("r", "p", [1, 2], [_completion(0, [3]), _completion(1, [4, 5])], False,
                            prompt_logprobs=[None, {2: Logprob(-0.5, 1)}])
    later = RequestOutput("r", "p", [1, 2], [_completion(0, [6], "stop"), _completion(2, [7])], False)
    merged = merge_request_outputs(earlier, later, delta=True)
    assert [c.index for c in merged.outputs] == [0, 1, 2]
    zero = merged.outputs[0]
    assert (zero.token_ids, zero.text, zero.finish_reason) == ([3, 6], "<3><6>", "stop")
    assert zero.logprobs is not None and [list(p) for p in zero.logprobs] == [[3], [6]]
    assert zero.cumulative_logprob == -1.0  # the later, running total
    assert merged.outputs[1].token_ids == [4, 5] and merged.outputs[2].token_ids == [7]
    assert merged.prompt_logprobs == earlier.prompt_logprobs
    assert merge_request_outputs(earlier, later, delta=False) is later


def test_a_by_name_adapter_request_reaches_the_engine_whole(tokenizer: Any) -> None:
    """``LoRARequest(name, 0)`` names an adapter the frontend knows: the engine request
    carries its id and path, so an engine that has not seen it yet can load it."""
    from tandem.protocol.lora import LoRARequest

    async def scenario() -> EngineCoreRequest:
        llm, engine = _llm(tokenizer)
        known = LoRARequest("sql", 3, "/adapters/sql")
        llm.loras.by_name["sql"] = known
        stream = llm.generate(SamplingParams(max_tokens=2), prompt_token_ids=[5, 6], lora_request=LoRARequest("sql", 0))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        (request,) = engine.added
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        return request

    request = asyncio.run(scenario())
    assert request.lora_request == LoRARequest("sql", 3, "/adapters/sql")


def test_a_stream_behind_on_its_writes_holds_up_one_round_only(tokenizer: Any) -> None:
    """The engine's next message waits for the streams a message woke, but a stream that
    has not written an earlier output yet (its client reads slowly) joins no later round."""
    from frontend_service.engine_client import OutputsRound

    async def scenario() -> tuple[int, int, bool]:
        llm, engine = _llm(tokenizer)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        stream = llm.generate(params, prompt_token_ids=[5, 6, 7], request_id="slow")
        first = asyncio.ensure_future(anext(stream))  # the reader takes one output, then stops
        await asyncio.sleep(0)
        rid = engine.added[0].request_id
        rounds = []
        for token in (11, 12, 13):
            engine.outputs_round = OutputsRound()  # type: ignore[attr-defined]
            llm.on_engine_outputs(engine, _step(rid, token))  # type: ignore[arg-type]
            rounds.append(engine.outputs_round)  # type: ignore[attr-defined]
            await asyncio.sleep(0)
        await first  # handed out; its write has not completed (the reader stopped)
        later_pending = sum(r.pending for r in rounds[1:])
        done = []
        for r in rounds:
            r.start(lambda: done.append(True), asyncio.get_running_loop())
        await stream.aclose()  # leaves its round
        return rounds[0].pending, later_pending, len(done) == 3

    first_pending, later_pending, all_done = asyncio.run(scenario())
    assert later_pending == 0  # the rounds after the first never waited for the slow stream
    assert first_pending == 0 and all_done  # and the first is released when it goes away


def test_shutdown_fails_running_streams_closes_the_engines_once_and_refuses_new_ones(tokenizer: Any) -> None:
    async def scenario() -> None:
        llm, engine = _llm(tokenizer)
        async with llm:
            stream = llm.generate(SamplingParams(max_tokens=4), prompt_token_ids=[5, 6], request_id="r")
            pending = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)
            assert len(engine.added) == 1
            await llm.shutdown()
            with pytest.raises(EngineUnavailableError, match="shut down"):
                await pending
            assert engine.closes == 1
        assert engine.closes == 1  # leaving `async with` after shutdown() closes nothing twice
        with pytest.raises(EngineUnavailableError, match="shut down"):
            await llm.generate(SamplingParams(max_tokens=4), prompt_token_ids=[5], request_id="s").__anext__()
        assert len(engine.added) == 1

    asyncio.run(scenario())
