"""Every vllm.grpc.engine.VllmEngine RPC through a plain grpc client, against an engine
service in this process (tests/vllm_grpc_harness.py) on the tiny Llama."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from engine_service.config import EngineConfig
from engine_service.kv_cache.block_pool import hash_block_tokens
from engine_service.vllm_grpc import convert
from engine_service.vllm_grpc.errors import CallFailed, status_of
from engine_service.vllm_grpc.kv_events import KvEventLog, hash_to_int64
from tandem.protocol import convert as tandem_convert
from tandem.protocol.outputs import EngineCoreRequest, ErrorCode, RequestError
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams
from tandem.v1 import engine_pb2, engine_pb2_grpc
from tests.vllm_grpc_harness import ADMIN_METADATA, InProcessEngine

BLOCK = 16
TIMEOUT = 120


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessEngine]:
    config = EngineConfig(
        model=tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=64, block_size=BLOCK,
        max_logprobs=5, num_threads=1, profiler_dir=str(tmp_path_factory.mktemp("profiles")),
    )
    server = InProcessEngine(config).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stub(engine: InProcessEngine) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    with grpc.insecure_channel(engine.address) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def _request(prompt: list[int], stream: bool = False, **params: object) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id=f"t-{uuid.uuid4().hex[:8]}",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=vllm_engine_pb2.SamplingParams(**params),
        stream=stream,
    )


def _prompt(seed: int, n: int = 12) -> list[int]:
    return [(seed * 37 + i * 11) % 900 + 50 for i in range(n)]


def _greedy(max_tokens: int, **more: object) -> dict[str, object]:
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **more}


def _tandem_v1_greedy(address: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The same request through the engine's own tandem.v1 Stream (the reference path)."""
    rid = f"ref-{uuid.uuid4().hex[:8]}"
    request = EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    done = threading.Event()

    def inputs() -> Iterator[engine_pb2.EngineCoreInput]:
        yield tandem_convert.hello_input(7)
        yield tandem_convert.add_input(request)
        done.wait(TIMEOUT)

    tokens: list[int] = []
    with grpc.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineCoreStub(channel).Stream(inputs(), timeout=TIMEOUT)
        try:
            for msg in call:
                for out in tandem_convert.engine_core_outputs_from_proto(msg).all_outputs():
                    if out.request_id == rid:
                        tokens += out.new_token_ids
                        if out.finish_reason:
                            return tokens
        finally:
            done.set()
            call.cancel()
    raise AssertionError("the reference stream ended early")


def _wait_idle(engine: InProcessEngine, timeout: float = 30) -> None:
    """No request left and every KV block free (the scheduler's own counts)."""
    deadline = time.monotonic() + timeout
    while True:
        core = engine.servicer.core
        idle = (
            not engine.servicer.outputs.owner and not core.scheduler.lifecycle.running and not core.scheduler.lifecycle.waiting
            and core.kv_manager.pool.num_free_blocks == core.num_blocks
        )
        if idle:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not idle: owner={list(engine.servicer.outputs.owner)} running={len(core.scheduler.lifecycle.running)} "
                f"free={core.kv_manager.pool.num_free_blocks}/{core.num_blocks}"
            )
        time.sleep(0.05)


# ---- health, model, server, loads, tokenizer ---------------------------------------------------


def test_health_check_and_grpc_health_name_the_vllm_service(engine: InProcessEngine, stub) -> None:  # type: ignore[no-untyped-def]
    reply = stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert reply.healthy, reply.message


def test_draining_engine_is_unhealthy_and_refuses_generate_unavailable(engine: InProcessEngine, stub) -> None:  # type: ignore[no-untyped-def]
    async def set_draining(value: bool) -> None:
        engine.servicer.draining = value

    engine.run(set_draining(True))
    try:
        assert not stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=TIMEOUT).healthy
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_request(_prompt(1), **_greedy(2)), timeout=TIMEOUT))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        engine.run(set_draining(False))
    _wait_idle(engine)


def test_get_model_info_tells_the_gateway_where_the_tokenizer_is(engine: InProcessEngine, stub) -> None:  # type: ignore[no-untyped-def]
    info = stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    core = engine.servicer.core
    assert info.model_path == info.tokenizer_path == engine.config.model
    assert info.served_model_name == Path(engine.config.model).name
    assert info.is_generation
    assert info.max_context_length == 256 and info.max_req_input_len == 255
    assert info.vocab_size == core.model_config.vocab_size
    assert list(info.eos_token_ids) == core.model_config.eos_token_ids
    assert info.architectures == [core.model_config.architecture]


def test_get_server_info_and_get_loads(stub) -> None:  # type: ignore[no-untyped-def]
    info = stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=TIMEOUT)
    assert info.block_size == BLOCK and info.data_parallel_size == 1 and info.uptime_seconds > 0
    loads = stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=TIMEOUT)
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1
    assert loads.loads[0].max_total_num_tokens == 64 * BLOCK
    with pytest.raises(grpc.RpcError) as err:
        stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(dp_rank=1), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_get_tokenizer_streams_a_zip_of_the_checkpoints_tokenizer(engine: InProcessEngine, stub) -> None:  # type: ignore[no-untyped-def]
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = set(archive.namelist())
        assert archive.read("tokenizer.json") == (Path(engine.config.model) / "tokenizer.json").read_bytes()
    assert "model.safetensors" not in names and "tokenizer_config.json" in names


# ---- generation -------------------------------------------------------------------------------


def test_generate_matches_the_engines_own_stream_streaming_or_not(engine: InProcessEngine, stub) -> None:  # type: ignore[no-untyped-def]
    prompt = _prompt(2)
    reference = _tandem_v1_greedy(engine.address, prompt, 10)
    whole = list(stub.Generate(_request(prompt, **_greedy(10)), timeout=TIMEOUT))
    assert [r.WhichOneof("response") for r in whole] == ["complete"]
    done = whole[0].complete
    assert list(done.output_ids) == reference
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == ("length", len(prompt), 10)

    streamed = list(stub.Generate(_request(prompt, stream=True, **_greedy(10)), timeout=TIMEOUT))
    assert streamed[-1].WhichOneof("response") == "complete"
    chunks = [r.chunk for r in streamed if r.WhichOneof("response") == "chunk"]
    assert [t for c in chunks for t in c.token_ids] == reference
    assert sum(c.completion_tokens for c in chunks) == 10
    assert streamed[-1].complete.finish_reason == "length"
    # The second run found the first one's full prompt blocks in the prefix cache.
    assert streamed[-1].complete.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    _wait_idle(engine)


def test_n_choices_seeds_and_logprobs(engine: InProcessEngine, stub) -> None:  # type: ignore[no-untyped-def]
    prompt = _prompt(3)
    params = {"temperature": 1.0, "max_tokens": 5, "ignore_eos": True, "n": 2, "seed": 11, "logprobs": 2}
    first = list(stub.Generate(_request(prompt, **params), timeout=TIMEOUT))
    again = list(stub.Generate(_request(prompt, **params), timeout=TIMEOUT))
    assert sorted(r.complete.index for r in first) == [0, 1]
    by_index = {r.complete.index: r.complete for r in first}
    assert {i: list(c.output_ids) for i, c in by_index.items()} == {
        r.complete.index: list(r.complete.output_ids) for r in again
    }
    for done in by_index.values():
        lp = done.output_logprobs
        assert list(lp.token_ids) == list(done.output_ids)
        assert len(lp.token_logprobs) == 5 and all(len(t.values) == 2 for t in lp.top_logprobs)
        assert all(v <= 0 for v in lp.token_logprobs)
    _wait_idle(engine)


def test_stop_token_ids_end_generation_with_the_matched_token(engine: InProcessEngine, stub) -> None:  # type: ignore[no-untyped-def]
    prompt = _prompt(4)
    (free_reply,) = stub.Generate(_request(prompt, **_greedy(6)), timeout=TIMEOUT)
    free = free_reply.complete.output_ids
    stop = free[2]
    (stopped,) = stub.Generate(_request(prompt, **_greedy(6, stop_token_ids=[stop])), timeout=TIMEOUT)
    done = stopped.complete
    cut = list(free).index(stop) + 1
    assert list(done.output_ids) == list(free[:cut])
    assert done.finish_reason == "stop" and done.matched_token_id == stop


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (vllm_engine_pb2.GenerateRequest(request_id="x", text="hi"), "text"),
        (_request([5, 10**6]), "prompt_token_ids"),
        (_request([5, 6], temperature=-1.0), "temperature"),
        (vllm_engine_pb2.GenerateRequest(tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5])), "request_id"),
    ],
)
def test_bad_input_is_invalid_argument_and_the_engine_goes_on(engine: InProcessEngine, stub, request_, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_, timeout=TIMEOUT))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=TIMEOUT).healthy
    _wait_idle(engine)


def test_unset_proto3_numbers_read_as_vllm_reads_them() -> None:
    params = convert.sampling_params_from_proto(vllm_engine_pb2.SamplingParams(), stream=False)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.n) == (
        1.0, 1.0, None, 1.0, 1,
    )
    assert params.max_tokens is None and params.seed is None and params.logprobs is None
    explicit = convert.sampling_params_from_proto(
        vllm_engine_pb2.SamplingParams(temperature=0.0, top_k=5, seed=0, json_schema='{"type": "object"}'),
        stream=True,
    )
    assert (explicit.temperature, explicit.top_k, explicit.seed) == (0.0, 5, 0)
    assert explicit.structured_outputs is not None and explicit.structured_outputs.kind == "json"
    with pytest.raises(InvalidRequestError):
        convert.generate_call_from_proto(
            vllm_engine_pb2.GenerateRequest(
                request_id="m", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1]),
                mm_inputs=vllm_engine_pb2.MultimodalInputs(mm_hashes=["a"]),
            ),
            [2],
        )


def test_cancel_and_abort_free_everything_and_are_idempotent(engine: InProcessEngine, stub) -> None:  # type: ignore[no-untyped-def]
    # A client that cancels mid-stream: its request is aborted and its blocks come back.
    request = _request(_prompt(5, 40), stream=True, **_greedy(200))
    call = stub.Generate(request, timeout=TIMEOUT)
    assert next(call).WhichOneof("response") == "chunk"
    call.cancel()
    _wait_idle(engine)
    stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=[request.request_id]), timeout=TIMEOUT)  # again: no-op

    # Abort by id while the call runs: the call ends with finish_reason "abort".
    request = _request(_prompt(6, 40), stream=True, **_greedy(200))
    call = stub.Generate(request, timeout=TIMEOUT)
    assert next(call).WhichOneof("response") == "chunk"
    stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=[request.request_id, "unknown-id"]), timeout=TIMEOUT)
    stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=[request.request_id]), timeout=TIMEOUT)
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort"
    _wait_idle(engine)


def test_embed_returns_the_pooled_vector(engine: InProcessEngine, stub) -> None:  # type: ignore[no-untyped-def]
    prompt = _prompt(7)
    reply = stub.Embed(
        vllm_engine_pb2.EmbedRequest(request_id="e1", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt)),
        timeout=TIMEOUT,
    )
    hidden = engine.servicer.core.model_config.hidden_size
    assert reply.embedding_dim == len(reply.embedding) == hidden and reply.prompt_tokens == len(prompt)
    assert abs(sum(v * v for v in reply.embedding) - 1.0) < 1e-3  # normalized by default
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(vllm_engine_pb2.EmbedRequest(request_id="e2"), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _wait_idle(engine)


# ---- operations and KV events -----------------------------------------------------------------


def test_flush_cache_and_profile_are_admin_calls(engine: InProcessEngine, stub) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT, metadata=ADMIN_METADATA).success
    assert not engine.servicer.core.kv_manager.pool.cached_blocks

    started = stub.StartProfile(common_pb2.StartProfileRequest(), timeout=TIMEOUT, metadata=ADMIN_METADATA)
    assert started.success, started.message
    list(stub.Generate(_request(_prompt(8), **_greedy(2)), timeout=TIMEOUT))
    stopped = stub.StopProfile(common_pb2.StopProfileRequest(), timeout=TIMEOUT, metadata=ADMIN_METADATA)
    assert stopped.success and Path(stopped.message).is_file()
    json.loads(Path(stopped.message).read_text())  # a chrome trace


def test_subscribe_kv_events_reports_stored_blocks_with_tokens_and_the_clear(engine: InProcessEngine, stub) -> None:  # type: ignore[no-untyped-def]
    _wait_idle(engine)
    assert stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT, metadata=ADMIN_METADATA).success
    start = engine.kv_events.seal()  # what earlier tests stored lies before this
    prompt = _prompt(9, 2 * BLOCK + 3)
    list(stub.Generate(_request(prompt, **_greedy(1)), timeout=TIMEOUT))
    assert stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT, metadata=ADMIN_METADATA).success

    stored: list[common_pb2.KvBlocksStored] = []
    cleared = False
    call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start), timeout=TIMEOUT)
    try:
        for batch in call:
            assert batch.sequence_number > start or batch.load.load_only
            assert batch.load.max_total_num_tokens == 64 * BLOCK
            for event in batch.events:
                kind = event.WhichOneof("data")
                if kind == "stored":
                    stored.append(event.stored)
                cleared = cleared or kind == "cleared"
            if cleared:
                break
    finally:
        call.cancel()
    blocks = [(s.parent_block_hash if s.HasField("parent_block_hash") else None, s.blocks[0]) for s in stored]
    assert [list(b.token_ids) for _, b in blocks] == [prompt[:BLOCK], prompt[BLOCK : 2 * BLOCK]]
    assert blocks[0][0] is None and blocks[1][0] == blocks[0][1].block_hash
    assert blocks[0][1].block_hash == hash_to_int64(hash_block_tokens(None, prompt[:BLOCK]))


def test_kv_event_log_stays_bounded_without_readers() -> None:
    log = KvEventLog(BLOCK, max_batches=3, max_batch_events=4)
    for i in range(100):
        log.stored(i.to_bytes(8, "big"), None, [i] * BLOCK)
    batches = log.batches_after(0)
    assert [len(b.events) for b in batches] == [4, 4, 4]
    assert batches[-1].sequence_number == 25  # the oldest were dropped, numbering went on
    msg = log.to_proto(batches[-1])
    assert [e.stored.blocks[0].block_hash for e in msg.events] == [96, 97, 98, 99]


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (ErrorCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
        (ErrorCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ErrorCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
        (ErrorCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED),
        (ErrorCode.INTERNAL, grpc.StatusCode.INTERNAL),
    ],
)
def test_engine_refusals_become_the_status_codes_smg_acts_on(code: ErrorCode, status: grpc.StatusCode) -> None:
    assert status_of(CallFailed.from_request_error(RequestError(code, "why"), "fallback")) == (status, "why")
    assert status_of(CallFailed.from_request_error(None, "fallback"))[0] == grpc.StatusCode.INTERNAL
    assert status_of(InvalidRequestError("top_p", 2, "bad"))[0] == grpc.StatusCode.INVALID_ARGUMENT
