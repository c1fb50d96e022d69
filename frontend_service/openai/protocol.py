"""OpenAI request bodies (and vLLM's extra fields) as pydantic models, and their
``SamplingParams``.

Pydantic checks only types and shapes; value ranges are ``SamplingParams.validate``'s and
the input processor's (one copy of validation, shared with gRPC), which raise
``InvalidRequestError`` naming the field. Unknown fields are accepted, logged and ignored,
as vLLM does. Responses are plain dicts built in ``serving.py`` (cheaper per SSE chunk).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from tandem.protocol.pooling_params import PoolingParams
from tandem.protocol.sampling_params import (
    InvalidRequestError,
    RequestOutputKind,
    SamplingDefaults,
    SamplingParams,
)
from tandem.protocol.structured_output import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one bias: [-100, 100]
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat top_logprobs

# Prompt forms of /v1/completions: text, texts, token ids, lists of token ids.
Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class _Body(BaseModel):
    """Extra fields are allowed and ignored (``unknown_fields`` lists them for the log)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class StreamOptions(BaseModel):
    include_usage: StrictBool = False  # a last chunk with empty choices and the usage
    continuous_usage_stats: StrictBool = False  # vLLM: usage so far on every chunk


class JsonSchemaFormat(BaseModel):
    name: StrictStr = "response"
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` extra field (StructuredOutputsParams' names)."""

    model_config = ConfigDict(extra="forbid")

    json_: StrictStr | dict[str, Any] | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: StrictStr | dict[str, Any] | None = None
    disable_any_whitespace: StrictBool = False

    @property
    def has_kind(self) -> bool:
        return any(
            v is not None
            for v in (self.json_, self.regex, self.choice, self.grammar, self.json_object, self.structural_tag)
        )

    def to_params(self) -> StructuredOutputsParams:
        tag = self.structural_tag
        return StructuredOutputsParams(
            json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
            json_object=self.json_object,
            structural_tag=json.dumps(tag) if isinstance(tag, dict) else tag,
            disable_any_whitespace=self.disable_any_whitespace,
        )


class _SamplingBody(_Body):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: StrictStr | None = None
    n: StrictInt = 1
    temperature: float | None = None  # None: 1.0 (OpenAI's default)
    top_p: float | None = None
    max_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    response_format: ResponseFormat | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # vLLM's extra body fields
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: StrictInt = 0
    cache_salt: StrictStr | None = None
    return_token_ids: StrictBool = False
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    request_id: StrictStr | None = None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def sampling_params(self, defaults: SamplingDefaults | None = None) -> SamplingParams:
        """The request's SamplingParams (not yet validated: AsyncLLM does that); fields it
        leaves unset take the model's own settings (``defaults``) where it has them."""
        own = defaults or SamplingDefaults()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "...", "only allowed when stream is true")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=own.pick("temperature", self.temperature, 1.0),
            top_p=own.pick("top_p", self.top_p, 1.0),
            top_k=own.pick("top_k", self.top_k, None),
            min_p=own.pick("min_p", self.min_p, 0.0),
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=own.pick("repetition_penalty", self.repetition_penalty, 1.0),
            logit_bias=_logit_bias(self.logit_bias),
            max_tokens=self._max_tokens(),
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self._logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self._structured_outputs(),
        )

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """``structured_outputs``, or what ``response_format`` asks for (not both)."""
        fmt = self.response_format
        from_format = None
        if fmt is not None and fmt.type == "json_object":
            from_format = StructuredOutputsParams(json_object=True)
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidRequestError(
                    "response_format.json_schema", None, "type json_schema needs json_schema.schema"
                )
            from_format = StructuredOutputsParams(json=fmt.json_schema.schema_)
        extra = self.structured_outputs
        if extra is None:
            return from_format
        if from_format is None:
            return extra.to_params()
        if extra.has_kind:
            raise InvalidRequestError(
                "structured_outputs", "...", "give either response_format or structured_outputs"
            )
        # Only modifiers (disable_any_whitespace) beside a response_format: they apply to it.
        from_format.disable_any_whitespace = extra.disable_any_whitespace
        return from_format


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON keys are strings: token ids as text -> int keys (vocab is checked later)."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError("logit_bias", key, "keys must be token ids") from None
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias[{key}]", value, "must be in [-100, 100]")
        out[token] = value
    return out


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: StrictInt | None = 16  # OpenAI's legacy default
    logprobs: StrictInt | None = None  # top-N per token (the sampled one is added)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = True

    def _logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[dict[str, Any]]:
        """One AsyncLLM input per prompt: {"prompt": str} or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if not p:
            raise InvalidRequestError("prompt", p, "must not be empty")
        if isinstance(p[0], str):
            return [{"prompt": s} for s in p]  # type: ignore[misc]
        if isinstance(p[0], int):
            return [{"prompt_token_ids": list(p)}]  # type: ignore[arg-type]
        return [{"prompt_token_ids": list(ids)} for ids in p]  # type: ignore[union-attr]

    def check(self) -> None:
        if self.suffix:
            raise InvalidRequestError("suffix", self.suffix, "not supported")


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    # Tool calling (chat_tools.py checks them): OpenAI's tool definitions, "none" /
    # "auto" / "required" / {"type": "function", "function": {"name": ...}}.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None  # false: at most one call
    add_generation_prompt: StrictBool = True
    # vLLM's extras: more chat-template variables (e.g. {"enable_thinking": false} for
    # Qwen3); whether reasoning_content is returned (with a --reasoning-parser).
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: StrictBool = True

    def _max_tokens(self) -> int | None:
        # max_completion_tokens wins (OpenAI deprecated max_tokens); None: what fits.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs", self.top_logprobs, "needs logprobs: true")
            return None
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs", top, f"must be in [0, {MAX_TOP_LOGPROBS}]")
        return top

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages with content parts ([{"type": "text", "text": ...}]) joined into text,
        and the JSON ``arguments`` of an assistant's ``tool_calls`` as dicts (what chat
        templates expect, as vLLM passes them)."""
        out = []
        for i, message in enumerate(self.messages):
            content = message.get("content")
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text":
                        raise InvalidRequestError(
                            f"messages[{i}].content[{j}]", part, "only text parts are supported"
                        )
                    texts.append(str(part.get("text", "")))
                message = {**message, "content": "\n".join(texts)}
            elif content is None and message.get("role") in ("assistant", "tool"):
                message = {**message, "content": ""}
            calls = message.get("tool_calls")
            if message.get("role") == "assistant" and isinstance(calls, list):
                message = {**message, "tool_calls": [_call_for_template(c) for c in calls]}
            out.append(message)
        return out


def _call_for_template(call: Any) -> Any:
    """A tool call of an assistant message, its JSON-text arguments parsed to a dict."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call


class TokenizeRequest(_Body):
    """``POST /tokenize``: ``prompt`` or ``messages`` (vLLM's shape)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    return_token_strs: StrictBool = False
    tools: list[Any] | None = None  # with messages: rendered by the chat template, as in chat
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: StrictStr | None = None
    tokens: list[StrictInt]
    skip_special_tokens: StrictBool = True


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``: OpenAI's fields, plus vLLM's ``normalize`` and Tandem's
    ``pooling_type`` (LAST by default)."""

    model: StrictStr | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    normalize: StrictBool = True
    pooling_type: Literal["LAST", "MEAN", "CLS"] = "LAST"
    priority: StrictInt = 0

    def inputs(self) -> list[dict[str, Any]]:
        """``AsyncLLM.encode`` keyword arguments of each input."""
        value = self.input
        if isinstance(value, str):
            return [{"prompt": value}]
        if not value:
            raise InvalidRequestError("input", value, "give at least one input")
        if all(isinstance(v, int) for v in value):
            return [{"prompt_token_ids": value}]
        return [{"prompt": v} if isinstance(v, str) else {"prompt_token_ids": v} for v in value]

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(
            pooling_type=self.pooling_type, normalize=self.normalize, dimensions=self.dimensions
        )


def warn_unknown(body: _Body, endpoint: str) -> None:
    unknown = body.unknown_fields()
    if unknown:
        logger.warning("%s: ignoring unknown fields %s", endpoint, ", ".join(unknown))
