"""Which tokenizer token ids belong to: frontend and engine must agree on it."""

from __future__ import annotations

import hashlib
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_fingerprint(model_dir: str) -> str:
    """sha256 over the checkpoint's tokenizer files (those present, in a fixed order)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.exists():
            h.update(name.encode() + b"\x00" + path.read_bytes())
    return h.hexdigest()
