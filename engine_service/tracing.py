"""Engine request spans, built after the fact from the times stamped into each Request.

The step loop never touches a span: it stamps ``Request.times`` as events happen (see
``RequestTimes``) and hands finished requests to the output pump thread, which calls
``RequestSpanEmitter.emit`` for each. Spans get explicit start/end times, so they show
when things happened, not when they were built::

    llm_request            arrival -> finish  (child of the frontend's span via trace_headers)
    ├── queue              arrival -> first scheduled
    ├── prefill            first scheduled -> first token
    │   └── prefill_chunk  one per step of a chunked prefill (only when it took > 1 step)
    └── decode             first token -> finish

Preemptions are ``preempted`` events on ``llm_request``.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine_service.request import Request
from tandem import telemetry
from tandem.protocol.outputs import FinishReason
from tandem.telemetry import Tracing, wall_ns


def request_span_attributes(request: Request, model: str, engine_index: int) -> dict[str, Any]:
    """The GenAI and latency attributes of one finished request's ``llm_request`` span."""
    times = request.times
    reason = request.finish_reason
    attrs = telemetry.gen_ai_request_attributes(model, request.sampling_params)
    attrs.update(
        telemetry.gen_ai_usage_attributes(
            request.num_prompt_tokens,
            request.num_output_tokens,
            max(request.num_cached_tokens, 0),
            [str(reason)] if reason is not None else [],
        )
    )
    attrs["gen_ai.response.id"] = request.request_id
    attrs["tandem.engine_index"] = engine_index
    attrs["tandem.num_preemptions"] = request.num_preemptions
    attrs["tandem.num_prefill_chunks"] = len(times.prefill_chunks)
    if request.num_spec_steps:  # speculative decoding: tokens per verified step, the bonus included
        attrs["tandem.spec_decode.num_draft_tokens"] = request.num_draft_tokens
        attrs["tandem.spec_decode.num_accepted_tokens"] = request.num_accepted_draft_tokens
        attrs["tandem.spec_decode.mean_accepted_length"] = 1 + request.num_accepted_draft_tokens / request.num_spec_steps
    for name, value in (
        (telemetry.LATENCY_QUEUE, times.queue_time),
        (telemetry.LATENCY_TTFT, times.time_to_first_token),
        (telemetry.LATENCY_E2E, times.e2e_time),
        (telemetry.LATENCY_PREFILL, times.prefill_time),
        (telemetry.LATENCY_DECODE, times.decode_time),
        (telemetry.LATENCY_INFERENCE, times.inference_time),
    ):
        if value is not None:
            attrs[name] = value
    return attrs


class RequestSpanEmitter:
    """Turns finished requests into spans; call from the pump thread, not the step loop."""

    def __init__(self, tracing: Tracing, model: str, engine_index: int) -> None:
        self.tracing = tracing
        self.tracer = tracing.tracer
        self.model = model
        self.engine_index = engine_index

    def emit(self, request: Request) -> None:
        times = request.times
        if times.finished is None:
            return
        wall = times.wall
        start, end = wall_ns(wall(times.arrival)), wall_ns(wall(times.finished))
        parent = self.tracing.extract(request.trace_headers)
        span = self.tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER, start_time=start)
        if not span.is_recording():  # not sampled
            span.end(end_time=end)
            return
        span.set_attributes(request_span_attributes(request, self.model, self.engine_index))
        if request.finish_reason == FinishReason.ERROR:
            span.set_status(Status(StatusCode.ERROR, str(request.stop_reason or "engine error")))
        for t in times.preemptions:
            span.add_event("preempted", timestamp=wall_ns(wall(t)))
        ctx = trace.set_span_in_context(span)
        child = self._child
        if times.first_scheduled is not None:
            child("queue", ctx, times.arrival, times.first_scheduled, times)
            prefill_end = times.first_token if times.first_token is not None else times.finished
            prefill = child("prefill", ctx, times.first_scheduled, prefill_end, times, end=False)
            prefill.set_attribute("tandem.prefill_tokens", sum(c[2] for c in times.prefill_chunks))
            if len(times.prefill_chunks) > 1:
                prefill_ctx = trace.set_span_in_context(prefill)
                for i, (c_start, c_end, n) in enumerate(times.prefill_chunks):
                    chunk = child("prefill_chunk", prefill_ctx, c_start, c_end, times, end=False)
                    chunk.set_attributes({"tandem.chunk_index": i, "tandem.chunk_tokens": n})
                    chunk.end(end_time=wall_ns(wall(c_end)))
            prefill.end(end_time=wall_ns(wall(prefill_end)))
            if times.first_token is not None:
                child("decode", ctx, times.first_token, times.finished, times)
        else:  # finished (aborted) before it was ever scheduled
            child("queue", ctx, times.arrival, times.finished, times)
        span.end(end_time=end)

    def _child(
        self, name: str, ctx: Any, t0: float, t1: float, times: Any, end: bool = True
    ) -> trace.Span:
        span = self.tracer.start_span(name, context=ctx, start_time=wall_ns(times.wall(t0)))
        if end:
            span.end(end_time=wall_ns(times.wall(t1)))
        return span
