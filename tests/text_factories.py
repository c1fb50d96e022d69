"""A small byte-level BPE tokenizer trained in-process, and random text for text tests."""

from __future__ import annotations

import random
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Character pools for random text: multi-byte UTF-8 of 2, 3 and 4 bytes is the point.
WORDS = ["hello", "world", "the", "quick", "fox", "naïve", "café", "stop", "END", "ok"]
CJK = list("你好世界今天天气很好中文字符测试")
EMOJI = list("😀🎉👍🚀🌍🍕")
PUNCT = [" ", " ", " ", ",", ".", "!", "\n"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def build_test_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (vocab ~400) trained on a tiny corpus with CJK and emoji."""
    corpus = [
        "Hello world, this is a test of the quick brown fox.",
        "你好世界，今天天气很好。中文字符测试。",
        "emoji 😀🎉👍 party 🚀 around the 🌍 with 🍕",
        "naïve café résumé Ünïcödé",
        "stop END ok stop here",
    ] * 10
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map byte-level BPE uses for its base tokens."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_token_ids(tokenizer: Any, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character spans several tokens."""
    table = _bytes_to_unicode()
    return [tokenizer.convert_tokens_to_ids(table[b]) for b in text.encode("utf-8")]


def random_text(rng: random.Random, num_pieces: int) -> str:
    pools = [WORDS, CJK, EMOJI, PUNCT]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(num_pieces))


def split_ids(rng: random.Random, tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``, some pieces byte-split so characters span tokens."""
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + rng.randint(1, 6))
        piece = text[start:end]
        if rng.random() < 0.5:
            ids += byte_token_ids(tokenizer, piece)
        else:
            ids += tokenizer.encode(piece, add_special_tokens=False)
        start = end
    return ids
