"""The engine's ``tandem.v1.EngineCore`` servicer: frontends' streams in, step outputs out.

``EngineServicer`` admits requests (validation, the drain) into the core loop's queue,
runs utility calls and drives the graceful drain. Its ``outputs`` (a ``ClientOutputs``,
client_outputs.py) hold one ``Client`` per connected frontend stream or in-process reader
(such as a ``VllmEngine`` call) and which client owns each request. The step thread hands
each step's ``EngineCoreOutputs`` to this event loop, where a utility answer goes to its
caller and request outputs to ``outputs.dispatch``; then the step feeds the metrics, the
stats log and the request spans (all off the step loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from engine_service.client_outputs import Client, ClientOutputs
from engine_service.core import EngineCore
from engine_service.core_loop import EngineCoreLoop, EngineDead, UtilityCall
from engine_service.metrics import EngineMetrics, StatsLogger
from engine_service.tracing import RequestSpanEmitter
from tandem.grpc_server import MessageLimits
from tandem.protocol import convert
from tandem.protocol.fingerprint import tokenizer_fingerprint
from tandem.protocol.outputs import (
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    RequestError,
    UtilityOutput,
)
from tandem.protocol.sampling_params import InvalidRequestError
from tandem.telemetry import Tracing
from tandem.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineCore"].full_name
# Requests carry token ids and outputs carry logprobs: far below this at any max_model_len.
MESSAGE_LIMITS = MessageLimits(max_receive_bytes=64 * 1024 * 1024, max_send_bytes=64 * 1024 * 1024)

# The largest Hello.output_window honoured (a larger one is taken as this).
MAX_OUTPUT_WINDOW = 64


class EngineServicer(engine_pb2_grpc.EngineCoreServicer):
    """Registered before the model loads; RPCs answer UNAVAILABLE until ``attach``."""

    def __init__(
        self,
        model_dir: str,
        tracing: Tracing | None = None,
        metrics: EngineMetrics | None = None,
        stats_logger: StatsLogger | None = None,
    ) -> None:
        self.core: EngineCore = None  # type: ignore[assignment]  # set by attach()
        self.tracing = tracing
        self.metrics = metrics
        self.stats_logger = stats_logger
        self.span_emitter: RequestSpanEmitter | None = None  # set by attach() when tracing
        self.engine_loop: EngineCoreLoop = None  # type: ignore[assignment]
        self.model_dir = model_dir
        self.fingerprint = tokenizer_fingerprint(model_dir)
        self.outputs = ClientOutputs()
        # internal call id -> a local waiter, or (client id, the client's own call id)
        self.pending_utility: dict[int, asyncio.Future[UtilityOutput] | tuple[int, int]] = {}
        self._utility_spans: dict[int, Span] = {}  # internal call id -> open span
        self._call_ids = itertools.count(1)
        self.aio_loop: asyncio.AbstractEventLoop | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self.dead: EngineDead | None = None
        self.died = asyncio.Event()
        # Graceful shutdown: once ``draining``, new adds are refused (UNAVAILABLE) and
        # every message says so; ``drained`` is set when no accepted request is left.
        self.draining = False
        self.drained = asyncio.Event()

    def attach(self, core: EngineCore, loop: EngineCoreLoop) -> None:
        self.core = core
        self.engine_loop = loop
        if self.tracing is not None:
            self.span_emitter = RequestSpanEmitter(
                self.tracing, Path(core.config.model).name, core.engine_index
            )

    async def _require_ready(self, context: grpc.aio.ServicerContext) -> None:
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading its model")
        if self.dead is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.dead.message)

    # ---- outputs: from the step thread straight onto the event loop ----------------

    def start_pump(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        """Route the core loop's outputs to this event loop: the step thread schedules
        each one here and goes on with its next step (no thread in between to wake)."""
        self.aio_loop = aio_loop

        def sink(item: EngineCoreOutputs | EngineDead) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop closed: shutting down
                aio_loop.call_soon_threadsafe(self._receive, item)

        self.engine_loop.set_output_sink(sink)
        if self.stats_logger is not None:
            self._stats_task = aio_loop.create_task(self._log_stats(self.stats_logger))

    def _receive(self, item: EngineCoreOutputs | EngineDead) -> None:
        if isinstance(item, EngineDead):
            self._on_dead(item)
            return
        if item.utility_output is not None:
            self._utility_done(item, item.utility_output)
        else:
            self.outputs.dispatch(item, self.draining)
            self._note_if_drained()
        self._observe(item)

    async def _log_stats(self, stats_logger: StatsLogger) -> None:
        """The periodic stats line, also while no step runs."""
        while True:
            await asyncio.sleep(max(stats_logger.seconds_until_due(), 0.01))
            stats_logger.maybe_log()

    def _observe(self, outs: EngineCoreOutputs) -> None:
        """Metrics, stats log and request spans of one step (after it went out)."""
        try:
            if self.metrics is not None:
                self.metrics.record(outs)
            if self.stats_logger is not None:
                self.stats_logger.record(outs)
            emitter = self.span_emitter
            if emitter is not None and outs.iteration_stats is not None:
                for request in outs.iteration_stats.finished:
                    emitter.emit(request)
            if self.stats_logger is not None:
                self.stats_logger.maybe_log()
        except Exception:  # observability must never stop the outputs
            logger.exception("recording metrics/spans failed")

    def _on_dead(self, dead: EngineDead) -> None:
        if self.dead is not None:  # the watchdog and the pump may both report it
            return
        self.dead = dead
        # Local readers get only the end of their stream and find ``self.dead`` there.
        self.outputs.broadcast(convert.engine_dead_outputs(self.core.engine_index, dead.message, time.time()))
        self.outputs.end_streams()
        self.died.set()

    # ---- graceful drain (engine_service/lifecycle.py drives it) ---------------------

    def start_drain(self) -> None:
        """Take no new request from now on and tell every connected frontend."""
        if self.draining:
            return
        self.draining = True
        logger.info(
            "engine %d draining: %d requests in flight", self.core.engine_index, len(self.outputs.owner)
        )
        self.outputs.broadcast(self._draining_message())
        self._note_if_drained()

    def abort_all(self, message: str) -> int:
        """End every accepted request with UNAVAILABLE ``message``; returns how many."""
        error = RequestError(ErrorCode.UNAVAILABLE, message)
        left = self.outputs.disown_all()  # the core's own ABORT outputs then have no owner
        for rid, client in left:
            if client is not None:
                self._send_error(client, rid, error)
        if left:
            self.engine_loop.abort_requests([rid for rid, _ in left])
        self._note_if_drained()
        return len(left)

    def close_streams(self) -> None:
        """End every frontend's stream (after the drain; the outboxes flush first)."""
        self.outputs.end_streams()

    def fail(self, reason: str) -> None:
        """The step loop hung (the watchdog's verdict): as if the core had died."""
        self._on_dead(EngineDead(reason))

    def _draining_reason(self) -> str:
        return f"engine {self.core.engine_index} is draining"

    def _draining_message(self) -> engine_pb2.EngineCoreOutputs:
        return engine_pb2.EngineCoreOutputs(
            engine_index=self.core.engine_index, timestamp=time.monotonic(), draining=True
        )

    def _note_if_drained(self) -> None:
        if self.draining and not self.outputs.owner:
            self.drained.set()

    def _send_error(self, client: Client, rid: str, error: RequestError) -> None:
        self.outputs.send_step(
            client, EngineCoreOutputs.refusal(self.core.engine_index, rid, error, draining=self.draining)
        )

    # ---- in-process readers (engine_service/vllm_grpc) ------------------------------

    def open_local_client(self) -> Client:
        """A client whose outbox gets domain outputs; close it with ``close_local_client``."""
        return self.outputs.open(local=True)

    def close_local_client(self, client: Client) -> None:
        """Forget ``client`` and abort what it still runs; nobody reads their outputs
        (idempotent)."""
        ids = self.outputs.close(client)
        if ids:
            logger.info("local client %d left; aborting %s", client.client_id, ", ".join(ids))
            self.engine_loop.abort_requests(ids)
            self._note_if_drained()

    def abort_owned(self, client: Client, request_ids: list[str]) -> None:
        """Abort those of ``request_ids`` that ``client`` runs; their ABORT outputs still
        reach it. Unknown or finished ids are ignored: a second abort is a no-op."""
        ids = self.outputs.owned_by(client, request_ids)
        if ids:
            self.engine_loop.abort_requests(ids)

    # ---- RPCs ---------------------------------------------------------------------

    async def Stream(
        self,
        request_iterator: AsyncIterator[engine_pb2.EngineCoreInput],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[engine_pb2.EngineCoreOutputs]:
        await self._require_ready(context)
        client = self.outputs.open()
        if self.draining:
            client.outbox.put_nowait(self._draining_message())
        reader = asyncio.ensure_future(self._read_inputs(client, request_iterator, context))
        try:
            while True:
                msg = await client.outbox.get()
                if msg is None:
                    break
                yield msg
        finally:
            reader.cancel()
            ids = self.outputs.close(client)
            if ids:
                # The frontend went away: nobody will read these requests.
                logger.info("client %d left; aborting %d requests", client.client_id, len(ids))
                self.engine_loop.abort_requests(ids)
                self._note_if_drained()

    async def _read_inputs(
        self,
        client: Client,
        inputs: AsyncIterator[engine_pb2.EngineCoreInput],
        context: grpc.aio.ServicerContext,
    ) -> None:
        try:
            async for item in inputs:
                if item.WhichOneof("kind") == "batch":
                    for one in item.batch.inputs:
                        self._apply_input(client, one)
                else:
                    self._apply_input(client, item)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("engine input stream of client %d failed", client.client_id)
        finally:
            # The client half-closed or dropped: end our half too.
            self.outputs.send_now(client, None)

    def _apply_input(self, client: Client, item: engine_pb2.EngineCoreInput) -> None:
        """One input of ``client``'s stream (a nested batch is ignored)."""
        kind = item.WhichOneof("kind")
        if kind == "add":
            self._add(client, item.add)
        elif kind == "abort":
            self.engine_loop.abort_requests(self.outputs.owned_by(client, item.abort.request_ids))
        elif kind == "utility":
            call_id, method, args = convert.utility_call_from_proto(item.utility)
            internal = next(self._call_ids)
            self.pending_utility[internal] = (client.client_id, call_id)
            self._start_utility_span(internal, method)
            self.engine_loop.call_utility(UtilityCall(internal, method, tuple(args)))
        elif kind == "ack":
            self.outputs.acknowledged(client, item.ack.count)
        elif kind == "hello":
            client.window = min(item.hello.output_window, MAX_OUTPUT_WINDOW)
            if item.hello.tokenizer_fingerprint not in ("", self.fingerprint):
                # Frontends check GetEngineInfo first and refuse; this is for other clients.
                logger.warning("client %d has a different tokenizer", client.client_id)

    def _add(self, client: Client, msg: engine_pb2.EngineCoreRequest) -> None:
        try:
            request = convert.engine_core_request_from_proto(msg)
        except convert.ConversionError as exc:
            self._send_error(client, msg.request_id, RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)))
            return
        self.add_request(client, request)

    def add_request(self, client: Client, request: EngineCoreRequest) -> None:
        """Admit one domain request for ``client``; a refusal arrives on its outbox as
        an ERROR output (UNAVAILABLE while draining, INVALID_ARGUMENT on bad input)."""
        if self.draining:
            self._send_error(client, request.request_id, RequestError(ErrorCode.UNAVAILABLE, self._draining_reason()))
            return
        try:
            self.core.validate_request(request)
            if self.outputs.is_taken(client, request.request_id, request.resumable):
                raise InvalidRequestError("request_id", request.request_id, "already running")
        except InvalidRequestError as exc:
            self._send_error(client, request.request_id, RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)))
            return
        request.received_time = time.monotonic()  # queue time counts from here
        self.outputs.adopt(client, request.request_id, request.resumable)
        self.engine_loop.add_request(request)

    async def GetEngineInfo(
        self, request: engine_pb2.GetEngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetEngineInfoResponse:
        await self._require_ready(context)
        core, cfg = self.core, self.core.config
        return engine_pb2.GetEngineInfoResponse(
            engine_index=core.engine_index,
            architecture=core.model_config.architecture,
            model=cfg.model,
            served_model_name=cfg.served_model_name or Path(cfg.model).name,
            max_model_len=core.max_model_len,
            vocab_size=core.model_config.vocab_size,
            block_size=cfg.block_size,
            num_kv_blocks=core.num_blocks,
            num_free_blocks=core.kv_manager.num_free_blocks,
            num_running_reqs=core.scheduler.num_running,
            num_waiting_reqs=core.scheduler.num_waiting,
            tokenizer_fingerprint=self.fingerprint,
            max_logprobs=cfg.max_logprobs,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_prefix_caching=cfg.enable_prefix_caching,
            dtype=str(cfg.torch_dtype).removeprefix("torch."),
            device=str(cfg.torch_device),
            draining=self.draining,
            accepts_input_batches=True,
            kv_role=core.kv_connector.role or "",
            speculative_config="" if cfg.speculative is None else json.dumps(cfg.speculative.to_dict()),
        )

    async def ResetPrefixCache(
        self, request: engine_pb2.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ResetPrefixCacheResponse:
        await self._require_ready(context)
        result = await self.call_utility("reset_prefix_cache")
        return engine_pb2.ResetPrefixCacheResponse(success=result.failure_message is None)

    # ---- utility calls --------------------------------------------------------------

    async def call_utility(self, method: str, *args: object) -> UtilityOutput:
        call_id = next(self._call_ids)
        future: asyncio.Future[UtilityOutput] = asyncio.get_running_loop().create_future()
        self.pending_utility[call_id] = future
        self._start_utility_span(call_id, method)
        self.engine_loop.call_utility(UtilityCall(call_id, method, args))
        return await future

    def _start_utility_span(self, call_id: int, method: str) -> None:
        if self.tracing is not None:
            self._utility_spans[call_id] = self.tracing.tracer.start_span(
                f"utility {method}",
                kind=SpanKind.SERVER,
                attributes={"tandem.utility.method": method, "tandem.engine_index": self.core.engine_index},
            )

    def _utility_done(self, outs: EngineCoreOutputs, result: UtilityOutput) -> None:
        """``result`` to its local waiter, or to the client that called (under its own
        call id) if still connected."""
        span = self._utility_spans.pop(result.call_id, None)
        if span is not None:
            if result.failure_message is not None:
                span.set_status(Status(StatusCode.ERROR, result.failure_message))
            span.end()
        target = self.pending_utility.pop(result.call_id, None)
        if isinstance(target, asyncio.Future):
            if not target.done():
                target.set_result(result)
            return
        client = self.outputs.get(target[0]) if target is not None else None
        if client is not None:
            utility = convert.utility_output_to_proto(result)
            utility.call_id = target[1]
            msg = engine_pb2.EngineCoreOutputs(
                engine_index=outs.engine_index, utility_output=utility, timestamp=outs.timestamp,
                draining=self.draining,
            )
            self.outputs.send_now(client, msg)
