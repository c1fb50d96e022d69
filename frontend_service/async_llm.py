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
import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode

from frontend_service.engine_client import (
    EngineConnection,
    EngineUnavailableError,
)
from frontend_service.engine_group import EngineGroup
from frontend_service.input_processor import InputProcessor, ProcessedRequest
from frontend_service.metrics import FrontendMetrics, SequenceTimes
from frontend_service.output_processor import OutputProcessor
from frontend_service.outputs import RequestOutput, merge_request_outputs
from tandem import telemetry
from tandem.protocol.outputs import EngineCoreOutputs
from tandem.protocol.sampling_params import RequestOutputKind, SamplingParams
from tandem.telemetry import Tracing

logger = logging.getLogger(__name__)

GENERATE_SPAN_NAME = "tandem.v1.Generation/Generate"


class PauseMode(enum.Enum):
    ABORT = "abort"  # abort in-flight requests
    WAIT = "wait"  # let in-flight requests finish


@dataclass
class _Stream:
    """Where one user request's outputs go, and which engine runs it."""

    queue: asyncio.Queue[RequestOutput | BaseException]
    engine: EngineConnection
    engine_request_ids: list[str]
    finished: bool = False


class AsyncLLM:
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
    ) -> None:
        self.tokenizer = tokenizer
        self.engines = engines
        self.input_processor = input_processor
        self.output_processor = OutputProcessor(tokenizer)
        self.client_index = client_index
        self.streams: dict[str, _Stream] = {}  # internal request id -> stream
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.model_name = model_name
        self.metrics = metrics
        self.tracing = tracing
        # Engine request id -> token arrival times; kept only while metrics or tracing is on.
        self._observing = metrics is not None or tracing is not None
        self._seq_times: dict[str, SequenceTimes] = {}

    # ---- engine callbacks (run on the event loop) ----------------------------------

    def on_engine_outputs(self, engine: EngineConnection, outs: EngineCoreOutputs) -> None:
        if not outs.outputs:
            return
        if self._observing:
            now = time.monotonic()
            for out in outs.outputs:
                if out.new_token_ids:
                    times = self._seq_times.get(out.request_id)
                    if times is not None:
                        times.on_tokens(now, len(out.new_token_ids), self.metrics)
        processed = self.output_processor.process_outputs(outs.outputs)
        for internal_id, request_output in processed.request_outputs:
            stream = self.streams.get(internal_id)
            if stream is not None:
                stream.finished = request_output.finished
                stream.queue.put_nowait(request_output)
        if processed.reqs_to_abort:
            engine.abort(processed.reqs_to_abort)  # stop strings matched

    def on_engine_dead(self, engine: EngineConnection, reason: str) -> None:
        """Fail every request on the dead engine with UNAVAILABLE; others keep going."""
        dead = [rid for rid, s in self.streams.items() if s.engine is engine and not s.finished]
        self.output_processor.abort_requests(dead)
        for rid in dead:
            self.streams[rid].queue.put_nowait(EngineUnavailableError(reason))

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
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs of one request; its ``request_id`` is the caller's id.

        ``add_special_tokens`` / ``add_generation_prompt``: see ``InputProcessor.process``.
        ``trace_headers``: the caller's W3C ``traceparent``/``tracestate``. With tracing
        on, the request's span continues that trace and the engine gets the span's own
        context instead; with tracing off they are passed on to the engine as they are.
        """
        arrival = time.monotonic()
        span = None
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
        try:
            await self._resumed.wait()
            user_id = request_id or uuid.uuid4().hex
            # Engine-side ids stay unique even if two clients pick the same request id.
            internal_id = f"{user_id}-{uuid.uuid4().hex[:8]}"
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
            )
            if self._observing:
                for req in processed.engine_requests:
                    self._seq_times[req.request_id] = SequenceTimes(arrival, len(req.prompt_token_ids))
            engine = self.engines.pick(processed.engine_requests[0])
            stream = _Stream(asyncio.Queue(), engine, [r.request_id for r in processed.engine_requests])
            self.output_processor.add_processed(processed)
            self.streams[internal_id] = stream
            try:
                for req in processed.engine_requests:
                    engine.add_request(req)
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
                    yield item
                    if item.finished:
                        return
            finally:
                self.streams.pop(internal_id, None)
                if not stream.finished:
                    # Cancelled, disconnected, failed or closed early: free the engine's blocks.
                    result = self.output_processor.abort_requests([internal_id])
                    engine.abort(result.reqs_to_abort or stream.engine_request_ids)
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the caller went away: finish reason "abort", not an error
        except BaseException as exc:
            if span is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            if self._observing:
                self._finish_observing(processed, arrival, span)

    def _finish_observing(
        self, processed: ProcessedRequest | None, arrival: float, span: Any
    ) -> None:
        """Count the finished request and end its span (a rejected request only ends it)."""
        if processed is None:
            if span is not None:
                span.end()
            return
        e2e = time.monotonic() - arrival
        times = [self._seq_times.pop(r.request_id, None) for r in processed.engine_requests]
        children = processed.parent.children
        if not children:  # never placed on an engine (none was available)
            if span is not None:
                span.end()
            return
        reasons = [c.finish_reason or "abort" for c in children]
        if self.metrics is not None:
            self.metrics.record_finished(reasons, e2e)
        if span is None:
            return
        if not span.is_recording():  # not sampled
            span.end()
            return
        firsts = [t.first_token for t in times if t is not None and t.first_token is not None]
        attrs = telemetry.gen_ai_request_attributes(self.model_name, processed.sampling_params)
        attrs.update(
            telemetry.gen_ai_usage_attributes(
                len(processed.prompt_token_ids),
                sum(len(c.token_ids) for c in children),
                max((c.num_cached_tokens for c in children), default=0),
                reasons,
            )
        )
        attrs["gen_ai.response.id"] = processed.request_id.rsplit("-", 1)[0]
        attrs["tandem.request_id"] = processed.request_id
        attrs[telemetry.LATENCY_E2E] = e2e
        if firsts:
            attrs[telemetry.LATENCY_TTFT] = min(firsts) - arrival
        span.set_attributes(attrs)
        span.end()

    def abort(self, request_ids: Sequence[str]) -> int:
        """Abort user requests by their ids; returns how many were found."""
        wanted = set(request_ids)
        found = 0
        for internal_id, stream in list(self.streams.items()):
            if internal_id.rsplit("-", 1)[0] not in wanted or stream.finished:
                continue
            found += 1
            result = self.output_processor.abort_requests([internal_id])
            stream.engine.abort(result.reqs_to_abort)
            stream.finished = True
            for _, request_output in result.request_outputs:
                stream.queue.put_nowait(request_output)
        return found

    # ---- pause / resume ----------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def pause(self, mode: PauseMode, poll_interval: float = 0.05) -> None:
        """New requests wait; in-flight ones are aborted or allowed to finish."""
        self._resumed.clear()
        if mode is PauseMode.ABORT:
            self.abort([rid.rsplit("-", 1)[0] for rid in self.streams])
        while any(not s.finished for s in self.streams.values()):
            await asyncio.sleep(poll_interval)

    def resume(self) -> None:
        self._resumed.set()

    @property
    def num_unfinished(self) -> int:
        return sum(1 for s in self.streams.values() if not s.finished)
