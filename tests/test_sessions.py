"""Streaming-input sessions: a request whose prompt keeps arriving in chunks, each
answered by a continuation, with the KV cache kept between chunks."""

from __future__ import annotations

import random

import pytest

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from tandem.protocol.outputs import EngineCoreRequest, FinishReason
from tandem.protocol.sampling_params import InvalidRequestError, RequestOutputKind, SamplingParams
from tandem.protocol.structured_output import StructuredOutputsParams


def _core(model: str, **kwargs: object) -> EngineCore:
    kwargs.setdefault("max_num_batched_tokens", 32)
    return EngineCore(EngineConfig(model=model, max_model_len=512, **kwargs))


def _drain(core: EngineCore, rid: str, scheduled: list[int]) -> tuple[list[int], object]:
    """Step until ``rid``'s turn ends; ``scheduled`` gets its token count per step."""
    tokens: list[int] = []
    while True:
        outs = core.step()
        scheduled.append(sum(o.num_new_tokens for o in core._last_sched.scheduled if o.request.request_id == rid))
        for out in outs.all_outputs():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if out.finished:
                    return tokens, out


@pytest.fixture
def core(tiny_llama_dir: str) -> EngineCore:
    core = _core(tiny_llama_dir)
    original = core.scheduler.schedule

    def schedule():  # type: ignore[no-untyped-def]
        core._last_sched = original()  # type: ignore[attr-defined]
        return core._last_sched  # type: ignore[attr-defined]

    core.scheduler.schedule = schedule  # type: ignore[method-assign]
    return core


def test_three_chunks_equal_one_request_each_and_compute_only_new_tokens(
    core: EngineCore, tiny_llama_dir: str, rng: random.Random
) -> None:
    chunks = [[rng.randrange(5, 1024) for _ in range(n)] for n in (40, 9, 23)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    history: list[int] = []
    reference = _core(tiny_llama_dir, enable_prefix_caching=False)
    for turn, chunk in enumerate(chunks):
        computed_before = len(history) - 1 if history else 0
        core.add_request(EngineCoreRequest("s", chunk, params, resumable=True))
        scheduled: list[int] = []
        tokens, last = _drain(core, "s", scheduled)
        assert last.finish_reason == FinishReason.LENGTH
        history += chunk
        # The same tokens as one request whose prompt is the whole history so far.
        reference.add_request(EngineCoreRequest(f"ref{turn}", list(history), params))
        ref_tokens: list[int] = []
        while reference.has_unfinished_requests():
            for out in reference.step().all_outputs():
                ref_tokens += out.new_token_ids
        assert tokens == ref_tokens, turn
        # Only the new chunk and the previous turn's last token were computed.
        assert sum(scheduled) == len(history) - computed_before + len(tokens) - 1
        if turn:
            assert last.num_cached_tokens == computed_before
        history += tokens
        assert not core.has_unfinished_requests() and "s" in core.scheduler.lifecycle.sessions
    core.abort_requests(["s"])
    assert not core.scheduler.lifecycle.sessions
    core.kv_manager.pool.check_all_free()


def test_a_session_turn_takes_its_place_under_the_queue_bound(tiny_llama_dir: str) -> None:
    """A session's next turn queues new tokens: over the waiting-queue bound it is refused
    RESOURCE_EXHAUSTED like any new request (the bound is not a side door)."""
    from engine_service.admission import RequestRejected
    from tandem.protocol.outputs import ErrorCode

    core = _core(tiny_llama_dir, max_pending_requests=1)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    core.admit_request(EngineCoreRequest("s", [5, 6, 7], params, resumable=True))
    while core.has_unfinished_requests():
        core.step()
    assert "s" in core.scheduler.lifecycle.sessions
    core.admit_request(EngineCoreRequest("other", [8, 9], params))  # the queue is full now
    with pytest.raises(RequestRejected) as refused:
        core.admit_request(EngineCoreRequest("s", [10, 11], params, resumable=True))
    assert refused.value.error.code == ErrorCode.RESOURCE_EXHAUSTED
    core.add_request(EngineCoreRequest("s", [10, 11], params, resumable=True))  # in-process: no bound
    core.abort_requests(["s", "other"])
    core.kv_manager.pool.check_all_free()


def test_session_restrictions_and_eviction(core: EngineCore) -> None:
    with pytest.raises(InvalidRequestError) as err:
        core.add_request(EngineCoreRequest(
            "x", [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")), resumable=True
        ))
    assert err.value.field == "sampling_params.structured_outputs"
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    core.add_request(EngineCoreRequest("a", list(range(5, 45)), params, resumable=True))
    _drain(core, "a", [])
    held = core.kv_manager.pool.num_free_blocks
    core.scheduler.session_eviction.make_room()  # what memory pressure does
    assert core.kv_manager.pool.num_free_blocks > held
    # The next turn recomputes the history and still works.
    core.add_request(EngineCoreRequest("a", [7, 8, 9], params, resumable=True))
    tokens, last = _drain(core, "a", [])
    assert len(tokens) == 2 and last.finish_reason == FinishReason.LENGTH
    core.abort_requests(["a"])
    core.kv_manager.pool.check_all_free()


# ---- over gRPC ------------------------------------------------------------------------

pytest_plugins = ["tests.e2e_helpers"]


def test_generate_session_over_grpc(e2e_stack, rng: random.Random) -> None:  # type: ignore[no-untyped-def]
    import queue

    import grpc

    from tandem.v1 import common_pb2, frontend_pb2

    stub = e2e_stack.generation_stub()
    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                   output_kind=common_pb2.OUTPUT_KIND_DELTA)
    chunks = [[rng.randrange(5, 1024) for _ in range(n)] for n in (20, 7, 11)]
    feed: queue.Queue = queue.Queue()

    def inputs():  # type: ignore[no-untyped-def]
        while (item := feed.get()) is not None:
            yield item

    feed.put(frontend_pb2.GenerateSessionRequest(prompt_token_ids=frontend_pb2.TokenIds(token_ids=chunks[0]),
                                       sampling_params=sp, request_id="sess-1"))
    responses = stub.GenerateSession(inputs(), timeout=60)
    history: list[int] = []
    for turn, chunk in enumerate(chunks):
        tokens: list[int] = []
        cached = 0
        for message in responses:
            assert message.turn == turn
            response = message.response
            assert response.request_id == "sess-1"
            tokens += [t for o in response.outputs for t in o.token_ids]
            cached = max(cached, response.usage.cached_tokens)
            if response.finished:
                break
        history += chunk
        one_shot = stub.Generate(frontend_pb2.GenerateRequest(
            prompt_token_ids=frontend_pb2.TokenIds(token_ids=history), sampling_params=sp), timeout=60)
        assert tokens == [t for r in one_shot for o in r.outputs for t in o.token_ids], turn
        if turn:  # the history before this chunk was not computed again
            assert cached == len(history) - len(chunk) - 1
        history += tokens
        feed.put(frontend_pb2.GenerateSessionRequest(prompt_token_ids=frontend_pb2.TokenIds(token_ids=chunks[turn + 1]))
                 if turn + 1 < len(chunks) else None)
    assert list(responses) == []  # the session ends with the client's stream
    e2e_stack.wait_engines_idle()  # and its blocks are free

    # Cancelled mid-turn: every block comes back.
    feed = queue.Queue()
    long_sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    feed.put(frontend_pb2.GenerateSessionRequest(prompt="a long story", sampling_params=long_sp))
    call = stub.GenerateSession(inputs(), timeout=60)
    next(call)
    call.cancel()
    feed.put(None)
    e2e_stack.wait_engines_idle()

    bad = iter([frontend_pb2.GenerateSessionRequest(prompt="x", sampling_params=common_pb2.SamplingParams(n=2))])
    with pytest.raises(grpc.RpcError) as err:
        list(stub.GenerateSession(bad, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n=" in err.value.details()


def test_session_chunks_and_restrictions() -> None:
    import asyncio

    from frontend_service.sessions import SessionChunk, as_session_chunks, check_session_params
    from tandem.protocol.sampling_params import RequestOutputKind

    async def inputs():  # type: ignore[no-untyped-def]
        yield "some text"
        yield [5, 6, 7]
        yield SessionChunk(prompt="more", sampling_params=SamplingParams(max_tokens=3))

    async def collect() -> list[SessionChunk]:
        return [c async for c in as_session_chunks(inputs(), SamplingParams(max_tokens=9))]

    chunks = asyncio.run(collect())
    assert [c.prompt for c in chunks] == ["some text", None, "more"]
    assert chunks[1].prompt_token_ids == [5, 6, 7]
    assert [c.sampling_params.max_tokens if c.sampling_params else None for c in chunks] == [9, None, 3]
    for params, field in [
        (SamplingParams(n=2), "n"),
        (SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY), "output_kind"),
        (SamplingParams(stop=["x"]), "stop"),
    ]:
        with pytest.raises(InvalidRequestError) as err:
            check_session_params(params)
        assert err.value.field == field


def test_async_llm_streaming_input_and_drain_over_real_engines(e2e_stack, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    """AsyncLLM in this process over the stack's engines (real sockets): ``generate``
    takes an async generator of inputs (vLLM's streaming input) and each turn equals a
    one-shot request on the history; ``wait_for_requests_to_drain`` returns once nothing
    runs here or on the engines, and times out while something does."""
    import asyncio

    from transformers import AutoTokenizer

    from frontend_service.async_llm import AsyncLLM
    from frontend_service.engine_group import EngineGroup
    from frontend_service.input_processor import InputProcessor
    from tandem.protocol.fingerprint import tokenizer_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    chunks = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]

    async def scenario() -> None:
        holder: dict[str, AsyncLLM] = {}
        group = EngineGroup(
            [e.address for e in e2e_stack.engines], 7,
            lambda engine, outs: holder["llm"].on_engine_outputs(engine, outs),
            lambda engine, reason: holder["llm"].on_engine_dead(engine, reason),
        )
        info = await group.connect(tokenizer_fingerprint(tiny_llama_dir), 60)
        processor = InputProcessor(tokenizer, info.max_model_len, info.vocab_size, info.max_logprobs,
                                   tokenizer.eos_token_id)
        llm = holder["llm"] = AsyncLLM(tokenizer, group, processor, client_index=7)
        try:
            async def inputs():  # type: ignore[no-untyped-def]
                for chunk in chunks:
                    yield chunk

            turns: list[list[int]] = [[]]
            async for out in llm.generate(params, prompt=inputs()):
                turns[-1] += out.outputs[0].token_ids
                if out.finished:
                    turns.append([])
            assert turns[-1] == [] and len(turns) == len(chunks) + 1
            history: list[int] = []
            for chunk, got in zip(chunks, turns):
                history += chunk
                one_shot = [t async for o in llm.generate(params, prompt_token_ids=history) for t in o.outputs[0].token_ids]
                assert got == one_shot
                history += got

            long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)

            async def run_long() -> int:
                return sum([len(o.outputs[0].token_ids) async for o in llm.generate(long, prompt="a long story")])

            running = asyncio.ensure_future(run_long())
            while not llm.num_unfinished:
                await asyncio.sleep(0.01)
            with pytest.raises(TimeoutError):
                await llm.wait_for_requests_to_drain(0.05)
            await llm.wait_for_requests_to_drain(120)
            assert running.done() and llm.num_unfinished == 0
        finally:
            await group.close()

    asyncio.run(scenario())
