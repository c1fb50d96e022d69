"""Reasoning parsers: a thinking model's ``<think>...</think>`` -> ``reasoning_content``.

``--reasoning-parser NAME`` (vLLM's names): the text between ``<think>`` and ``</think>``
is the reasoning, the rest the answer (``content``; tool-call parsing reads only that).
Where the prompt already ends with ``<think>`` (a template that opens the thinking
block itself, as Qwen3's and DeepSeek-R1's do) the output starts inside the reasoning
and only has the ``</think>``.

- ``qwen3``: without ``<think>`` (at the start of the output or the end of the prompt)
  the output is all answer (Qwen3 with ``enable_thinking: false``);
- ``deepseek_r1``: the output starts inside the reasoning even when the prompt does not
  show it (R1 always thinks); without ``</think>`` it is all reasoning.

Streaming holds back a short tail that may be the start of a tag until the next text.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool = False  # the output starts inside the reasoning by default
    start: str = THINK_START
    end: str = THINK_END

    def stream(self, prompt: str | None = None) -> ReasoningStream:
        """A streaming splitter for one output of ``prompt`` (the rendered chat)."""
        inside = self.starts_inside or (prompt is not None and prompt.rstrip().endswith(self.start))
        return ReasoningStream(self, inside)

    def split(self, text: str, prompt: str | None = None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        stream = self.stream(prompt)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2) or None, (c1 + c2) or None


class ReasoningStream:
    """Splits one streamed output: ``feed`` and ``finish`` give (reasoning, content)."""

    def __init__(self, parser: ReasoningParser, inside: bool) -> None:
        self.parser = parser
        self.inside = inside  # the default once the output's start is known
        self.state = "start"  # start (an opening tag may come), reasoning, content
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        return self._run(False)

    def finish(self) -> tuple[str, str]:
        return self._run(True)

    def _run(self, final: bool) -> tuple[str, str]:
        start, end = self.parser.start, self.parser.end
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(start):
                self.buf = head[len(start):]
                self.state = "reasoning"
            elif not final and start.startswith(head):
                return "", ""  # may still become the opening tag
            else:
                self.state = "reasoning" if self.inside else "content"
        if self.state == "reasoning":
            k = self.buf.find(end)
            if k >= 0:
                reasoning, self.buf = self.buf[:k], self.buf[k + len(end):]
                self.state = "content"
            else:
                keep = 0 if final else _partial(self.buf, end)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        if self.state == "content":
            content, self.buf = self.buf, ""
        return reasoning, content


def _partial(buf: str, tag: str) -> int:
    """Length of the longest end of ``buf`` that ``tag`` starts with."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[len(buf) - n:]):
            return n
    return 0


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
}
