"""Structured output as a scheduler feature: a request whose constraint is still
compiling is passed over, one whose constraint failed to compile ends with
INVALID_ARGUMENT, and each sampled token advances the request's matcher (a complete
constraint stops the request; a token outside it is an INTERNAL error)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_service.scheduler_hooks import SchedulerFeature, Stop, Verdict
from engine_service.structured_output.manager import Advance
from tandem.protocol.outputs import ErrorCode, FinishReason, RequestError

if TYPE_CHECKING:
    from engine_service.request import Request
    from engine_service.request_lifecycle import RequestLifecycle
    from engine_service.structured_output.manager import StructuredOutputManager


class StructuredOutputs(SchedulerFeature):
    def __init__(self, lifecycle: RequestLifecycle, manager: StructuredOutputManager | None) -> None:
        """``manager``: compiles the constraints (None: requests come with theirs ready)."""
        self.lifecycle = lifecycle
        self.manager = manager

    def before_schedule(self, now: float) -> None:
        """End the requests whose constraint did not compile (FinishReason.ERROR, the
        compile's error)."""
        if self.manager is None:
            return
        for request in self.manager.poll():
            if self.lifecycle.is_current(request):
                self.lifecycle.finish(request, FinishReason.ERROR, now, error=request.structured.error)

    def gate(self, request: Request, now: float) -> Verdict:
        if request.structured is not None and not request.structured.ready:
            return Verdict.DEFER
        return Verdict.ADMIT

    def after_token(self, request: Request, token: int) -> Stop | None:
        if request.structured is None:
            return None
        advance = request.structured.advance(token)
        if advance is Advance.REJECTED:
            message = f"token {token} was sampled outside the structured-output constraint"
            return Stop(FinishReason.ERROR, error=RequestError(ErrorCode.INTERNAL, message))
        if advance is Advance.COMPLETE:
            return Stop(FinishReason.STOP)
        return None
