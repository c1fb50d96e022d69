"""Streaming-input sessions: the next turn of an idle session (EngineCores ``Sessions``)
and its turns ends, resumes and evictions in the scheduler (``SessionScheduling``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine_service.request import RequestStatus
from tandem.protocol.outputs import EngineCoreRequest, FinishReason
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from engine_service.request import Request


class Sessions:
    """Mixed into EngineCore (its scheduler, model_config, config, max_model_len)."""

    scheduler: Any
    model_config: Any
    config: Any
    max_model_len: int
    _check_token_ids: Callable[[str, Sequence[int]], None]

    def _resume_session(self, req: EngineCoreRequest) -> None:
        """The next turn of an idle streaming-input session: its new tokens appended."""
        session = self.scheduler.sessions[req.request_id]
        total = session.num_tokens + len(req.prompt_token_ids)
        if not req.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", [], "a session turn needs new tokens")
        if total >= self.max_model_len:
            raise InvalidRequestError(
                "prompt_token_ids", f"<{len(req.prompt_token_ids)} tokens>",
                f"the session's {total} tokens leave no room to generate within max_model_len={self.max_model_len}",
            )
        self._check_token_ids("prompt_token_ids", req.prompt_token_ids)  # (RequestValidation's)
        self._check_session(req)
        req.sampling_params.validate(self.model_config.vocab_size, self.config.max_logprobs)
        self.scheduler.resume(req.request_id, list(req.prompt_token_ids), req.sampling_params)

    def _check_session(self, req: EngineCoreRequest) -> None:
        params = req.sampling_params
        for field, bad in (
            ("pooling_params", req.pooling_params is not None),
            ("sampling_params.prompt_logprobs", params.prompt_logprobs is not None),
            ("sampling_params.structured_outputs", params.structured_outputs is not None),
        ):
            if bad:
                raise InvalidRequestError(field, "set", "not supported in a streaming-input session")


class SessionScheduling:
    """Mixed into the Scheduler (its ``requests``, ``sessions``, ``waiting`` and ``kv``):
    an idle session keeps its blocks and computed tokens between turns."""

    requests: dict[str, Request]
    sessions: dict[str, Request]
    waiting: Any  # WaitingQueue
    kv: Any  # KVCacheManager

    def _park(self, request: Request, reason: FinishReason, stop_reason: int | None, now: float) -> None:
        """End a session's turn: blocks and computed tokens stay for the next one."""
        request.times.finished = now
        request.status = RequestStatus.IDLE
        request.finish_reason = reason
        request.stop_reason = stop_reason
        del self.requests[request.request_id]
        self.sessions[request.request_id] = request

    def resume(self, request_id: str, new_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue an idle session's next turn (its history plus ``new_token_ids``)."""
        request = self.sessions.pop(request_id)
        request.resume(new_token_ids, params, time.monotonic())
        self.requests[request_id] = request
        self.waiting.add(request)
        return request

    def _evict_idle_session(self) -> bool:
        """Free the blocks of the least recently used idle session (its next turn
        recomputes its history); False when there is none."""
        if not self.sessions:
            return False
        request = min(self.sessions.values(), key=lambda r: r.times.finished or 0.0)
        self.kv.free(request)
        request.num_computed_tokens = 0
        return True
