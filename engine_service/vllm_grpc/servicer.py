"""``vllm.grpc.engine.VllmEngine``: a thin servicer over the engine's own EngineServicer.

Each ``Generate`` / ``Embed`` call is one local client of the EngineServicer: its
requests go in through the same admission path as a tandem.v1 Stream's (draining,
validation, ownership), and its outputs come back as domain objects. The call ending
for any reason (done, error, the client cancelled) closes that client, which aborts
whatever it still runs; ``Abort`` by request id is a no-op for ids that are unknown or
already finished, so the gateway's cancel-and-abort pair is safe in either order.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from engine_service.vllm_grpc import convert
from engine_service.vllm_grpc.errors import CallFailed, abort_with
from engine_service.vllm_grpc.kv_events import KvEventLog
from engine_service.vllm_grpc.tokenizer_files import tokenizer_chunks, tokenizer_zip
from tandem.protocol.outputs import EngineCoreOutputs, FinishReason

if TYPE_CHECKING:
    from engine_service.client_outputs import Client
    from engine_service.servicer import EngineServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
KV_EVENT_POLL_S = 0.05  # how often a SubscribeKvEvents call looks for new batches
KV_HEARTBEAT_S = 1.0  # a load record at least this often on an idle KV-event stream


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """``engine``: the EngineServicer (its core is attached once the model loaded)."""

    def __init__(self, engine: EngineServicer, kv_events: KvEventLog | None = None) -> None:
        self.engine = engine
        self.kv_events = kv_events
        self.started = time.monotonic()
        self.last_receive = 0.0

    def _require_ready(self) -> None:
        engine = self.engine
        if engine.core is None:
            raise CallFailed.unavailable("the engine is still loading its model")
        if engine.dead is not None:
            raise CallFailed.unavailable(engine.dead.message)

    async def _next_step(self, client: Client) -> EngineCoreOutputs:
        item = await client.outbox.get()
        if item is None:  # the engine died or is closing its streams
            dead = self.engine.dead
            raise CallFailed.unavailable(dead.message if dead is not None else "the engine is shutting down")
        assert isinstance(item, EngineCoreOutputs)  # a local client's outbox holds domain steps
        return item

    # ---- generation ------------------------------------------------------------------

    async def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        self.last_receive = time.time()
        client = None
        try:
            self._require_ready()
            call = convert.generate_call_from_proto(request, self.engine.core.model_config.eos_token_ids)
            prompt = call.requests[0].prompt_token_ids
            states = {
                r.request_id: convert.ChoiceState(i, len(prompt)) for i, r in enumerate(call.requests)
            }
            client = self.engine.open_local_client()
            for engine_request in call.requests:
                self.engine.add_request(client, engine_request)
            left = set(states)
            while left:
                step = await self._next_step(client)
                for out in step.all_outputs():
                    state = states.get(out.request_id)
                    if state is None or out.request_id not in left:
                        continue
                    if out.finish_reason == FinishReason.ERROR:
                        raise CallFailed.from_request_error(out.error, f"request {out.request_id} failed")
                    convert.absorb(state, out)
                    if call.stream:
                        yield convert.stream_chunk(state, out, prompt)
                    if out.finished:
                        left.discard(out.request_id)
                        yield convert.complete(state, out, prompt, call.stream)
        except Exception as exc:
            await abort_with(context, exc)
        finally:
            if client is not None:
                self.engine.close_local_client(client)

    async def Embed(
        self, request: vllm_engine_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.EmbedResponse:
        self.last_receive = time.time()
        client = None
        try:
            self._require_ready()
            engine_request = convert.embed_request_from_proto(request)
            client = self.engine.open_local_client()
            self.engine.add_request(client, engine_request)
            while True:
                step = await self._next_step(client)
                for out in step.all_outputs():
                    if out.request_id != engine_request.request_id or not out.finished:
                        continue
                    if out.finish_reason == FinishReason.ERROR:
                        raise CallFailed.from_request_error(out.error, "the embedding failed")
                    if out.pooling_output is None:
                        raise CallFailed(grpc.StatusCode.INTERNAL, f"request ended ({out.finish_reason}) without a vector")
                    return convert.embed_response(out, len(engine_request.prompt_token_ids))
        except Exception as exc:
            await abort_with(context, exc)
            raise  # unreachable: abort raises
        finally:
            if client is not None:
                self.engine.close_local_client(client)

    async def Abort(
        self, request: vllm_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.AbortResponse:
        engine = self.engine
        wanted = set(request.request_ids)
        for owned in [r for r in engine.outputs.owner if r in wanted or convert.call_id_of(r) in wanted]:
            client = engine.outputs.owner_client(owned)
            if client is not None and client.local:  # never a tandem.v1 frontend's request
                logger.info("Abort: aborting %s", owned)
                engine.abort_owned(client, [owned])
        return vllm_engine_pb2.AbortResponse()

    # ---- health, model and load ------------------------------------------------------

    async def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.HealthCheckResponse:
        engine = self.engine
        if engine.core is None:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="loading the model")
        if engine.dead is not None:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=engine.dead.message)
        if engine.draining:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="draining")
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="Healthy")

    async def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        try:
            self._require_ready()
        except CallFailed as exc:
            await abort_with(context, exc)
        core = self.engine.core
        mc, model_dir = core.model_config, self.engine.model_dir
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=model_dir,
            tokenizer_path=model_dir,
            served_model_name=Path(model_dir).name,
            is_generation="generate" in core.supported_tasks,
            max_context_length=core.max_model_len,
            vocab_size=mc.vocab_size,
            model_type=mc.model_type,
            architectures=[mc.architecture],
            eos_token_ids=mc.eos_token_ids,
            pad_token_id=_config_int(model_dir, "pad_token_id"),
            bos_token_id=mc.bos_token_id if mc.bos_token_id is not None else -1,
            max_req_input_len=core.max_model_len - 1,
        )

    async def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        try:
            self._require_ready()
        except CallFailed as exc:
            await abort_with(context, exc)
        cfg = self.engine.core.config
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=len(self.engine.outputs.owner),
            is_paused=self.engine.core.sleep_level > 0,
            last_receive_timestamp=self.last_receive,
            uptime_seconds=time.monotonic() - self.started,
            server_type="tandem-grpc",
            data_parallel_size=1,
            kv_cache_dtype="auto",
            block_size=cfg.block_size,
            model_dtype=str(cfg.torch_dtype),
            max_num_seqs=cfg.max_num_seqs,
        )

    async def GetLoads(
        self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        try:
            self._require_ready()
            if request.HasField("dp_rank") and request.dp_rank != 0:
                raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"no dp_rank {request.dp_rank}: this engine has rank 0 only")
        except CallFailed as exc:
            await abort_with(context, exc)
        n = self._load_now()
        load = vllm_engine_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=n.running,
            num_waiting_reqs=n.waiting,
            num_total_reqs=n.running + n.waiting,
            num_used_tokens=n.used_tokens,
            max_total_num_tokens=n.capacity_tokens,
            token_usage=n.usage,
            cache_hit_rate=n.cache_hit_rate,
            utilization=n.usage,
            max_running_requests=n.max_running,
        )
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version=_tandem_version(), dp_rank_count=1, loads=[load]
        )

    def _load_now(self) -> LoadNumbers:
        core, metrics = self.engine.core, self.engine.metrics
        # The scheduler's counts (len() of its containers) are safe to read from this thread.
        capacity = core.num_blocks * core.config.block_size
        usage = core.kv_manager.usage
        return LoadNumbers(
            running=core.scheduler.num_running,
            waiting=core.scheduler.num_waiting,
            usage=usage,
            used_tokens=int(usage * capacity),
            capacity_tokens=capacity,
            cache_hit_rate=metrics.hit_rate.rate if metrics is not None else 0.0,
            max_running=core.config.max_num_seqs,
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        try:
            data, digest = await asyncio.to_thread(tokenizer_zip, self.engine.model_dir)
        except FileNotFoundError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        for chunk in tokenizer_chunks(data, digest):
            yield chunk

    # ---- operations ------------------------------------------------------------------

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        """Blocks in use keep their contents, so flushing with requests in flight is safe."""
        try:
            self._require_ready()
        except CallFailed as exc:
            await abort_with(context, exc)
        result = await self.engine.call_utility("reset_prefix_cache")
        if result.failure_message is not None:
            return convert.flush_cache_response(False, result.failure_message)
        return convert.flush_cache_response(True, f"dropped {result.result} cached blocks")

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return await self._profile(context, "start_profile")

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return await self._profile(context, "stop_profile")

    async def _profile(self, context: grpc.aio.ServicerContext, method: str) -> common_pb2.ProfileResponse:
        """The profiler writes where the engine's --profiler-dir says; per-call options are not taken."""
        try:
            self._require_ready()
        except CallFailed as exc:
            await abort_with(context, exc)
        result = await self.engine.call_utility(method)
        if result.failure_message is not None:
            return common_pb2.ProfileResponse(success=False, message=result.failure_message)
        return common_pb2.ProfileResponse(success=True, message=str(result.result or ""))

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Every kept batch after ``start_sequence_number`` (0: all kept, which rebuild
        the current cache), then new ones as the engine steps, until the caller leaves.
        Each batch carries the engine's load; while no event comes, a ``load_only``
        batch repeating the last sequence number goes out every ``KV_HEARTBEAT_S``."""
        log = self.kv_events
        try:
            self._require_ready()
            if log is None:
                raise CallFailed(
                    grpc.StatusCode.UNIMPLEMENTED, "KV cache events are off: prefix caching is disabled on this engine"
                )
        except CallFailed as exc:
            await abort_with(context, exc)
        await context.send_initial_metadata(())  # the gateway waits for the stream's answer
        cursor = request.start_sequence_number
        samples = itertools.count(1)
        last_sent = -KV_HEARTBEAT_S
        while self.engine.dead is None:
            for batch in log.batches_after(cursor):
                msg = log.to_proto(batch)
                msg.load.CopyFrom(self._engine_load(next(samples), load_only=False))
                yield msg
                cursor, last_sent = batch.sequence_number, time.monotonic()
            if time.monotonic() - last_sent >= KV_HEARTBEAT_S:
                yield common_pb2.KvEventBatch(
                    sequence_number=cursor, timestamp=time.time(), dp_rank=0,
                    load=self._engine_load(next(samples), load_only=True),
                )
                last_sent = time.monotonic()
            await asyncio.sleep(KV_EVENT_POLL_S)
        await context.abort(grpc.StatusCode.UNAVAILABLE, self.engine.dead.message)

    def _engine_load(self, sample: int, load_only: bool) -> common_pb2.EngineLoad:
        n = self._load_now()
        return common_pb2.EngineLoad(
            running_requests=n.running,
            waiting_requests=n.waiting,
            token_usage=n.usage,
            max_running_requests=n.max_running,
            sample=sample,
            load_only=load_only,
            cache_hit_rate=n.cache_hit_rate,
            num_used_tokens=n.used_tokens,
            max_total_num_tokens=n.capacity_tokens,
        )


@dataclass
class LoadNumbers:
    """The engine's load as GetLoads and the KV-event stream's records report it."""

    running: int
    waiting: int
    usage: float  # fraction of KV blocks in use
    used_tokens: int
    capacity_tokens: int
    cache_hit_rate: float
    max_running: int


def _config_int(model_dir: str, key: str) -> int:
    """An integer field of config.json; -1 when absent (the proto has no "unset")."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            value = json.load(f).get(key)
    except (OSError, ValueError):
        return -1
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _tandem_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from tandem import DISTRIBUTION

    try:
        return f"tandem-{version(DISTRIBUTION)}"
    except PackageNotFoundError:
        return "tandem"
