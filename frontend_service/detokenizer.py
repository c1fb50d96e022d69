"""Incremental detokenization and stop-string matching for streamed generation.

Two interchangeable incremental detokenizers turn one token id at a time into new text:

* ``DecodeStreamDetokenizer`` drives ``tokenizers.decoders.DecodeStream`` (Rust) and is
  used whenever the tokenizer has a ``tokenizers`` backend;
* ``OffsetDetokenizer`` decodes a short sliding window of ids with ``tokenizer.decode``
  (the prefix-offset / read-offset scheme) and works with any tokenizer.

Both keep back text that ends in an incomplete UTF-8 character (a multi-byte character
split over several byte-level tokens) until the character is complete, and both are
O(window) per token: no step re-decodes the whole output. ``flush()`` at the end hands
out whatever is still held back, so the concatenation of all returned pieces equals
``tokenizer.decode(output_ids)`` for byte-level BPE tokenizers.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"

# A prompt suffix of at least this many ids (when the prompt has them) primes a detokenizer,
# so that decoders which treat the first token specially (leading-space stripping) see
# the output as a continuation. Longer suffixes are tried, up to the maximum, when a
# shorter one starts inside a multi-byte character.
_MIN_CONTEXT_IDS = 4
_MAX_CONTEXT_IDS = 24


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer that detokenization needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def backend_tokenizer(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind a fast tokenizer, or None."""
    try:
        from tokenizers import Tokenizer as RustTokenizer
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        return None
    if isinstance(tokenizer, RustTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, RustTokenizer) else None


def _decode_stream_class() -> Any | None:
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    return DecodeStream


def clean_prompt_context(tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> list[int]:
    """The shortest usable prompt suffix that decodes without a replacement character.

    Returns [] when every candidate suffix holds an incomplete character (a token-id
    prompt that ends inside one): the output is then decoded on its own.
    """
    num_ids = len(prompt_token_ids)
    shortest = min(_MIN_CONTEXT_IDS, num_ids)
    for length in range(shortest, min(_MAX_CONTEXT_IDS, num_ids) + 1):
        if length == 0:
            continue
        suffix = list(prompt_token_ids[-length:])
        if REPLACEMENT_CHAR not in tokenizer.decode(suffix, skip_special_tokens=False):
            return suffix
    return []


class IncrementalDetokenizer(abc.ABC):
    """Turns a stream of token ids into a stream of text pieces.

    Invariant: the pieces returned by ``step`` and ``flush`` concatenate to the decoded
    output; ``step`` never returns text that ends in an incomplete character.
    """

    @abc.abstractmethod
    def step(self, token_id: int) -> str:
        """Add one output token; return the text it completes ("" if none yet)."""

    @abc.abstractmethod
    def flush(self) -> str:
        """Return the text still held back (an incomplete character decodes as U+FFFD).

        Call once, at the end of generation: no ``step`` may follow.
        """


class OffsetDetokenizer(IncrementalDetokenizer):
    """Sliding-window detokenizer for any tokenizer with ``decode``.

    Invariant: ``_ids[_prefix_offset:_read_offset]`` is the last window whose text was
    handed out and it starts and ends on character boundaries; ids after
    ``_read_offset`` are held back.
    """

    def __init__(
        self, tokenizer: Tokenizer, context_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(context_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _pending_text(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or not window_text.startswith(prefix_text):
            return ""
        return window_text[len(prefix_text) :]

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Ids before the window are never read again.
        if self._prefix_offset > 4 * _MAX_CONTEXT_IDS:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._pending_text()
        if not text or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return text

    def flush(self) -> str:
        if self._read_offset == len(self._ids):
            return ""
        text = self._pending_text()
        self._advance()
        return text


class DecodeStreamDetokenizer(IncrementalDetokenizer):
    """Detokenizer on ``tokenizers``' ``DecodeStream``.

    ``DecodeStream`` returns None while a token does not complete any text. The ids
    since its last piece are kept in ``_pending`` (with a few ids before them in
    ``_context``) only so that ``flush`` can decode what the stream still holds.
    """

    def __init__(self, backend: Any, context_ids: Sequence[int], skip_special_tokens: bool) -> None:
        stream_class = _decode_stream_class()
        if stream_class is None:
            raise RuntimeError("the installed tokenizers has no DecodeStream")
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = stream_class(skip_special_tokens=skip_special_tokens)
        for token_id in context_ids:
            self._stream.step(backend, token_id)
        self._context: list[int] = list(context_ids)[-_MIN_CONTEXT_IDS:]
        self._pending: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, token_id: int) -> str:
        piece = self._stream.step(self._backend, token_id)
        if piece is None:
            self._pending.append(token_id)
            return ""
        self._context = [*self._context, *self._pending, token_id][-_MIN_CONTEXT_IDS:]
        self._pending = []
        return piece

    def flush(self) -> str:
        if not self._pending:
            return ""
        pending = self._pending
        head = self._decode(self._context)
        full = self._decode(self._context + pending)
        text = full[len(head) :] if full.startswith(head) else self._decode(pending)
        # The stream itself still holds ``pending``: flush ends it (no step afterwards).
        self._context = (self._context + pending)[-_MIN_CONTEXT_IDS:]
        self._pending = []
        return text


def make_detokenizer(
    tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool
) -> IncrementalDetokenizer:
    """The fastest incremental detokenizer this tokenizer supports, primed with the prompt."""
    backend = backend_tokenizer(tokenizer)
    # The Rust tokenizer decodes the context directly: transformers' decode adds a layer
    # of Python to each decode of a candidate prompt suffix (several per request).
    context = clean_prompt_context(tokenizer if backend is None else backend, prompt_token_ids)
    if backend is not None and _decode_stream_class() is not None:
        return DecodeStreamDetokenizer(backend, context, skip_special_tokens)
    return OffsetDetokenizer(tokenizer, context, skip_special_tokens)


class TokenTextDecoder:
    """Decodes tokens one by one, as shown next to logprobs (special tokens included)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend = backend_tokenizer(tokenizer)

    def decode_each(self, token_ids: Sequence[int]) -> list[str]:
        if self._backend is not None:
            return list(
                self._backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False)
            )
        return [self._tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    truncate_to: int  # length of the text to keep


class StopStringMatcher:
    """Finds the first stop string in a growing text, searching only what is new.

    ``hold_back`` is how many trailing characters a streamer must not show yet: they
    may be the start of a stop string that the next tokens complete.
    """

    def __init__(self, stops: Sequence[str], include_in_output: bool) -> None:
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self._stops = tuple(stops)
        self._include_in_output = include_in_output
        self.hold_back = max((len(s) for s in self._stops), default=1) - 1

    def __bool__(self) -> bool:
        return bool(self._stops)

    def find(self, text: str, searched_up_to: int) -> StopMatch | None:
        """The earliest stop string ending after ``text[:searched_up_to]`` (already searched)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = text.find(stop, max(0, searched_up_to - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        if best is None:
            return None
        start, stop = best
        return StopMatch(stop, start + len(stop) if self._include_in_output else start)


class OutputText:
    """The text of one generated sequence: detokenized, cut at the first stop string.

    Invariants: ``text[:_searched]`` holds no stop string; once ``stopped``, ``text`` is
    final. Stop strings are not looked for in the text of the first ``min_tokens``
    tokens (a match may still start there and end later).
    """

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        matcher: StopStringMatcher,
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = detokenizer
        self._matcher = matcher
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._searched = 0
        self.text = ""
        self.stopped: StopMatch | None = None

    def add_token(self, token_id: int) -> StopMatch | None:
        """Append one token's text; return the stop match if it ends the text."""
        if self.stopped is not None:
            raise RuntimeError("text already ended at a stop string")
        self._num_tokens += 1
        self.text += self._detokenizer.step(token_id)
        return self._check()

    def finish(self) -> StopMatch | None:
        """Append the held-back text at the end of generation; return a late stop match."""
        if self.stopped is not None:
            return None
        self.text += self._detokenizer.flush()
        return self._check()

    def _check(self) -> StopMatch | None:
        if not self._matcher or self._num_tokens <= self._min_tokens:
            self._searched = len(self.text)
            return None
        match = self._matcher.find(self.text, self._searched)
        self._searched = len(self.text)
        if match is not None:
            self.text = self.text[: match.truncate_to]
            self.stopped = match
        return match

    def shown_length(self, finished: bool) -> int:
        """How much of ``text`` may be streamed now (a possible stop prefix is held back)."""
        if finished or self.stopped is not None:
            return len(self.text)
        return max(0, len(self.text) - self._matcher.hold_back)
