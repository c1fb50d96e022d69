"""Streaming-input sessions of an EngineCore: the next turn of an idle session."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import InvalidRequestError


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

