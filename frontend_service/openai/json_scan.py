"""Incremental scanning of JSON text as it streams in: where a value ends, and the
members of an object, without waiting for the whole text.

Each scanner is resumable: ``advance(text)`` is called again with the same text grown
by the new characters and carries on where it stopped, so a streamed value of n
characters costs O(n) in all. The scanners find boundaries only; the values
themselves are decoded with ``json.loads`` once they are complete.
"""

from __future__ import annotations

import json

WHITESPACE = " \t\r\n"
_PRIMITIVE_END = WHITESPACE + ",}]"


def skip_ws(text: str, i: int, also: str = "") -> int:
    """The first index at or after ``i`` that is not whitespace (nor in ``also``)."""
    skip = WHITESPACE + also
    n = len(text)
    while i < n and text[i] in skip:
        i += 1
    return i


class ValueScan:
    """Finds the end of the one JSON value that starts at ``start`` (an object, array,
    string, number, true/false/null). ``end`` is None until the value is complete."""

    __slots__ = ("depth", "end", "escape", "i", "in_string", "kind", "start")

    def __init__(self, start: int) -> None:
        self.start = start
        self.i = start  # the next character to look at
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.kind = ""  # "container", "string" or "primitive", set on the first character
        self.end: int | None = None  # one past the value's last character

    def advance(self, text: str, final: bool = False) -> int | None:
        """The value's end once it is complete in ``text``; ``final``: no more text comes
        (a number at the very end is then complete)."""
        if self.end is not None:
            return self.end
        n = len(text)
        i = self.i
        if i >= n:
            return None
        if not self.kind:
            first = text[self.start]
            self.kind = "container" if first in "{[" else "string" if first == '"' else "primitive"
        if self.kind == "primitive":
            while i < n and text[i] not in _PRIMITIVE_END:
                i += 1
            self.i = i
            if i < n or final:
                self.end = i
            return self.end
        while i < n:
            c = text[i]
            i += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.kind == "string":
                        self.end = i
                        break
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.end = i
                    break
        self.i = i
        return self.end


class ObjectScan:
    """The top-level members of the JSON object whose ``{`` is at ``start``.

    ``members`` maps each key seen so far to the ``ValueScan`` of its value (which may
    still be incomplete); ``end`` is set once the closing ``}`` arrived; ``error`` once
    the text is not a JSON object (``error_at``: where)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.i = start + 1
        self.state = "first"  # first, key, key_string, colon, value_start, value, next
        self.members: dict[str, ValueScan] = {}
        self.end: int | None = None
        self.error = False
        self.error_at = start
        self._key: ValueScan | None = None
        self._key_name = ""

    @property
    def done(self) -> bool:
        return self.end is not None or self.error

    def _fail(self, at: int) -> None:
        self.error = True
        self.error_at = at

    def advance(self, text: str) -> None:
        n = len(text)
        while not self.done:
            state = self.state
            if state == "key_string":
                assert self._key is not None
                end = self._key.advance(text)
                if end is None:
                    return
                try:
                    self._key_name = json.loads(text[self._key.start:end])
                except ValueError:
                    self._fail(self._key.start)
                    return
                self.i, self.state = end, "colon"
                continue
            if state == "value":
                scan = self.members[self._key_name]
                end = scan.advance(text)
                if end is None:
                    return
                if end == scan.start:  # not a value at all
                    self._fail(end)
                    return
                self.i, self.state = end, "next"
                continue
            i = skip_ws(text, self.i)
            self.i = i
            if i >= n:
                return
            c = text[i]
            if state in ("first", "key"):
                if c == "}" and state == "first":
                    self.end = i + 1
                elif c == '"':
                    self._key, self.state = ValueScan(i), "key_string"
                else:
                    self._fail(i)
            elif state == "colon":
                if c != ":":
                    self._fail(i)
                else:
                    self.i, self.state = i + 1, "value_start"
            elif state == "value_start":
                self.members[self._key_name] = ValueScan(i)
                self.state = "value"
            elif state == "next":
                if c == ",":
                    self.i, self.state = i + 1, "key"
                elif c == "}":
                    self.end = i + 1
                else:
                    self._fail(i)

    def complete(self, key: str, text: str) -> str | None:
        """The raw text of ``key``'s value once it is complete; None before."""
        scan = self.members.get(key)
        if scan is None or scan.end is None:
            return None
        return text[scan.start:scan.end]
