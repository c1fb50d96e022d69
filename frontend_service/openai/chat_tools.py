"""Tool calling and reasoning in chat completions: a request's ``tools`` and
``tool_choice``, the prompt they render, and what each choice's output becomes.

As vLLM's OpenAI server does:

- ``tools`` go to the chat template (``apply_chat_template(..., tools=...)``); a
  template that ignores them is the model's business. Assistant messages with
  ``tool_calls`` and ``role: "tool"`` messages pass through (``ChatCompletionRequest.
  chat_messages`` turns each call's JSON ``arguments`` into a dict for the templates).
- ``tool_choice``: ``none`` (the default without tools) leaves the output text;
  ``auto`` (the default with tools) reads calls out of the output with the
  ``--tool-call-parser`` (``tool_parsers.py``); ``required`` and a named function
  ``{"type": "function", "function": {"name": ...}}`` are enforced with structured
  output, so the arguments always validate against the tool's ``parameters`` schema:
  the named function's schema itself, or for ``required`` a JSON array (``minItems``
  1; ``maxItems`` 1 with ``parallel_tool_calls: false``) of ``{"name": <one tool's
  name>, "parameters": <that tool's schema>}``. Their JSON is compact unless the
  request's ``structured_outputs.disable_any_whitespace`` says false.
- ``--reasoning-parser``: ``<think>...</think>`` -> ``reasoning_content``
  (``reasoning.py``); tool calls are read from the rest only. A forced tool choice
  leaves no room to think: its output is read as the call's JSON from the first token.
- A choice that made calls finishes with ``tool_calls`` (where the model stopped by
  itself); its ``content`` is the text around the calls, null when there is none.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from frontend_service.input_processor import ChatRenderer
from frontend_service.openai import ChatParsing
from frontend_service.openai.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream
from frontend_service.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedStream,
    RequiredStream,
    ToolCall,
    ToolParser,
    ToolStream,
    detect_tool_parser,
    parse_with,
)
from tandem.protocol.sampling_params import KINDS, InvalidRequestError, SamplingParams
from tandem.protocol.structured_output import StructuredOutputsParams

# chat_template_kwargs may not set what the request's own fields set.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "return_dict", "chat_template"}
)
MAX_TOOL_NAME_CHARS = 256


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The request's tools as ``{"type": "function", "function": {...}}``; a malformed one
    is an InvalidRequestError naming it."""
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(where, tool, 'must be {"type": "function", "function": {...}}')
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(f"{where}.type", tool.get("type"), "only function tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(f"{where}.function", function, "must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_TOOL_NAME_CHARS:
            raise InvalidRequestError(
                f"{where}.function.name", name, f"must be a non-empty string of at most {MAX_TOOL_NAME_CHARS} characters"
            )
        if name in names:
            raise InvalidRequestError(f"{where}.function.name", name, "two tools have this name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict | bool):
            raise InvalidRequestError(f"{where}.function.parameters", parameters, "must be a JSON schema object")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.description", description, "must be a string")
        out.append({"type": "function", "function": dict(function)})
    return out


def resolve_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(mode, function name): mode is none, auto, required or named."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                "tool_choice", choice, 'one of "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
            )
        if choice == "required" and not tools:
            raise InvalidRequestError("tool_choice", choice, "required needs tools")
        return (choice if tools else "none"), None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
        raise InvalidRequestError("tool_choice", choice, 'a named choice is {"type": "function", "function": {"name": ...}}')
    if not any(t["function"]["name"] == name for t in tools):
        raise InvalidRequestError("tool_choice.function.name", name, "names no tool of the request's tools")
    return "named", name


def _parameters(tool: dict[str, Any]) -> Any:
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]], single: bool = False) -> dict[str, Any]:
    """The JSON schema that enforces ``tool_choice: "required"`` (vLLM's)."""
    options = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if single:
        schema["maxItems"] = 1
    return schema


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool, template_kwargs: dict[str, Any],
) -> str:
    """The chat template's text of ``messages`` with ``tools`` and extra template
    variables (what ``ChatRenderer.render`` does, with more to pass)."""
    checked = ChatRenderer.validate(messages)
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("messages", "...", "the model has no chat template")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & template_kwargs.keys())
    if reserved:
        raise InvalidRequestError("chat_template_kwargs", reserved, "set by the request's own fields")
    try:
        text = tokenizer.apply_chat_template(
            checked, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )
    except Exception as exc:  # template errors depend on user input
        raise InvalidRequestError("messages", "...", f"chat template failed: {exc}") from exc
    if not isinstance(text, str):
        raise InvalidRequestError("messages", "...", "chat template produced no text")
    return text


@dataclass
class ChatPlan:
    """What one chat request does with tools and reasoning."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    mode: str = "none"  # none, auto, required, named
    named: str | None = None  # the function of a named tool_choice
    parser: ToolParser | None = None  # tool_choice auto: the format's parser (None: none known)
    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True
    max_calls: int | None = None  # parallel_tool_calls false: 1

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def reads_output(self) -> bool:
        """Whether the output is parsed at all (else it is content, as generated)."""
        return self.constrained or self.parser is not None or self.reasoning is not None

    def schema(self) -> dict[str, Any]:
        if self.mode == "named":
            return _parameters(next(t for t in self.tools if t["function"]["name"] == self.named))
        return required_schema(self.tools, single=self.max_calls == 1)

    def sampling_params(self, params: SamplingParams, req: Any) -> SamplingParams:
        """``params`` with the constraint of a forced tool choice and the parser's
        special-token setting."""
        changes: dict[str, Any] = {}
        if self.constrained:
            own = params.structured_outputs
            if own is not None and any(getattr(own, k) not in (None, False) for k in KINDS):
                raise InvalidRequestError(
                    "tool_choice", self.mode, "a required or named tool_choice cannot be combined with "
                    "response_format or structured_outputs",
                )
            extra = getattr(req, "structured_outputs", None)
            compact = True
            if extra is not None and "disable_any_whitespace" in extra.model_fields_set:
                compact = extra.disable_any_whitespace
            changes["structured_outputs"] = StructuredOutputsParams(json=self.schema(), disable_any_whitespace=compact)
        if self.parser is not None and self.parser.skip_special_tokens is not None:
            changes["skip_special_tokens"] = self.parser.skip_special_tokens
        return replace(params, **changes) if changes else params

    def tool_stream(self) -> ToolStream | None:
        if self.mode == "named":
            assert self.named is not None
            return NamedStream(self.named)
        if self.mode == "required":
            return RequiredStream()
        return self.parser.stream() if self.parser is not None else None

    def reasoning_stream(self, prompt: str | None) -> ReasoningStream | None:
        if self.reasoning is None or self.constrained:
            return None
        return self.reasoning.stream(prompt)

    def reader(self, prompt: str | None) -> ChoiceReader:
        return ChoiceReader(self, prompt)


def plan_chat(req: Any, tokenizer: Any, parsing: ChatParsing) -> ChatPlan:
    """The request's plan; InvalidRequestError for malformed tools or tool_choice."""
    tools = check_tools(req.tools)
    mode, named = resolve_tool_choice(req.tool_choice, tools)
    parser = None
    if mode == "auto":
        name = parsing.tool_call_parser
        if name == "auto":
            name = detect_tool_parser(getattr(tokenizer, "chat_template", None)) or "none"
        parser = TOOL_PARSERS.get(name)
    return ChatPlan(
        tools=tools, mode=mode, named=named, parser=parser,
        reasoning=REASONING_PARSERS.get(parsing.reasoning_parser),
        include_reasoning=req.include_reasoning,
        max_calls=1 if req.parallel_tool_calls is False else None,
    )


class ChoiceReader:
    """One choice's output through the reasoning parser, then the tool-call parser."""

    def __init__(self, plan: ChatPlan, prompt: str | None) -> None:
        self.plan = plan
        self.reasoning = plan.reasoning_stream(prompt)
        self.tools = plan.tool_stream()
        self.made_calls = False


    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The ``delta`` of a streamed chunk that adds ``text`` (``final``: the last one)."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if final and self.reasoning is not None:
            more = self.reasoning.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        out: dict[str, Any] = {}
        if reasoning and self.plan.include_reasoning:
            out["reasoning_content"] = reasoning
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            got = self.tools.feed(content)
            if final:
                got.extend(self.tools.finish())
            limit = self.plan.max_calls
            content, calls = got.content, [c for c in got.tool_calls if limit is None or c["index"] < limit]
            self.made_calls = self.made_calls or bool(calls)
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The ``message`` of a whole (non-streamed) output."""
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            r1, c1 = self.reasoning.feed(text)
            r2, c2 = self.reasoning.finish()
            reasoning, content = (r1 + r2) or None, (c1 + c2) or None
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = parse_with(self.tools, content or "")
            calls = calls[: self.plan.max_calls]  # [:None]: all
            self.made_calls = bool(calls)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if self.plan.reasoning is not None and self.plan.include_reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.made_calls and reason == "stop" else reason
