"""A GGUF file's metadata as a Hugging Face checkpoint directory, without torch.

A GGUF file carries its model's config, tokenizer and chat template as metadata (llama.cpp's
key names) beside the tensors. ``write_sidecar`` turns that metadata into the files every
other part of Tandem already reads: ``config.json``, the tokenizer files (with the chat
template) and ``gguf.json``, which names the GGUF file the engine reads its weights from
(``engine_service.models.gguf_weights``). The frontend needs only this module: it reads
the metadata with the ``gguf`` package and builds the tokenizer with ``tokenizers``
through transformers' GGUF tokenizer tables, so a frontend-only install stays torch-free.

Key names follow transformers' GGUF tables (``GGUF_CONFIG_MAPPING``,
``GGUF_TOKENIZER_MAPPING``), so a file transformers reads is read the same way here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tandem.protocol.model_config import SUPPORTED_ARCHITECTURES, ModelLoadError

GGUF_POINTER = "gguf.json"  # in a sidecar directory: {"gguf_file": absolute path, ...}

# GGUF's general.architecture -> config.json's architectures entry, for the families Tandem
# serves. llama.cpp writes Mistral-7B as "llama" (told apart by general.name, see below).
# The other families load from safetensors only: their GGUF conversions change tensors
# (llama.cpp stores Gemma's norms as 1 + w, Phi-3's fused projections under other names).
GGUF_ARCHITECTURES: dict[str, str] = {
    model_type: arch
    for arch, model_type in SUPPORTED_ARCHITECTURES.items()
    if model_type in ("llama", "qwen2", "qwen3")
}


@dataclass(frozen=True)
class GGUFMetadata:
    """What a GGUF file says about itself, tensor data not read."""

    path: str
    fields: dict[str, Any]  # key -> int, float, bool, str or a list of them
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (ggml type name, torch-order shape)

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))


def open_gguf(path: str) -> Any:
    """The ``gguf`` package's reader of ``path`` (the file memory-mapped; no tensor read);
    ModelLoadError for a file it cannot parse."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError) as exc:  # bad magic, truncated file, ...
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc


def read_metadata(path: str) -> GGUFMetadata:
    """Parse ``path``'s header (the ``gguf`` package memory-maps it; no tensor is read)."""
    reader = open_gguf(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {
        t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())))
        for t in reader.tensors
    }
    if "general.architecture" not in fields:
        raise ModelLoadError(f"{path}: GGUF metadata has no general.architecture")
    return GGUFMetadata(path=path, fields=fields, tensors=tensors)


def model_type(meta: GGUFMetadata) -> str:
    """transformers' model_type for the file; ModelLoadError for a family Tandem does not serve."""
    arch = meta.architecture
    name = str(meta.fields.get("general.name", "")).lower()
    if arch == "llama" and "mistral" in name:
        arch = "mistral"  # transformers reads these as Mistral too
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{meta.path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))} (see docs/models.md)"
        )
    return arch


def hf_config(meta: GGUFMetadata) -> dict[str, Any]:
    """The ``config.json`` transformers would build for this file's metadata."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch, mtype = meta.architecture, model_type(meta)
    config: dict[str, Any] = {"architectures": [GGUF_ARCHITECTURES[mtype]], "model_type": mtype}
    for suffix, hf_name in GGUF_CONFIG_MAPPING.get(mtype, GGUF_CONFIG_MAPPING[arch]).items():
        value = meta.fields.get(f"{arch}.{suffix}")
        if hf_name is not None and value is not None:
            config[hf_name] = value
    # Written where k/v heads are not hidden / heads wide (Qwen3), where the table has no entry.
    key_length = meta.fields.get(f"{arch}.attention.key_length")
    if key_length is not None:
        config["head_dim"] = key_length
    if "vocab_size" not in config:
        tokens = meta.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            config["vocab_size"] = len(tokens)
    scaling = meta.fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": meta.fields.get(f"{arch}.rope.scaling.factor", 1.0),
        }
    if "rope_freqs.weight" in meta.tensors:
        raise ModelLoadError(
            f"{meta.path}: per-dimension rope frequency factors (rope_freqs.weight, Llama 3.1+ "
            "long-context scaling) are not supported from GGUF; use the safetensors checkpoint"
        )
    # llama.cpp writes an output matrix only when it is not the embedding matrix.
    config["tie_word_embeddings"] = "output.weight" not in meta.tensors
    for name, key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        value = meta.fields.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[name] = value
    # Every end-of-generation token llama.cpp stops at: end of sequence, of turn, of message.
    eos = [meta.fields[f"tokenizer.ggml.{key}"] for key in ("eos_token_id", "eot_token_id", "eom_token_id")
           if meta.fields.get(f"tokenizer.ggml.{key}") is not None]
    if eos:
        config["eos_token_id"] = list(dict.fromkeys(eos)) if len(set(eos)) > 1 else eos[0]
    return config


def build_tokenizer(meta: GGUFMetadata) -> Any:
    """A ``PreTrainedTokenizerFast`` with the file's vocabulary, merges, special tokens and chat
    template: transformers' GGUF tokenizer conversion, fed from ``meta`` (no torch)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    grouped = {
        group: {name: meta.fields[f"tokenizer.{key}"] for key, name in renames.items()
                if f"tokenizer.{key}" in meta.fields}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer:
        raise ModelLoadError(f"{meta.path}: GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    if tokenizer.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer["tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.fields.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            tokenizer_config[name] = tokens[token_id]
    backend, extra = convert_gguf_tokenizer(meta.architecture, tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def write_sidecar(meta: GGUFMetadata, out_dir: str) -> None:
    """Write ``config.json``, the tokenizer files and ``gguf.json`` for ``meta`` into ``out_dir``."""
    config = hf_config(meta)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    build_tokenizer(meta).save_pretrained(out_dir)
    stat = os.stat(meta.path)
    pointer = {
        "gguf_file": os.path.abspath(meta.path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "tensor_types": sorted({t for t, _ in meta.tensors.values()}),
    }
    with open(os.path.join(out_dir, GGUF_POINTER), "w", encoding="utf-8") as f:
        json.dump(pointer, f, indent=2)


def read_pointer(model_dir: str) -> dict[str, Any] | None:
    """``gguf.json`` of a sidecar directory, None for any other directory."""
    path = os.path.join(model_dir, GGUF_POINTER)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
