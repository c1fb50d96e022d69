"""The machinery the tool-call parsers share: calls streamed as OpenAI
``delta.tool_calls`` entries, and ``ToolStream``, the state machine each format's
parser (``tool_parsers.py``) builds on.

A call's first entry carries ``index``, ``id``, ``type: "function"`` and
``function.name`` (with ``arguments: ""``); the following ones carry
``function.arguments`` fragments that concatenate to the arguments' JSON text. An
arguments object is passed on as the model writes it, character for character; any
other value (a quoted object, as some models write) once it is complete.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from frontend_service.openai.json_scan import ObjectScan, ValueScan, skip_ws

_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamDelta:
    """What one piece of text added: content, and ``delta.tool_calls`` entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: StreamDelta) -> None:
        self.content += other.content
        self.tool_calls = merge_call_deltas(self.tool_calls + other.tool_calls)


def merge_call_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive entries of one call joined into one (their arguments concatenated)."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"] and "id" not in d:
            out[-1]["function"]["arguments"] += d["function"].get("arguments", "")
        else:
            out.append({**d, "function": dict(d["function"])})
    return out


def assemble_calls(deltas: list[dict[str, Any]]) -> list[ToolCall]:
    """The calls that a list of ``delta.tool_calls`` entries spells out."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        function = d.get("function", {})
        if "id" in d:
            calls[d["index"]] = ToolCall(d["id"], function.get("name", ""), function.get("arguments", ""))
        elif d["index"] in calls:
            calls[d["index"]].arguments += function.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


class StreamedCall:
    """One call being streamed: the header (id, name) first, then the arguments."""

    def __init__(self, stream: ToolStream) -> None:
        self.stream = stream
        self.index = -1
        self.header_sent = False
        self.args_sent = 0  # characters of a container's raw text already sent
        self.args_done = False

    def header(self, name: str) -> None:
        self.index = self.stream.start_call()
        self.header_sent = True
        self.stream.out.tool_calls.append({
            "index": self.index, "id": self.stream.new_id(), "type": "function",
            "function": {"name": name, "arguments": ""},
        })

    def args(self, text: str) -> None:
        if text:
            self.stream.out.tool_calls.append({"index": self.index, "function": {"arguments": text}})

    def stream_args(self, text: str, scan: ValueScan, final: bool = False) -> None:
        """Send what arrived of the arguments value ``scan`` reads: an object's (or
        array's) raw text as it comes, any other value once complete (a string's
        content, as some models quote the arguments)."""
        if self.args_done:
            return
        end = scan.advance(text, final)
        if text[scan.start] in "{[":
            stop = end if end is not None else len(text)
            self.args(text[scan.start + self.args_sent:stop])
            self.args_sent = stop - scan.start
        elif end is not None:
            raw = text[scan.start:end]
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
            self.args(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
        if end is not None:
            self.args_done = True


class ObjectCall(StreamedCall):
    """A call written as one JSON object with a name key and an arguments key."""

    def __init__(self, stream: ToolStream, start: int, args_keys: tuple[str, ...]) -> None:
        super().__init__(stream)
        self.scan = ObjectScan(start)
        self.args_keys = args_keys

    def advance(self, text: str) -> None:
        scan = self.scan
        scan.advance(text)
        if not self.header_sent:
            raw = scan.complete("name", text)
            if raw is None:
                return
            try:
                name = json.loads(raw)
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                scan.error, scan.error_at = True, scan.members["name"].start
                return
            self.header(name)
        key = next((k for k in self.args_keys if k in scan.members), None)
        if key is not None:
            self.stream_args(text, scan.members[key])
        elif scan.end is not None and not self.args_done:
            self.args("{}")
            self.args_done = True


class ToolStream:
    """The streaming state machine of one choice; subclasses read one format."""

    new_id = staticmethod(openai_call_id)
    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0  # text before this was handled
        self.mode = "text"
        self.region = 0  # where the tag or object of the call being read starts
        self.call: Any = None
        self.num_calls = 0
        self.out = StreamDelta()
        self._ws = ""  # whitespace-only content held back: dropped if a call follows

    def feed(self, text: str) -> StreamDelta:
        if text:
            self.buf += text
            self._run(False)
        return self._take()

    def finish(self) -> StreamDelta:
        self._run(True)
        if self._ws and not self.num_calls:
            self.out.content += self._ws
        self._ws = ""
        return self._take()

    def _take(self) -> StreamDelta:
        out, self.out = self.out, StreamDelta()
        out.tool_calls = merge_call_deltas(out.tool_calls)
        return out

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    def start_call(self) -> int:
        self._ws = ""
        self.num_calls += 1
        return self.num_calls - 1

    def content(self, text: str) -> None:
        if not text:
            return
        if text.isspace():
            self._ws += text
            return
        self.out.content += self._ws + text
        self._ws = ""

    def text_until(self, tags: tuple[str, ...], final: bool) -> bool:
        """Text mode: content up to the first of ``tags`` (True, ``pos`` after it,
        ``region`` at it), or all that cannot be the start of a tag (False)."""
        buf, found = self.buf, -1
        tag = ""
        for t in tags:
            k = buf.find(t, self.pos)
            if k >= 0 and (found < 0 or k < found):
                found, tag = k, t
        if found >= 0:
            self.content(buf[self.pos:found])
            self.region, self.pos = found, found + len(tag)
            return True
        stop = len(buf) if final else len(buf) - _partial_tag(buf, self.pos, tags)
        self.content(buf[self.pos:stop])
        self.pos = stop
        return False

    def step_object(self, final: bool) -> str:
        """Advance the object call: "done", "wait" (incomplete) or "failed" (not a call;
        what was not sent is content)."""
        call: ObjectCall = self.call
        call.advance(self.buf)
        scan = call.scan
        if scan.error or (scan.end is not None and not call.header_sent):
            stop = scan.error_at if scan.error else scan.end
            if not call.header_sent:
                self.content(self.buf[self.region:stop])
            self.pos, self.call = stop, None
            return "failed"
        if scan.end is None:
            if final and not call.header_sent:
                self.content(self.buf[self.region:])
                self.pos = len(self.buf)
            return "wait"
        self.pos, self.call = scan.end, None
        return "done"

    def array_step(self, final: bool) -> bool:
        """Modes "array" (between elements of a JSON array of calls) and "array_call";
        False: wait for more text."""
        if self.mode == "array_call":
            result = self.step_object(final)
            if result == "wait":
                return False
            self.mode = "array" if result == "done" else "text"
            return True
        i = skip_ws(self.buf, self.pos, ",")
        if i >= len(self.buf):
            return False
        c = self.buf[i]
        if c == "]":
            self.pos, self.mode = i + 1, "text"
        elif c == "{":
            self.region = self.pos = i
            self.call, self.mode = ObjectCall(self, i, self.args_keys), "array_call"
        else:
            self.mode = "text"
        return True


def _partial_tag(buf: str, pos: int, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``buf[pos:]`` that a tag starts with."""
    longest = min(max(len(t) for t in tags) - 1, len(buf) - pos)
    for n in range(longest, 0, -1):
        tail = buf[len(buf) - n:]
        if any(t.startswith(tail) for t in tags):
            return n
    return 0
