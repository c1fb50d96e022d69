"""The checkpoint's tokenizer files as one ZIP, streamed in chunks (``GetTokenizer``), so
a gateway that cannot read the engine's disk builds the same tokenizer."""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

from smg_grpc_proto.generated import common_pb2

CHUNK_BYTES = 64 * 1024
# What a tokenizer and its chat template are made of; weights are never sent.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
    "added_tokens.json", "chat_template.json", "chat_template.jinja",
)


def tokenizer_zip(model_dir: str) -> tuple[bytes, str]:
    """(ZIP of the tokenizer files at the archive's root, its SHA-256 hex digest)."""
    root = Path(model_dir)
    names = [name for name in TOKENIZER_FILES if (root / name).is_file()]
    if "tokenizer.json" not in names and "tokenizer.model" not in names:
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {model_dir}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            archive.write(root / name, arcname=name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def tokenizer_chunks(data: bytes, sha256: str) -> Iterator[common_pb2.GetTokenizerChunk]:
    """In order; the last chunk carries the digest of the whole archive."""
    offsets = range(0, len(data), CHUNK_BYTES)
    for i, start in enumerate(offsets):
        last = i == len(offsets) - 1
        yield common_pb2.GetTokenizerChunk(data=data[start : start + CHUNK_BYTES], sha256=sha256 if last else "")
