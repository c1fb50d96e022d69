"""How many characters of text one token can cover, where that is certain.

Used to refuse a prompt that is certainly too long before tokenizing it (a 3 MiB
prompt takes seconds to tokenize on the event loop).

The bound: if every character of the input ends up inside some token and a token
covers at most ``L`` characters, a text of ``C`` characters has at least ``C / L``
tokens. So ``C > (max_model_len - 1) * L`` means at least ``max_model_len`` tokens,
which leaves no room for output; special tokens the tokenizer adds only add to that.

``L`` is the longest vocabulary entry, in characters of its token string. A token
string is never shorter than the text it covers for the tokenizers accepted here:
- byte-level BPE (GPT-2, Llama 3, Qwen): each character of a token string stands
  for one byte, and a text character is at least one byte;
- BPE with byte fallback (SentencePiece-style): a regular token's string is the
  text it covers (with "▁" for a space), a fallback token ``<0xNN>`` covers one byte;
- added tokens (``<|im_start|>``) match their own content literally.

The bound holds only if nothing between the text and the model drops or merges
characters, so it is used only when the tokenizer's ``tokenizer.json`` shows: no
normalizer, or only ``Prepend`` / ``Replace`` that never shortens the text; a
pre-tokenizer made of ``ByteLevel``, ``Metaspace``, ``Split``, ``Digits``,
``Punctuation`` that removes nothing; a ``BPE`` model that is byte-level or has
``byte_fallback`` (no unknown token can swallow a run of characters); no added
token with ``lstrip``/``rstrip`` (those absorb any amount of whitespace). For any
other tokenizer (WordPiece, Unigram, normalizers such as NFKC or lower-casing,
whitespace-dropping pre-tokenizers) there is no certain bound: ``None``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

_SAFE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"})


def _flatten(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The steps of a normalizer / pre-tokenizer, with Sequence nodes expanded."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [step for child in node.get(key, []) for step in _flatten(child, key)]
    return [node]


def _normalizer_keeps_length(step: dict[str, Any]) -> bool:
    kind = step.get("type")
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = step.get("pattern", {})
        # A regex pattern can match any length: only literal strings are judged.
        return "String" in pattern and len(step.get("content", "")) >= len(pattern["String"])
    return False


def _pre_tokenizer_keeps_text(step: dict[str, Any]) -> bool:
    return step.get("type") in _SAFE_PRE_TOKENIZERS and step.get("behavior") != "Removed"


def max_token_chars(tokenizer: Any) -> int | None:
    """``L`` as described in the module docstring, or None when no bound is certain."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        vocab = tokenizer.get_vocab()
    except Exception as exc:  # an exotic tokenizer: go without the early check
        logger.info("no prompt length bound for this tokenizer: %s", exc)
        return None
    normalizers = _flatten(spec.get("normalizer"), "normalizers")
    pre_tokenizers = _flatten(spec.get("pre_tokenizer"), "pretokenizers")
    model = spec.get("model") or {}
    byte_level = any(step.get("type") == "ByteLevel" for step in pre_tokenizers)
    certain = (
        all(map(_normalizer_keeps_length, normalizers))
        and all(map(_pre_tokenizer_keeps_text, pre_tokenizers))
        and model.get("type") == "BPE"
        and (byte_level or bool(model.get("byte_fallback")))
        and not any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", []))
    )
    if not certain or not vocab:
        return None
    return max(len(token) for token in vocab)
