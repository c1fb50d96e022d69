"""Request migration in AsyncLLM, without engine services (fake engines record sends).

A stream whose engine is lost continues on another engine as a continuation carrying
the tokens the frontend received; its caller sees no error and no duplicate. Off, over
the per-request limit, for a session, or with no other engine: UNAVAILABLE as before.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from frontend_service.async_llm import AsyncLLM
from frontend_service.engine_client import EngineUnavailableError
from frontend_service.input_processor import InputProcessor
from frontend_service.migration import MigrationConfig
from tandem.protocol.outputs import EngineCoreOutputs, ErrorCode
from tandem.protocol.sampling_params import RequestOutputKind, SamplingParams
from tests.test_admission_frontend import FakeEngine, FakeGroup, _error, _started, _token


def _llm(tokenizer: Any, group: FakeGroup, config: MigrationConfig | None = None) -> AsyncLLM:
    processor = InputProcessor(tokenizer, 512, len(tokenizer), 5, tokenizer.eos_token_id)
    return AsyncLLM(tokenizer, group, processor, migration=config)  # type: ignore[arg-type]


def _params(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=6, output_kind=RequestOutputKind.DELTA, **kw)


def test_a_lost_engine_s_stream_continues_on_another_with_its_tokens(tokenizer: Any) -> None:
    async def scenario() -> None:
        a, b = FakeEngine("a"), FakeEngine("b")
        llm = _llm(tokenizer, FakeGroup(a, b))
        stream = llm.generate(_params(seed=3, prompt_logprobs=1), prompt_token_ids=[5, 6, 7], request_id="r")
        first = await _started(stream)
        (request,) = a.added
        rid = request.request_id
        llm.on_engine_outputs(a, _token(rid, 40))  # type: ignore[arg-type]
        llm.on_engine_outputs(a, _token(rid, 41))  # type: ignore[arg-type]
        got = [await first]
        llm.on_engine_dead(a, "engine a: stream lost")  # type: ignore[arg-type]
        (moved,) = b.added
        assert moved.request_id == rid and moved.prompt_token_ids == [5, 6, 7]
        assert moved.generated_token_ids == [40, 41]
        assert moved.sampling_params.prompt_logprobs is None  # delivered with the first tokens
        assert moved.sampling_params.seed == 3 and moved.sampling_params.max_tokens == 6
        llm.on_engine_outputs(a, _token(rid, 99))  # type: ignore[arg-type]  # stale: dropped
        for token in (42, 43, 44):
            llm.on_engine_outputs(b, _token(rid, token))  # type: ignore[arg-type]
        from tandem.protocol.outputs import FinishReason

        llm.on_engine_outputs(b, _token(rid, 45, FinishReason.LENGTH))  # type: ignore[arg-type]
        got += [out async for out in stream]
        tokens = [t for out in got for t in out.outputs[0].token_ids]
        assert tokens == [40, 41, 42, 43, 44, 45]  # no gap, no duplicate, nothing stale
        assert got[-1].finished and got[-1].outputs[0].finish_reason == "length"
        assert llm.num_unfinished == 0

    asyncio.run(scenario())


def test_a_drain_timeout_abort_migrates_after_output(tokenizer: Any) -> None:
    async def scenario() -> None:
        a, b = FakeEngine("a"), FakeEngine("b")
        llm = _llm(tokenizer, FakeGroup(a, b))
        stream = llm.generate(_params(n=2, seed=1), prompt_token_ids=[5, 6, 7], request_id="r")
        first = await _started(stream)
        ids = [r.request_id for r in a.added]
        llm.on_engine_outputs(a, EngineCoreOutputs(outputs=[  # type: ignore[arg-type]
            *_token(ids[0], 30).outputs, *_token(ids[1], 31).outputs,
        ]))
        await first
        llm.on_engine_outputs(a, _error(ids[0], ErrorCode.UNAVAILABLE))  # type: ignore[arg-type]
        assert sorted((r.request_id, tuple(r.generated_token_ids)) for r in b.added) == sorted(
            [(ids[0], (30,)), (ids[1], (31,))]
        )  # both children move, each with its own tokens
        llm.on_engine_outputs(a, _error(ids[1], ErrorCode.UNAVAILABLE))  # type: ignore[arg-type]  # stale
        assert len(b.added) == 2 and llm.num_unfinished == 1
        await stream.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("config", [MigrationConfig(enabled=False), MigrationConfig(max_migrations=0)])
def test_migration_off_or_over_its_limit_fails_unavailable(tokenizer: Any, config: MigrationConfig) -> None:
    async def scenario() -> None:
        a, b = FakeEngine("a"), FakeEngine("b")
        llm = _llm(tokenizer, FakeGroup(a, b), config)
        stream = llm.generate(_params(), prompt_token_ids=[5, 6, 7], request_id="r")
        first = await _started(stream)
        llm.on_engine_outputs(a, _token(a.added[0].request_id, 40))  # type: ignore[arg-type]
        await first
        llm.on_engine_dead(a, "engine a: stream lost")  # type: ignore[arg-type]
        with pytest.raises(EngineUnavailableError, match="stream lost"):
            await stream.__anext__()
        assert b.added == []

    asyncio.run(scenario())


def test_each_request_migrates_at_most_max_migrations_times(tokenizer: Any) -> None:
    async def scenario() -> None:
        engines = [FakeEngine(name) for name in "abc"]
        llm = _llm(tokenizer, FakeGroup(*engines), MigrationConfig(max_migrations=1))
        stream = llm.generate(_params(), prompt_token_ids=[5, 6, 7], request_id="r")
        first = await _started(stream)
        rid = engines[0].added[0].request_id
        llm.on_engine_outputs(engines[0], _token(rid, 40))  # type: ignore[arg-type]
        await first
        llm.on_engine_dead(engines[0], "a lost")  # type: ignore[arg-type]
        assert [r.generated_token_ids for r in engines[1].added] == [[40]]
        llm.on_engine_dead(engines[1], "b lost")  # type: ignore[arg-type]
        with pytest.raises(EngineUnavailableError, match="b lost"):
            await stream.__anext__()
        assert engines[2].added == []

    asyncio.run(scenario())


def test_with_no_other_engine_and_no_wait_the_stream_fails_unavailable(tokenizer: Any) -> None:
    async def scenario() -> None:
        a = FakeEngine("a")
        llm = _llm(tokenizer, FakeGroup(a), MigrationConfig(wait_s=0))
        stream = llm.generate(_params(), prompt_token_ids=[5, 6, 7], request_id="r")
        first = await _started(stream)
        llm.on_engine_dead(a, "engine a: stream lost")  # type: ignore[arg-type]
        with pytest.raises(EngineUnavailableError):
            await first
        assert llm.num_unfinished == 0

    asyncio.run(scenario())


def test_a_stream_waits_for_an_engine_to_serve_again(tokenizer: Any) -> None:
    """The only engine is lost (a rolling restart): the stream waits, and continues on the
    first engine that serves; its caller sees no error."""
    async def scenario() -> None:
        a, b = FakeEngine("a"), FakeEngine("b")
        group = FakeGroup(a)
        llm = _llm(tokenizer, group, MigrationConfig(wait_s=30))
        stream = llm.generate(_params(), prompt_token_ids=[5, 6, 7], request_id="r")
        first = await _started(stream)
        rid = a.added[0].request_id
        llm.on_engine_outputs(a, _token(rid, 40))  # type: ignore[arg-type]
        await first
        group.engines.remove(a)  # dead: no longer placeable
        llm.on_engine_dead(a, "engine a: stream lost")  # type: ignore[arg-type]
        nxt = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.2)
        assert not nxt.done() and b.added == []  # waiting, not failed
        group.engines.append(b)  # an engine serves again
        while not b.added:
            await asyncio.sleep(0.01)
        assert b.added[0].generated_token_ids == [40]
        from tandem.protocol.outputs import FinishReason

        llm.on_engine_outputs(b, _token(rid, 41, FinishReason.LENGTH))  # type: ignore[arg-type]
        out = await nxt
        assert out.outputs[0].token_ids == [41] and out.finished

    asyncio.run(scenario())


def test_a_waiting_stream_fails_unavailable_when_no_engine_comes(tokenizer: Any) -> None:
    async def scenario() -> None:
        a = FakeEngine("a")
        group = FakeGroup(a)
        llm = _llm(tokenizer, group, MigrationConfig(wait_s=0.2))
        stream = llm.generate(_params(), prompt_token_ids=[5, 6, 7], request_id="r")
        first = await _started(stream)
        llm.on_engine_outputs(a, _token(a.added[0].request_id, 40))  # type: ignore[arg-type]
        await first
        group.engines.remove(a)
        llm.on_engine_dead(a, "engine a: stream lost")  # type: ignore[arg-type]
        with pytest.raises(EngineUnavailableError, match="stream lost; and then no engine"):
            await stream.__anext__()
        assert llm.num_unfinished == 0

    asyncio.run(scenario())
