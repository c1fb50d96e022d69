"""Request validation of an EngineCore: every field checked before a request is queued.

``RequestValidator`` holds what the checks depend on (the model's vocabulary and hidden
size, max_model_len, max_logprobs, whether LoRA is on), all fixed at start-up, so it
is safe to call from any thread. It checks a new request (``validate``) and a
streaming-input session's next turn (``validate_session_turn``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.protocol.model_config import ModelConfig
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import InvalidRequestError


class RequestValidator:
    """Raises InvalidRequestError naming the bad field."""

    def __init__(self, model_config: ModelConfig, max_model_len: int, max_logprobs: int, lora_enabled: bool) -> None:
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.lora_enabled = lora_enabled

    def validate(self, req: EngineCoreRequest) -> None:
        """A new request (not a session's next turn)."""
        if not req.request_id:
            raise InvalidRequestError("request_id", req.request_id, "must not be empty")
        prompt = req.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("prompt_token_ids", prompt, "the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt_token_ids",
                f"<{len(prompt)} tokens>",
                f"prompt of {len(prompt)} tokens leaves no room to generate within "
                f"max_model_len={self.max_model_len}",
            )
        self._check_token_ids("prompt_token_ids", prompt)
        if req.generated_token_ids:
            self._check_continuation(req)
        if req.resumable:
            self._check_session(req)
        if req.kv_transfer_params is not None:
            self._check_kv_transfer(req)
        if req.pooling_params is not None:
            req.pooling_params.validate(self.model_config.hidden_size)
        else:
            req.sampling_params.validate(self.model_config.vocab_size, self.max_logprobs)
        if req.lora_request is not None:
            if not self.lora_enabled:
                raise InvalidRequestError(
                    "lora_request", req.lora_request.lora_name,
                    "LoRA is not enabled on this engine (start it with --enable-lora)",
                )
            req.lora_request.validate()

    def validate_session_turn(self, req: EngineCoreRequest, session_num_tokens: int) -> None:
        """The next turn of an idle streaming-input session that holds
        ``session_num_tokens`` tokens: its new tokens must fit after them."""
        total = session_num_tokens + len(req.prompt_token_ids)
        if not req.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", [], "a session turn needs new tokens")
        if total >= self.max_model_len:
            raise InvalidRequestError(
                "prompt_token_ids", f"<{len(req.prompt_token_ids)} tokens>",
                f"the session's {total} tokens leave no room to generate within max_model_len={self.max_model_len}",
            )
        self._check_token_ids("prompt_token_ids", req.prompt_token_ids)
        self._check_session(req)
        req.sampling_params.validate(self.model_config.vocab_size, self.max_logprobs)

    def _check_session(self, req: EngineCoreRequest) -> None:
        """What a streaming-input session's turns cannot ask for."""
        params = req.sampling_params
        for field, bad in (
            ("pooling_params", req.pooling_params is not None),
            ("sampling_params.prompt_logprobs", params.prompt_logprobs is not None),
            ("sampling_params.structured_outputs", params.structured_outputs is not None),
        ):
            if bad:
                raise InvalidRequestError(field, "set", "not supported in a streaming-input session")

    def _check_continuation(self, req: EngineCoreRequest) -> None:
        """A migrated request's output so far must fit and leave something to generate."""
        generated, params = req.generated_token_ids, req.sampling_params
        field = "generated_token_ids"
        if req.pooling_params is not None or req.resumable or params.prompt_logprobs is not None:
            raise InvalidRequestError(
                field, f"<{len(generated)} tokens>", "a continuation takes no pooling, session or prompt logprobs"
            )
        total = len(req.prompt_token_ids) + len(generated)
        if total >= self.max_model_len:
            raise InvalidRequestError(
                field, f"<{len(generated)} tokens>",
                f"prompt and generated tokens ({total}) leave no room within max_model_len={self.max_model_len}",
            )
        if params.max_tokens is not None and len(generated) >= params.max_tokens:
            raise InvalidRequestError(
                field, f"<{len(generated)} tokens>", f"already max_tokens={params.max_tokens} tokens: nothing left"
            )
        self._check_token_ids(field, generated)

    def _check_kv_transfer(self, req: EngineCoreRequest) -> None:
        """Transfer params a consumer could act on must be whole (kv_transfer.proto)."""
        params = req.kv_transfer_params
        assert params is not None
        if req.pooling_params is not None or req.resumable:
            raise InvalidRequestError(
                "kv_transfer_params", "<params>", "a KV transfer takes no pooling or session request"
            )
        if params.do_remote_prefill:
            params.validate_remote()
            if params.num_tokens > len(req.prompt_token_ids) + len(req.generated_token_ids):
                raise InvalidRequestError(
                    "kv_transfer_params.num_tokens", params.num_tokens, "is more than the request's tokens"
                )

    def _check_token_ids(self, field: str, ids: Sequence[int]) -> None:
        """Every id of the non-empty ``ids`` in the vocabulary; the error names the index."""
        vocab = self.model_config.vocab_size
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise InvalidRequestError(f"{field}[{ids.index(bad)}]", bad, f"token id outside the vocabulary [0, {vocab})")
