"""Per-request metrics and the request span of AsyncLLM's generation.

``RequestObservation`` exists only when metrics or tracing is on (AsyncLLM holds None
otherwise, so an unobserved request costs an ``is None`` check at its start and end).
Per request: ``start_span`` (a SERVER span continuing the caller's W3C trace context,
whose own context goes to the engine requests), ``add_sequences`` (its engine requests'
token arrival times), ``on_tokens`` per engine step, and ``finish`` when it ends
(TTFT / inter-token / e2e histograms, finish reasons, the span's attributes).
"""

from __future__ import annotations

import time
from itertools import repeat
from typing import TYPE_CHECKING

from opentelemetry.trace import SpanKind, Status, StatusCode

from frontend_service.admission import RequestFailedError
from frontend_service.metrics import FrontendMetrics, SequenceTimes
from frontend_service.streams import user_id_of
from tandem import telemetry
from tandem.protocol.outputs import EngineCoreOutput, ErrorCode, TokenColumns

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from frontend_service.input_processor import ProcessedRequest
    from tandem.telemetry import Tracing

GENERATE_SPAN_NAME = "tandem.v1.Generation/Generate"


class RequestObservation:
    """Given the metrics and the tracing (either may be None, not both) and the model
    name the spans report."""

    def __init__(self, metrics: FrontendMetrics | None, tracing: Tracing | None, model_name: str) -> None:
        self.metrics = metrics
        self.tracing = tracing
        self.model_name = model_name
        # Engine request id -> token arrival times, from add_sequences until finish.
        self._seq_times: dict[str, SequenceTimes] = {}

    def start_span(
        self, trace_headers: dict[str, str] | None, chat: bool
    ) -> tuple[Span | None, dict[str, str] | None]:
        """(the request's span, the trace headers its engine requests carry): without
        tracing, no span and ``trace_headers`` as they are."""
        if self.tracing is None:
            return None, trace_headers
        span = self.tracing.tracer.start_span(
            GENERATE_SPAN_NAME,
            context=self.tracing.extract(trace_headers),
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": "tandem.v1.Generation",
                "rpc.method": "Generate",
                "gen_ai.operation.name": "chat" if chat else "text_completion",
            },
        )
        return span, self.tracing.inject(span)

    def add_sequences(self, processed: ProcessedRequest, arrival: float) -> None:
        for req in processed.engine_requests:
            self._seq_times[req.request_id] = SequenceTimes(arrival, len(req.prompt_token_ids))

    def on_tokens(self, outputs: list[EngineCoreOutput], columns: TokenColumns | None) -> None:
        """Token arrival times of one engine step."""
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

    def finish(
        self,
        processed: ProcessedRequest | None,
        arrival: float,
        span: Span | None,
        failure: BaseException | None = None,
    ) -> None:
        """Count the finished request and end its span (a rejected request only ends it);
        ``failure``: what it raised to its caller (None: it finished, or the caller left)."""
        if span is not None and failure is not None:
            span.record_exception(failure)
            span.set_status(Status(StatusCode.ERROR, f"{type(failure).__name__}: {failure}"))
        if self.metrics is not None and isinstance(failure, RequestFailedError):
            self.metrics.record_failure(failure.code.name)
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
        if isinstance(failure, RequestFailedError):
            reasons = [failure_reason(failure.code)] * len(children)
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
        attrs["gen_ai.response.id"] = user_id_of(processed.request_id)
        attrs["tandem.request_id"] = processed.request_id
        attrs[telemetry.LATENCY_E2E] = e2e
        if firsts:
            attrs[telemetry.LATENCY_TTFT] = min(firsts) - arrival
        span.set_attributes(attrs)
        span.end()


def failure_reason(code: ErrorCode) -> str:
    """The ``finished_reason`` metric label of a request that failed with ``code``."""
    return "deadline" if code == ErrorCode.DEADLINE_EXCEEDED else "error"
