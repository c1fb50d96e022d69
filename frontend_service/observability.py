"""Per-request metrics and the request span of AsyncLLM, recorded when a request ends."""

from __future__ import annotations

import time
from typing import Any

from frontend_service.admission import RequestFailedError
from frontend_service.input_processor import ProcessedRequest
from frontend_service.metrics import FrontendMetrics, SequenceTimes
from tandem import telemetry
from tandem.protocol.outputs import ErrorCode


class RequestObservation:
    """Mixed into AsyncLLM (its metrics, model name and per-sequence token times)."""

    metrics: FrontendMetrics | None
    model_name: str
    _seq_times: dict[str, SequenceTimes]

    def _finish_observing(
        self,
        processed: ProcessedRequest | None,
        arrival: float,
        span: Any,
        failure: BaseException | None = None,
    ) -> None:
        """Count the finished request and end its span (a rejected request only ends it)."""
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
        attrs["gen_ai.response.id"] = processed.request_id.rsplit("-", 1)[0]
        attrs["tandem.request_id"] = processed.request_id
        attrs[telemetry.LATENCY_E2E] = e2e
        if firsts:
            attrs[telemetry.LATENCY_TTFT] = min(firsts) - arrival
        span.set_attributes(attrs)
        span.end()


def failure_reason(code: ErrorCode) -> str:
    """The ``finished_reason`` metric label of a request that failed with ``code``."""
    return "deadline" if code == ErrorCode.DEADLINE_EXCEEDED else "error"
