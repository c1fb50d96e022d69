"""Tool-call parsers: the model's text -> OpenAI tool calls, whole or as it streams.

One state machine per format (a ``ToolStream``, ``tool_stream.py``) reads the text as it
arrives (``feed``, then ``finish``) and emits OpenAI-shaped ``delta.tool_calls`` entries,
the name first, then the arguments' JSON text in fragments. Text outside calls comes out
as content; a short tail that may be the start of a call's tag is held back until the
next text decides, and whitespace between calls is dropped.
``ToolParser.parse`` runs the same machine over a whole text, so a streamed response and
a non-streamed one find the same calls whatever the chunking.

Formats (vLLM's parser names):

- ``hermes`` (Qwen 2.5 / 3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, text around them is content;
- ``llama3_json`` (Llama 3.1 / 3.2): a bare ``{"name": ..., "parameters": {...}}`` at the
  start of the answer, or after ``<|python_tag|>``; several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}``; ids are 9 letters and digits (Mistral's templates
  refuse others).

``RequiredStream`` and ``NamedStream`` read the output of the structured-output
constraints that enforce ``tool_choice: "required"`` (a JSON array of ``{"name",
"parameters"}``) and a named function (its arguments object).

A block that does not parse (no name, not JSON) before anything of it was sent is
passed on as content, as the model wrote it.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from frontend_service.openai.json_scan import ValueScan, skip_ws
from frontend_service.openai.tool_stream import (
    ObjectCall,
    StreamDelta,
    StreamedCall,
    ToolCall,
    ToolStream,
    assemble_calls,
    mistral_call_id,
)

__all__ = [
    "TOOL_PARSERS", "NamedStream", "RequiredStream", "StreamDelta", "ToolCall", "ToolParser", "ToolStream",
    "assemble_calls", "detect_tool_parser", "parse_with",
]

MAX_NAME_CHARS = 256  # a [TOOL_CALLS]name[ARGS] name longer than this is text


class HermesStream(ToolStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _run(self, final: bool) -> None:
        while True:
            if self.mode == "text":
                if not self.text_until((self.OPEN,), final):
                    return
                self.mode = "open"
            elif self.mode == "open":
                i = skip_ws(self.buf, self.pos)
                if i >= len(self.buf):
                    if final:
                        self.content(self.buf[self.region:])
                        self.pos = len(self.buf)
                    return
                if self.buf[i] != "{":
                    self.content(self.buf[self.region:i])
                    self.pos, self.mode = i, "text"
                    continue
                self.call, self.mode = ObjectCall(self, i, self.args_keys), "call"
            elif self.mode == "call":
                result = self.step_object(final)
                if result == "wait":
                    return
                self.mode = "close" if result == "done" else "text"
            else:  # "close": the closing tag, if it comes
                i = skip_ws(self.buf, self.pos)
                rest = self.buf[i:]
                if rest.startswith(self.CLOSE):
                    self.pos, self.mode = i + len(self.CLOSE), "text"
                elif not final and self.CLOSE.startswith(rest):
                    return
                else:
                    self.mode = "text"


class Llama3JsonStream(ToolStream):
    TAG = "<|python_tag|>"
    args_keys = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self.mode = "start"
        self.tag_at: int | None = None  # a python tag not yet followed by a call

    def _run(self, final: bool) -> None:
        buf = self.buf
        while True:
            if self.mode == "start":
                i = skip_ws(buf, self.pos)
                rest = buf[i:]
                if rest.startswith(self.TAG):
                    self.tag_at, self.pos, self.mode = i, i + len(self.TAG), "calls"
                elif rest.startswith("{"):
                    self.pos, self.mode = i, "calls"
                elif not final and self.TAG.startswith(rest):
                    return
                else:
                    self.mode = "text"
            elif self.mode == "text":
                if not self.text_until((self.TAG,), final):
                    return
                self.tag_at, self.mode = self.region, "calls"
            elif self.mode == "calls":
                i = skip_ws(buf, self.pos, ";,")
                if i < len(buf) and buf[i] == "{":
                    self.region = self.tag_at if self.tag_at is not None else i
                    self.pos = i
                    self.call, self.mode = ObjectCall(self, i, self.args_keys), "call"
                    continue
                if i >= len(buf) and not final:
                    return
                if self.tag_at is not None:  # a tag followed by something else: text
                    self.content(buf[self.tag_at:i])
                    self.pos, self.tag_at = i, None
                self.mode = "text"
                if i >= len(buf):
                    return
            else:  # "call"
                result = self.step_object(final)
                if result == "wait":
                    return
                self.tag_at = None
                self.mode = "calls" if result == "done" else "text"


class MistralStream(ToolStream):
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    new_id = staticmethod(mistral_call_id)

    def __init__(self) -> None:
        super().__init__()
        self.tag_at = 0
        self.args_scan: ValueScan | None = None

    def _run(self, final: bool) -> None:
        buf = self.buf
        while True:
            if self.mode == "text":
                if not self.text_until((self.TAG,), final):
                    return
                self.tag_at, self.mode = self.region, "after_tag"
            elif self.mode == "after_tag":
                i = skip_ws(buf, self.pos)
                if i >= len(buf):
                    if final:
                        self.content(buf[self.tag_at:])
                        self.pos = len(buf)
                    return
                if buf[i] == "[":
                    self.pos, self.mode = i + 1, "array"
                elif buf[i] == "{":
                    self.pos, self.mode = i, "array"  # one object, without the brackets
                else:
                    self.pos, self.mode = i, "name"
            elif self.mode == "name":
                k = buf.find(self.ARGS, self.pos)
                if k < 0 and not final and len(buf) - self.pos <= MAX_NAME_CHARS:
                    return
                name = buf[self.pos:k].strip() if k >= 0 else ""
                if not name or len(name) > MAX_NAME_CHARS or any(c.isspace() or c in "{[" for c in name):
                    self.content(buf[self.tag_at:self.pos])
                    self.mode = "text"
                    continue
                self.call = StreamedCall(self)
                self.call.header(name)
                self.pos, self.mode, self.args_scan = k + len(self.ARGS), "args", None
            elif self.mode == "args":
                if self.args_scan is None:
                    i = skip_ws(buf, self.pos)
                    if i >= len(buf):
                        if final:
                            self.call.args("{}")
                        return
                    self.args_scan = ValueScan(i)
                self.call.stream_args(buf, self.args_scan, final)
                if not self.call.args_done:
                    return
                self.pos, self.mode, self.call = self.args_scan.end, "text", None
            elif not self.array_step(final):
                return


class RequiredStream(ToolStream):
    """The output of ``tool_choice: "required"``: ``[{"name": ..., "parameters": {...}}, ...]``."""

    args_keys = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self.mode = "open"

    def _run(self, final: bool) -> None:
        while True:
            if self.mode == "open":
                i = skip_ws(self.buf, self.pos)
                if i >= len(self.buf):
                    return
                self.pos = i + 1 if self.buf[i] == "[" else i
                self.mode = "array" if self.buf[i] == "[" else "text"
            elif self.mode == "text":  # nothing follows the array but whitespace
                self.content(self.buf[self.pos:])
                self.pos = len(self.buf)
                return
            elif not self.array_step(final):
                return


class NamedStream(ToolStream):
    """The output of a named ``tool_choice``: the function's arguments object."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.scan: ValueScan | None = None

    def _run(self, final: bool) -> None:
        if self.call is None:
            self.call = StreamedCall(self)
            self.call.header(self.name)
        if self.scan is None:
            i = skip_ws(self.buf, 0)
            if i >= len(self.buf):
                return
            self.scan = ValueScan(i)
        self.call.stream_args(self.buf, self.scan, final)


@dataclass(frozen=True)
class ToolParser:
    """A format's parser: ``stream()`` for a streamed choice, ``parse`` for a whole text."""

    name: str
    stream_class: type[ToolStream]
    # What a request's skip_special_tokens becomes while this parser reads its output
    # (None: as the request asks): Mistral's [TOOL_CALLS] is a special token.
    skip_special_tokens: bool | None = None

    def stream(self) -> ToolStream:
        return self.stream_class()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse_with(self.stream(), text)


def parse_with(stream: ToolStream, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole text; content is the text itself when it has no call,
    else what is around the calls, stripped (None when nothing is)."""
    delta = stream.feed(text)
    delta.extend(stream.finish())
    calls = assemble_calls(delta.tool_calls)
    if not calls:
        return text, []
    for call in calls:
        with contextlib.suppress(ValueError):  # else as the model wrote them (a truncated output)
            call.arguments = json.dumps(json.loads(call.arguments), ensure_ascii=False)
    return delta.content.strip() or None, calls


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", HermesStream),
    "llama3_json": ToolParser("llama3_json", Llama3JsonStream),
    "mistral": ToolParser("mistral", MistralStream, skip_special_tokens=False),
}


def detect_tool_parser(chat_template: Any) -> str | None:
    """The parser a chat template's tool-call syntax asks for, or None."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(str(v) for v in chat_template.values())
    text = str(chat_template or "")
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and '"parameters"' in text):
        return "llama3_json"
    return None
