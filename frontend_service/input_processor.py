"""Turns a user request (text, token ids or chat messages) into validated engine requests.

Every rejected input raises ``InvalidRequestError`` naming the offending field
(``prompt``, ``prompt_token_ids[3]``, ``messages[1].role``, ``max_tokens``, ...), which
the gRPC layer maps to INVALID_ARGUMENT.

Length policy: the prompt must leave room for at least one output token
(``len(prompt) < max_model_len``). ``max_tokens=None`` becomes
``max_model_len - len(prompt)``; an explicit ``max_tokens`` larger than that is
rejected (``max_tokens`` named), not cut short. Text (a prompt, or the chat template's
rendering of messages) longer than ``(max_model_len - 1) * L`` characters, with ``L``
the tokenizer's certain characters-per-token bound (``prompt_bound``), is rejected
before it is tokenized.

Size limits: ``n`` is at most the engines' ``max_num_seqs`` (each of the ``n``
completions is one engine request, and one engine runs at most that many at once).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from frontend_service.parent_request import ParentRequest
from frontend_service.prompt_bound import max_token_chars
from tandem.protocol.lora import LoRARequest
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.pooling_params import PoolingParams
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# Ids and salts travel with every engine step and go into block hashes: keep them short.
MAX_REQUEST_ID_CHARS = 512
MAX_CACHE_SALT_CHARS = 1024


@dataclass
class ProcessedRequest:
    """One validated user request and the engine requests it fans out into."""

    request_id: str  # the user's request id
    prompt: str | None  # the prompt text (the rendered chat for messages); None for ids
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # the user's params with max_tokens resolved
    parent: ParentRequest
    engine_requests: list[EngineCoreRequest]  # child i of ``parent`` is element i


class ChatRenderer:
    """Validates chat messages and renders them with the tokenizer's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @staticmethod
    def validate(messages: Any) -> list[dict[str, Any]]:
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise InvalidRequestError("messages", messages, "must be a list of messages")
        if not messages:
            raise InvalidRequestError("messages", messages, "must not be empty")
        checked: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise InvalidRequestError(
                    f"messages[{i}]", message, "must be an object with role and content"
                )
            role = message.get("role")
            if not isinstance(role, str):
                raise InvalidRequestError(f"messages[{i}].role", role, "must be a string")
            if role not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role", role, f"unknown role; one of {sorted(CHAT_ROLES)}"
                )
            content = message.get("content")
            if not isinstance(content, str):
                raise InvalidRequestError(f"messages[{i}].content", content, "must be a string")
            checked.append(dict(message))
        return checked

    def render(self, messages: Any, add_generation_prompt: bool = True) -> str:
        """The prompt text; with ``add_generation_prompt`` it ends with the template's cue
        for the assistant's turn."""
        checked = self.validate(messages)
        if getattr(self._tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("messages", messages, "the model has no chat template")
        try:
            text = self._tokenizer.apply_chat_template(
                checked, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # template errors depend on user input
            raise InvalidRequestError("messages", messages, f"chat template failed: {exc}") from exc
        if not isinstance(text, str):
            raise InvalidRequestError("messages", messages, "chat template produced no text")
        return text


class InputProcessor:
    """Validates and tokenizes user requests for one model."""

    def __init__(
        self,
        tokenizer: Any | None,
        max_model_len: int,
        vocab_size: int,
        max_logprobs: int,
        eos_token_id: int | None,
        extra_eos_token_ids: Sequence[int] = (),
        *,
        max_num_seqs: int | None = None,
    ) -> None:
        """``extra_eos_token_ids``: the model's other end-of-sequence ids (e.g. the
        generation_config.json list of a chat model): they stop a request as stop tokens
        unless it sets ``ignore_eos``. ``max_num_seqs``: the largest ``n`` accepted
        (None: no limit, for callers that run no engine)."""
        for name, value, low in (
            ("max_model_len", max_model_len, 1),
            ("vocab_size", vocab_size, 1),
            ("max_logprobs", max_logprobs, 0),
            ("max_num_seqs", 1 if max_num_seqs is None else max_num_seqs, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.max_num_seqs = max_num_seqs
        token_chars = max_token_chars(tokenizer) if tokenizer is not None else None
        # Longest text that may still fit (see the module docstring); None: no bound.
        self.max_prompt_chars = None if token_chars is None else (max_model_len - 1) * token_chars
        self._tokenizer = tokenizer
        self._chat = ChatRenderer(tokenizer) if tokenizer is not None else None
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = [t for t in dict.fromkeys(extra_eos_token_ids) if t != eos_token_id]

    def process(
        self,
        request_id: str,
        sampling_params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        client_index: int = 0,
        trace_headers: dict[str, str] | None = None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validate one request given as exactly one of prompt, prompt_token_ids, messages.

        ``add_special_tokens``: add the tokenizer's special tokens (e.g. BOS) when
        tokenizing; None: yes for a prompt, no for messages (templates add their own).
        ``add_generation_prompt``: messages only; None: yes. Neither applies to
        prompt_token_ids.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", request_id, "must be a non-empty string")
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(
                "request_id", request_id, f"at most {MAX_REQUEST_ID_CHARS} characters"
            )
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", params, "must be SamplingParams")
        params.validate(self.vocab_size, self.max_logprobs)
        if self.max_num_seqs is not None and params.n > self.max_num_seqs:
            raise InvalidRequestError(
                "n", params.n, f"must be <= the engines' max_num_seqs ({self.max_num_seqs})"
            )
        if params.stop and self._tokenizer is None:
            raise InvalidRequestError("stop", params.stop, "stop strings need a tokenizer")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError("priority", priority, "must be an integer")
        if cache_salt is not None and (
            not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise InvalidRequestError(
                "cache_salt", cache_salt, f"must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters"
            )

        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise InvalidRequestError("lora_request", lora_request, "must be a LoRARequest")
            lora_request.validate()

        field, text, token_ids = self._prompt_tokens(
            prompt, prompt_token_ids, messages, add_special_tokens, add_generation_prompt
        )
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                field,
                len(token_ids),
                f"prompt has {len(token_ids)} tokens; max_model_len {self.max_model_len} "
                "leaves no room for output",
            )
        params = self._resolve_max_tokens(params, len(token_ids))

        parent = ParentRequest(request_id, params)
        arrival = time.time() if arrival_time is None else arrival_time
        engine_requests = [
            EngineCoreRequest(
                request_id=parent.child_request_id(index),
                prompt_token_ids=list(token_ids),
                sampling_params=parent.child_sampling_params(index),
                eos_token_id=self.eos_token_id,
                arrival_time=arrival,
                priority=priority,
                cache_salt=cache_salt,
                client_index=client_index,
                external_req_id=request_id,
                trace_headers=dict(trace_headers) if trace_headers else None,
                lora_request=lora_request,
            )
            for index in range(params.n)
        ]
        return ProcessedRequest(request_id, text, token_ids, params, parent, engine_requests)

    def process_pooling(
        self,
        request_id: str,
        pooling_params: PoolingParams | None = None,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        client_index: int = 0,
        trace_headers: dict[str, str] | None = None,
        add_special_tokens: bool | None = None,
    ) -> EngineCoreRequest:
        """Validate one pooling (embedding) request given as a prompt or token ids; the
        engine checks ``dimensions`` against the model's hidden size."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", request_id, "must be a non-empty string")
        params = PoolingParams() if pooling_params is None else pooling_params
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError("pooling_params", params, "must be PoolingParams")
        params.validate()
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError("priority", priority, "must be an integer")
        field, _, token_ids = self._prompt_tokens(prompt, prompt_token_ids, None, add_special_tokens)
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                field, len(token_ids), f"{len(token_ids)} tokens exceed max_model_len {self.max_model_len}"
            )
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(token_ids),
            sampling_params=SamplingParams(max_tokens=1),
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            client_index=client_index,
            external_req_id=request_id,
            trace_headers=dict(trace_headers) if trace_headers else None,
            pooling_params=params,
        )

    def _prompt_tokens(
        self,
        prompt: str | None,
        prompt_token_ids: Sequence[int] | None,
        messages: Sequence[Mapping[str, Any]] | None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
    ) -> tuple[str, str | None, list[int]]:
        """(field name, prompt text, token ids) of the one input that was given."""
        given = [
            name
            for name, value in (
                ("prompt", prompt),
                ("prompt_token_ids", prompt_token_ids),
                ("messages", messages),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                "prompt", given, "give exactly one of prompt, prompt_token_ids, messages"
            )
        if prompt_token_ids is not None:
            return "prompt_token_ids", None, self._check_token_ids(prompt_token_ids)
        if self._tokenizer is None or self._chat is None:
            raise InvalidRequestError(
                given[0], "...", "no tokenizer is loaded: send prompt_token_ids"
            )
        if messages is not None:
            field = "messages"
        else:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt", prompt, "must be a string")
            if not prompt:
                raise InvalidRequestError("prompt", prompt, "must not be empty")
            field = "prompt"
            self._check_text_length("prompt", prompt)
        text, ids = self.encode(
            prompt=prompt,
            messages=messages,
            add_special_tokens=add_special_tokens,
            add_generation_prompt=add_generation_prompt,
            check_length=True,
        )
        if not ids:
            raise InvalidRequestError(field, text, "tokenizes to no tokens")
        return field, text, ids

    def encode(
        self,
        *,
        prompt: str | None = None,
        messages: Any = None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        check_length: bool = False,
    ) -> tuple[str, list[int]]:
        """(text, token ids) of ``messages`` rendered with the chat template, else of
        ``prompt``, with the defaults described at ``process``. ``check_length``: refuse
        a rendered chat that is certainly too long before tokenizing it."""
        if self._tokenizer is None or self._chat is None:
            raise InvalidRequestError("prompt", "...", "no tokenizer is loaded")
        if messages is not None:
            text = self._chat.render(
                messages, True if add_generation_prompt is None else add_generation_prompt
            )
            if check_length:
                self._check_text_length("messages", text)
            # By default the template writes the special tokens it wants (BOS, turn markers).
            special = False if add_special_tokens is None else add_special_tokens
        else:
            text = prompt or ""
            special = True if add_special_tokens is None else add_special_tokens
        return text, list(self._tokenizer.encode(text, add_special_tokens=special))

    def _check_text_length(self, field: str, text: str) -> None:
        """Refuse text that certainly tokenizes to >= max_model_len tokens (cheap: no
        tokenization)."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise InvalidRequestError(
                field,
                f"<{len(text)} characters>",
                f"{len(text)} characters are more than max_model_len {self.max_model_len} "
                f"tokens can hold ({self.max_prompt_chars} characters at most)",
            )

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
            raise InvalidRequestError("prompt_token_ids", token_ids, "must be a list of integers")
        if not token_ids:
            raise InvalidRequestError("prompt_token_ids", token_ids, "must not be empty")
        if len(token_ids) >= self.max_model_len:  # before looking at each id
            raise InvalidRequestError(
                "prompt_token_ids",
                len(token_ids),
                f"prompt has {len(token_ids)} tokens; max_model_len {self.max_model_len} "
                "leaves no room for output",
            )
        checked: list[int] = []
        for i, token in enumerate(token_ids):
            if isinstance(token, bool) or not isinstance(token, Integral):
                raise InvalidRequestError(f"prompt_token_ids[{i}]", token, "must be an integer")
            if not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt_token_ids[{i}]",
                    token,
                    f"token id outside the vocabulary [0, {self.vocab_size})",
                )
            checked.append(int(token))
        return checked

    def _resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """A copy with max_tokens filled in; the caller's params are never modified."""
        room = self.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise InvalidRequestError(
                "max_tokens",
                max_tokens,
                f"the prompt's {prompt_len} tokens leave room for {room} within "
                f"max_model_len {self.max_model_len}; ask for at most {room} or leave it unset",
            )
        if params.min_tokens > min(max_tokens, room):
            raise InvalidRequestError(
                "min_tokens",
                params.min_tokens,
                f"must be <= the {min(max_tokens, room)} tokens this prompt leaves room for",
            )
        stop_token_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_token_ids += [t for t in self.extra_eos_token_ids if t not in stop_token_ids]
        return dataclasses.replace(
            params, max_tokens=max_tokens, stop=list(params.stop), stop_token_ids=stop_token_ids
        )
