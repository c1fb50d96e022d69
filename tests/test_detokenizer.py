"""Incremental detokenization and stop strings, on a small byte-level BPE trained here."""

from __future__ import annotations

import random
from typing import Any

import pytest

from frontend_service.detokenizer import (
    REPLACEMENT_CHAR,
    DecodeStreamDetokenizer,
    IncrementalDetokenizer,
    OffsetDetokenizer,
    OutputText,
    StopStringMatcher,
    TokenTextDecoder,
    clean_prompt_context,
    make_detokenizer,
)
from tests.text_factories import CJK, EMOJI, byte_token_ids, random_text, split_ids


class SlowTokenizer:
    """A tokenizer with only ``decode`` (no Rust backend); counts decoded ids."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.decoded_ids = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.decoded_ids += len(token_ids)
        return self._inner.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _detokenizer(
    kind: str, tokenizer: Any, prompt: list[int], skip: bool
) -> IncrementalDetokenizer:
    context = clean_prompt_context(tokenizer, prompt)
    if kind == "stream":
        return DecodeStreamDetokenizer(tokenizer.backend_tokenizer, context, skip)
    return OffsetDetokenizer(tokenizer, context, skip)


def _run(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str]:
    pieces = [detok.step(t) for t in ids]
    return pieces, detok.flush()


@pytest.mark.parametrize("kind", ["stream", "offset"])
def test_valid_text_streams_exactly_without_replacement_chars(
    kind: str, tokenizer: Any, rng: random.Random
) -> None:
    for _ in range(30):
        text = random_text(rng, rng.randint(1, 25))
        ids = split_ids(rng, tokenizer, text)
        prompt = tokenizer.encode(random_text(rng, rng.randint(1, 8)))
        pieces, rest = _run(_detokenizer(kind, tokenizer, prompt, True), ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert "".join(pieces) + rest == text
        assert rest == ""  # valid text: nothing is left held back at the end
        assert all(REPLACEMENT_CHAR not in p for p in pieces)


@pytest.mark.parametrize("kind", ["stream", "offset"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_random_ids_concatenate_to_decode(
    kind: str, skip_special: bool, tokenizer: Any, rng: random.Random
) -> None:
    vocab = len(tokenizer)
    for _ in range(30):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        prompt = tokenizer.encode(random_text(rng, 5))
        pieces, rest = _run(_detokenizer(kind, tokenizer, prompt, skip_special), ids)
        assert "".join(pieces) + rest == tokenizer.decode(ids, skip_special_tokens=skip_special)


@pytest.mark.parametrize("kind", ["stream", "offset"])
def test_multibyte_char_is_held_until_complete_and_flushed_at_end(
    kind: str, tokenizer: Any, rng: random.Random
) -> None:
    char = rng.choice(EMOJI + CJK)
    ids = byte_token_ids(tokenizer, char)
    assert len(ids) >= 3
    detok = _detokenizer(kind, tokenizer, tokenizer.encode("hi"), True)
    assert [detok.step(t) for t in ids] == [""] * (len(ids) - 1) + [char]

    # An incomplete character at the end comes out on flush, as decode shows it.
    cut = rng.randint(1, len(ids) - 1)
    detok = _detokenizer(kind, tokenizer, tokenizer.encode("hi"), True)
    assert [detok.step(t) for t in ids[:cut]] == [""] * cut
    assert detok.flush() == tokenizer.decode(ids[:cut])
    assert REPLACEMENT_CHAR in tokenizer.decode(ids[:cut])


@pytest.mark.parametrize("kind", ["stream", "offset"])
def test_prompt_ending_inside_a_character_does_not_leak_prompt_text(
    kind: str, tokenizer: Any
) -> None:
    emoji = byte_token_ids(tokenizer, "😀")
    prompt = tokenizer.encode("hello world ") + emoji[:2]
    output = emoji[2:] + tokenizer.encode(" ok", add_special_tokens=False)
    pieces, rest = _run(_detokenizer(kind, tokenizer, prompt, True), output)
    assert "".join(pieces) + rest == tokenizer.decode(output)
    assert "hello" not in "".join(pieces)


def test_clean_prompt_context_skips_partial_characters(tokenizer: Any) -> None:
    emoji = byte_token_ids(tokenizer, "😀😀")
    prompt = tokenizer.encode("ab") + emoji  # suffixes of 4..7 ids start mid-emoji
    context = clean_prompt_context(tokenizer, prompt)
    assert context and prompt[-len(context) :] == context
    assert REPLACEMENT_CHAR not in tokenizer.decode(context)
    assert clean_prompt_context(tokenizer, prompt + emoji[:1]) == []


def test_make_detokenizer_prefers_decode_stream(tokenizer: Any) -> None:
    assert isinstance(make_detokenizer(tokenizer, [5, 6], True), DecodeStreamDetokenizer)
    slow = SlowTokenizer(tokenizer)
    assert isinstance(make_detokenizer(slow, [5, 6], True), OffsetDetokenizer)


def test_offset_detokenizer_work_is_linear(tokenizer: Any, rng: random.Random) -> None:
    slow = SlowTokenizer(tokenizer)
    text = random_text(rng, 1500)
    ids = split_ids(rng, tokenizer, text)
    detok = OffsetDetokenizer(slow, [], True)
    pieces, rest = _run(detok, ids)
    assert "".join(pieces) + rest == text
    # Each step decodes two short windows; re-decoding everything would be ~len(ids)^2/2.
    assert slow.decoded_ids < 20 * len(ids)


def test_token_text_decoder_matches_single_token_decode(tokenizer: Any, rng: random.Random) -> None:
    ids = [rng.randrange(len(tokenizer)) for _ in range(50)]
    expected = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert TokenTextDecoder(tokenizer).decode_each(ids) == expected
    assert TokenTextDecoder(SlowTokenizer(tokenizer)).decode_each(ids) == expected


def test_stop_matcher_finds_earliest_match_in_new_tail_only() -> None:
    matcher = StopStringMatcher(["cd", "bcx", "zz"], include_in_output=False)
    assert matcher.hold_back == 2
    assert matcher.find("abcdzz", 0).stop == "cd"  # earliest start wins
    assert matcher.find("abcdzz", 0).truncate_to == 2
    # "cd" ends at 4 <= searched_up_to: already searched, not found again.
    assert matcher.find("abcdzz", 5).stop == "zz"
    assert matcher.find("abcd", 4) is None
    assert matcher.find("abcd", 3).stop == "cd"  # spans the searched boundary
    keep = StopStringMatcher(["cd"], include_in_output=True)
    assert keep.find("abcdef", 0).truncate_to == 4
    assert StopStringMatcher([], include_in_output=False).hold_back == 0
    with pytest.raises(ValueError):
        StopStringMatcher([""], include_in_output=False)


@pytest.mark.parametrize("include", [False, True])
def test_output_text_stop_string_across_tokens(
    include: bool, tokenizer: Any, rng: random.Random
) -> None:
    for _ in range(20):
        before = random_text(rng, rng.randint(0, 6)).replace("X", "")
        after = random_text(rng, rng.randint(1, 6))
        stop = "X" + rng.choice(CJK + EMOJI) + "X"
        text = before + stop + after
        ids = byte_token_ids(tokenizer, text)  # the stop string spans several tokens
        out = OutputText(make_detokenizer(tokenizer, [], True), StopStringMatcher([stop], include))
        shown: list[str] = []
        match = None
        used = 0
        for token in ids:
            used += 1
            match = out.add_token(token)
            if match is not None:
                break
            shown.append(out.text[: out.shown_length(False)])
        assert match is not None and match.stop == stop
        assert used == len(byte_token_ids(tokenizer, before + stop))
        assert out.text == (before + stop if include else before)
        # What was streamed before the match never held any part of the stop string.
        assert all(s == before[: len(s)] for s in shown)


def test_output_text_ignores_stop_strings_within_min_tokens(tokenizer: Any) -> None:
    ids = byte_token_ids(tokenizer, "abcabc")
    out = OutputText(make_detokenizer(tokenizer, [], True), StopStringMatcher(["ab"], False), 3)
    matches = [out.add_token(t) for t in ids[:5]]
    assert [m is not None for m in matches] == [False, False, False, False, True]
    assert out.text == "abc"
    with pytest.raises(RuntimeError):
        out.add_token(ids[5])
