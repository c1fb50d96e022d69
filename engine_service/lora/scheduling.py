"""LoRA slots as a scheduler feature: a waiting request is admitted once its adapter
has a device slot (taking an idle adapter's, never a running one's); an adapter that
can no longer be read ends the request with INVALID_ARGUMENT."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_service.scheduler_hooks import SchedulerFeature, Verdict
from tandem.protocol.outputs import ErrorCode, FinishReason, RequestError

if TYPE_CHECKING:
    from engine_service.lora.manager import LoRAManager
    from engine_service.request import Request
    from engine_service.request_lifecycle import RequestLifecycle


class LoraSlots(SchedulerFeature):
    def __init__(self, lifecycle: RequestLifecycle, lora: LoRAManager) -> None:
        self.lifecycle = lifecycle
        self.lora = lora

    def gate(self, request: Request, now: float) -> Verdict:
        if not request.lora_int_id or request.lora_request is None:
            return Verdict.ADMIT
        running = {r.lora_int_id for r in self.lifecycle.running}
        try:
            if self.lora.activate(request.lora_int_id, running, request.lora_request):
                return Verdict.ADMIT
            return Verdict.DEFER
        except ValueError as exc:  # InvalidRequestError: the adapter went bad since arrival
            error = RequestError(ErrorCode.INVALID_ARGUMENT, str(exc))
            self.lifecycle.finish(request, FinishReason.ERROR, now, error=error)
            return Verdict.TAKEN
