"""AsyncLLM: the frontend's engine-facing core, as vLLM's AsyncLLM but over gRPC.

``generate()`` validates and tokenizes a request, places it on an engine, and yields
``RequestOutput``s as the engine's per-step outputs arrive; closing the generator (a
client cancel or disconnect) aborts the engine request. Text work (detokenization,
stop strings, n>1) happens in the shared ``OutputProcessor``. A caller that reads
slower than the engine steps gets the outputs queued meanwhile as one (deltas merged),
so a lagging stream costs one message per read, not one per engine step.

Observability: with a ``Tracing``, each request gets a SERVER span that continues the
caller's W3C trace context and is injected into the engine requests' ``trace_headers``;
with ``FrontendMetrics``, token arrival times feed TTFT / inter-token / e2e histograms.
Without either, a request costs two ``is None`` checks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from itertools import repeat
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode

from frontend_service.admission import PendingLimit, RequestFailedError, deadline_exceeded
from frontend_service.control import RequestControl
from frontend_service.disaggregation import Disaggregation
from frontend_service.engine_client import (
    EngineConnection,
    EngineUnavailableError,
)
from frontend_service.engine_group import EngineGroup
from frontend_service.input_processor import InputProcessor, ProcessedRequest
from frontend_service.lora import LoraRegistry
from frontend_service.metrics import FrontendMetrics, SequenceTimes
from frontend_service.migration import Migration, MigrationConfig, MigrationReason
from frontend_service.observability import RequestObservation
from frontend_service.output_processor import OutputProcessor
from frontend_service.outputs import RequestOutput, merge_request_outputs
from frontend_service.pooling import Pooling
from frontend_service.sessions import Sessions, as_session_chunks
from frontend_service.streams import Stream, request_ids
from frontend_service.utilities import EngineUtilities
from tandem.protocol.lora import LoRARequest
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    RequestError,
    TokenColumns,
)
from tandem.protocol.sampling_params import RequestOutputKind, SamplingDefaults, SamplingParams
from tandem.telemetry import Tracing

logger = logging.getLogger(__name__)

GENERATE_SPAN_NAME = "tandem.v1.Generation/Generate"


# Refusals of a request an engine has not started: another engine may take it.
_MOVABLE = (ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE)


class AsyncLLM(
    EngineUtilities, Pooling, Sessions, Migration, Disaggregation, RequestControl, RequestObservation
):
    def __init__(
        self,
        tokenizer: Any,
        engines: EngineGroup,
        input_processor: InputProcessor,
        client_index: int = 0,
        *,
        model_name: str = "",
        metrics: FrontendMetrics | None = None,
        tracing: Tracing | None = None,
        admission: PendingLimit | None = None,
        migration: MigrationConfig | None = None,
        disaggregated: bool = False,
        stream_interval: int = 1,
        sampling_defaults: SamplingDefaults | None = None,
    ) -> None:
        """``admission``: the bound on requests in progress (None: unbounded);
        ``migration``: what happens to requests of a lost engine (default: they move on);
        ``disaggregated``: prefill on a producer engine, decode on a consumer
        (disaggregation.py); ``stream_interval``: tokens per streamed output
        (``OutputFlow.stream_interval``)."""
        self.tokenizer = tokenizer
        # The model's own sampling settings, for what a request leaves unset (the edges apply them).
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self.engines = engines
        self.input_processor = input_processor
        self.output_processor = OutputProcessor(tokenizer, stream_interval)
        self.client_index = client_index
        self.streams: dict[str, Stream] = {}  # internal request id -> stream
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.model_name = model_name
        self.metrics = metrics
        self.tracing = tracing
        # Engine request id -> token arrival times; kept only while metrics or tracing is on.
        self._observing = metrics is not None or tracing is not None
        self._seq_times: dict[str, SequenceTimes] = {}
        self.admission = admission
        self.migration = migration or MigrationConfig()
        self._migration_waits: set[asyncio.Task[None]] = set()
        self._owner: dict[str, str] = {}  # engine request id -> internal request id
        # Engine request ids of streams placed again on another engine: outputs for them
        # from any other engine are stale (aborted there) and dropped.
        self._moved: set[str] = set()
        self._num_pooling = 0  # pooling requests in flight (frontend_service/pooling.py)
        self.loras = LoraRegistry(engines)  # LoRA adapters across the engines, by name
        self.closed = False  # shutdown() was called
        self.disaggregated = disaggregated
        self._prefilling: dict[str, EngineConnection] = {}

    # ---- engine callbacks (run on the event loop) ----------------------------------

    def on_engine_outputs(self, engine: EngineConnection, outs: EngineCoreOutputs) -> None:
        outputs = outs.outputs
        columns = outs.token_columns
        handoffs = self._take_prefills(engine, outputs) if self._prefilling and outputs else None
        if outputs and (self._moved or any(o.finish_reason == FinishReason.ERROR for o in outputs)):
            outputs = self._route_failures(engine, outputs)
        if columns is not None and self._moved:
            columns = self._drop_stale_columns(engine, columns)
        if not outputs and columns is None:
            return
        if self._num_pooling and outputs:
            outputs = self.take_pooled(outputs)
        if self._observing:
            self._observe_tokens(outputs, columns)
        processed = self.output_processor.process_outputs(outputs, columns)
        outputs_round = getattr(engine, "outputs_round", None)
        for internal_id, request_output in processed.request_outputs:
            stream = self.streams.get(internal_id)
            if stream is not None:
                stream.got_output = True
                stream.finished = request_output.finished
                stream.queue.put_nowait(request_output)
                # A stream still writing an earlier round's output (a client that reads
                # slowly) does not hold up this one: its outputs merge in its queue.
                if outputs_round is not None and not stream.rounds:
                    outputs_round.join()
                    stream.rounds.append(outputs_round)
        if processed.reqs_to_abort:
            engine.abort(processed.reqs_to_abort)  # stop strings matched
        for request_id, params in handoffs or ():
            self._hand_off(engine, request_id, params)  # prefill done: decode elsewhere

    def on_engine_dead(self, engine: EngineConnection, reason: str) -> None:
        """Move every request of the dead engine to another one (migration.py), or fail
        it with UNAVAILABLE where it cannot move; others keep going."""
        lost = [(rid, s) for rid, s in self.streams.items() if s.engine is engine and not s.finished]
        for internal_id, stream in lost:
            if not self._migrate(internal_id, stream, MigrationReason.ENGINE_DEAD, reason):
                self._fail(internal_id, stream, EngineUnavailableError(reason))

    # ---- failed requests: another engine, or the caller gets the status --------------

    def _route_failures(
        self, engine: EngineConnection, outputs: list[EngineCoreOutput]
    ) -> list[EngineCoreOutput]:
        """Handle the ERROR outputs; return the rest, minus stale outputs of moved requests."""
        kept = []
        for out in outputs:
            if out.finish_reason == FinishReason.ERROR:
                self._on_request_failed(engine, out)
            elif out.request_id not in self._moved or self._runs_on(out.request_id, engine):
                kept.append(out)
        return kept

    def _drop_stale_columns(self, engine: EngineConnection, columns: TokenColumns) -> TokenColumns | None:
        """The column outputs minus stale ones of requests moved to another engine."""
        moved = self._moved
        keep = [rid not in moved or self._runs_on(rid, engine) for rid in columns.request_ids]
        if all(keep):
            return columns
        return columns.select(keep) if any(keep) else None

    def _observe_tokens(self, outputs: list[EngineCoreOutput], columns: TokenColumns | None) -> None:
        """Token arrival times for metrics and tracing."""
        now = time.monotonic()
        seq_times = self._seq_times
        counts: list[tuple[str, int]] = [(o.request_id, len(o.new_token_ids)) for o in outputs]
        if columns is not None:
            per_request = columns.num_new_tokens or repeat(1)
            counts.extend(zip(columns.request_ids, per_request))
        for request_id, count in counts:
            times = seq_times.get(request_id)
            if count and times is not None:
                times.on_tokens(now, count, self.metrics)

    def _runs_on(self, engine_request_id: str, engine: EngineConnection) -> bool:
        stream = self.streams.get(self._owner.get(engine_request_id, ""))
        return stream is not None and stream.engine is engine

    def _on_request_failed(self, engine: EngineConnection, out: EngineCoreOutput) -> None:
        """An engine ended one of a stream's requests with an error.

        Refused before any output (RESOURCE_EXHAUSTED: its queue is full; UNAVAILABLE: it
        started draining while the add was on the wire): the stream moves to the
        least-loaded live engine it has not tried yet (each engine at most once), and its
        caller never sees the refusal. UNAVAILABLE after output (the engine's drain
        timeout ended it): the stream migrates. Anything else, or no engine left: the
        caller gets the engine's status.
        """
        internal_id = self._owner.get(out.request_id, "")
        stream = self.streams.get(internal_id)
        if stream is None or stream.finished or stream.engine is not engine:
            return
        error = out.error or RequestError(
            ErrorCode.INTERNAL, f"the engine failed this request: {out.stop_reason or 'no reason given'}"
        )
        if error.code in _MOVABLE and not stream.got_output:
            target = self._next_engine(stream)
            if target is not None:
                engine.abort([rid for rid in stream.engine_request_ids if rid != out.request_id])
                stream.engine = target
                self._moved.update(stream.engine_request_ids)
                try:
                    self._send(stream, target)
                except (RequestFailedError, EngineUnavailableError) as exc:
                    self._fail(internal_id, stream, exc)
                return
        drained = error.code == ErrorCode.UNAVAILABLE and stream.got_output
        if drained and self._migrate(internal_id, stream, MigrationReason.ENGINE_DRAINED, error.message):
            return
        self._fail(internal_id, stream, RequestFailedError(error))

    def _next_engine(self, stream: Stream) -> EngineConnection | None:
        try:
            return self.engines.pick(stream.requests[0], exclude=stream.tried)
        except EngineUnavailableError:
            return None

    def _send(
        self, stream: Stream, engine: EngineConnection, requests: Sequence[EngineCoreRequest] | None = None
    ) -> None:
        """Place the stream's engine requests (or ``requests``: continuations of some of
        them) on ``engine``, with the time left."""
        left = None
        if stream.deadline is not None:
            left = stream.deadline - time.monotonic()
            if left <= 0:
                raise deadline_exceeded("the deadline passed before the request reached an engine")
        stream.tried.append(engine)
        for req in stream.requests if requests is None else requests:
            req.timeout_s = left
            engine.add_request(req)

    def _admit(self) -> bool:
        """Take a place under the bound on requests in progress (RequestFailedError with
        RESOURCE_EXHAUSTED when full); whether one was taken, for ``_leave``."""
        if self.admission is None:
            return False
        self.admission.acquire()
        return True

    def _leave(self, admitted: bool) -> None:
        if admitted and self.admission is not None:
            self.admission.release()

    def _track(self, internal_id: str, stream: Stream) -> None:
        """Route the engine outputs of ``stream``'s engine requests to it."""
        self.streams[internal_id] = stream
        for rid in stream.engine_request_ids:
            self._owner[rid] = internal_id

    def _untrack(self, internal_id: str, stream: Stream) -> None:
        self.streams.pop(internal_id, None)
        for rid in stream.engine_request_ids:
            self._owner.pop(rid, None)
            self._moved.discard(rid)
            self._prefilling.pop(rid, None)

    def _fail(self, internal_id: str, stream: Stream, exc: BaseException) -> None:
        result = self.output_processor.abort_requests([internal_id])
        stream.engine.abort(result.reqs_to_abort or stream.engine_request_ids)
        stream.finished = True
        stream.queue.put_nowait(exc)

    # ---- the API ------------------------------------------------------------------

    async def generate(
        self,
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        trace_headers: dict[str, str] | None = None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        timeout_s: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs of one request; its ``request_id`` is the caller's id.

        ``timeout_s``: seconds until the caller stops waiting (a gRPC deadline). The
        engine drops or aborts the request once they have passed, and this raises
        ``RequestFailedError`` with DEADLINE_EXCEEDED. Over the frontend's bound on
        requests in progress, or when every engine refused it, it raises one with
        RESOURCE_EXHAUSTED and a retry hint.

        ``add_special_tokens`` / ``add_generation_prompt``: see ``InputProcessor.process``.
        ``trace_headers``: the caller's W3C ``traceparent``/``tracestate``. With tracing
        on, the request's span continues that trace and the engine gets the span's own
        context instead; with tracing off they are passed on to the engine as they are.
        """
        if self.closed:
            raise EngineUnavailableError("this AsyncLLM was shut down")
        if prompt is not None and not isinstance(prompt, str) and hasattr(prompt, "__aiter__"):
            # Streaming input (the reference's): chunks of a session, one turn each.
            chunks = as_session_chunks(prompt, sampling_params)
            async for out in self.generate_session(
                chunks, request_id=request_id, priority=priority, trace_headers=trace_headers, timeout_s=timeout_s
            ):
                yield out
            return
        arrival = time.monotonic()
        span = None
        failure: BaseException | None = None
        if self.tracing is not None:
            span = self.tracing.tracer.start_span(
                GENERATE_SPAN_NAME,
                context=self.tracing.extract(trace_headers),
                kind=SpanKind.SERVER,
                attributes={
                    "rpc.system": "grpc",
                    "rpc.service": "tandem.v1.Generation",
                    "rpc.method": "Generate",
                    "gen_ai.operation.name": "chat" if messages is not None else "text_completion",
                },
            )
            trace_headers = self.tracing.inject(span)
        processed: ProcessedRequest | None = None
        admitted = False
        if lora_request is not None:
            lora_request = self.loras.resolve(lora_request)
        try:
            admitted = self._admit()
            await self._resumed.wait()
            user_id, internal_id = request_ids(request_id)
            processed = self.input_processor.process(
                internal_id,
                sampling_params,
                prompt=prompt,
                prompt_token_ids=prompt_token_ids,
                messages=messages,
                priority=priority,
                cache_salt=cache_salt,
                client_index=self.client_index,
                trace_headers=trace_headers,
                add_special_tokens=add_special_tokens,
                add_generation_prompt=add_generation_prompt,
                lora_request=lora_request,
            )
            if self._observing:
                for req in processed.engine_requests:
                    self._seq_times[req.request_id] = SequenceTimes(arrival, len(req.prompt_token_ids))
            prefill = self._prefill_engine(processed)
            engine = prefill or self.engines.pick(processed.engine_requests[0])
            stream = Stream(
                asyncio.Queue(), engine, [r.request_id for r in processed.engine_requests],
                requests=processed.engine_requests,
                deadline=None if timeout_s is None else arrival + timeout_s,
                span=span,
            )
            self.output_processor.add_processed(processed)
            self._track(internal_id, stream)
            try:
                if prefill is not None:
                    self._send_prefill(stream, prefill)
                else:
                    self._send(stream, engine)
                delta = processed.sampling_params.output_kind == RequestOutputKind.DELTA
                pending: RequestOutput | BaseException | None = None
                while True:
                    item = pending if pending is not None else await stream.queue.get()
                    pending = None
                    if isinstance(item, BaseException):
                        raise item
                    # A reader that fell behind gets what has queued up as one output.
                    while not item.finished and not stream.queue.empty():
                        later = stream.queue.get_nowait()
                        if isinstance(later, BaseException):
                            pending = later
                            break
                        item = merge_request_outputs(item, later, delta)
                    item.request_id = user_id
                    yield item  # returns once the caller took it (a gRPC write completed)
                    stream.leave_rounds()
                    if item.finished:
                        return
            finally:
                stream.leave_rounds()
                self._untrack(internal_id, stream)
                if not stream.finished:
                    # Cancelled, disconnected, failed or closed early: free the engine's blocks.
                    result = self.output_processor.abort_requests([internal_id])
                    stream.engine.abort(result.reqs_to_abort or stream.engine_request_ids)
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the caller went away: finish reason "abort", not an error
        except BaseException as exc:
            failure = exc
            if span is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            self._leave(admitted)
            if self._observing:
                self._finish_observing(processed, arrival, span, failure)

    # ---- LoRA adapters (vLLM's names; every serving engine) -----------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self.loras.add_lora(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.loras.remove_lora(lora_id)

    async def list_loras(self) -> set[int]:
        return await self.loras.list_loras()

    async def pin_lora(self, lora_id: int) -> bool:
        return await self.loras.pin_lora(lora_id)
