"""A GGUF file's tensors under Hugging Face names, for the one weight loader.

``gguf_entries`` yields ``(hf_name, shape, read)`` for every tensor of the file, the same
triples ``loader.safetensors_entries`` yields for a safetensors file, so one
``WeightLoader`` checks and places both. Names map through the ``gguf`` package's tensor
name tables (``gguf.get_tensor_name_map``); data comes from the package's memory-mapped
reader.

What each tensor type becomes (``TENSOR_TYPES``):

- F32, F16, BF16: read as they are, cast to the model's dtype.
- Q8_0 (int8 values, one float16 scale per 32 of a row): kept as int8 with its scales
  (``QuantizedRows``, quantized.py) when the model's linears take grouped int8 panels
  (CPU, float32, ``--quantization auto|int8``); dequantized to the model's dtype otherwise.
- Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: dequantized at load to the model's dtype, so they cost
  that dtype's memory (float32: 32 bits a weight where the file stores 4.5-6.6).

Any other type is refused by name before anything is read. llama.cpp stores Llama's q and
k projections with each head's rotary halves interleaved; ``read`` undoes that permutation
(rows only), so the tensors equal the checkpoint transformers would load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_service.models.checkpoint_map import weight_targets
from engine_service.models.quantized import Q8_0_GROUP, QuantizedRows
from tandem.gguf_metadata import open_gguf
from tandem.protocol.model_config import ModelConfig, ModelLoadError

if TYPE_CHECKING:
    from gguf import ReaderTensor

# ggml type name -> what it becomes (docs/models.md shows this table).
TENSOR_TYPES: dict[str, str] = {
    "F32": "float (as stored)",
    "F16": "float (as stored)",
    "BF16": "float (as stored)",
    "Q8_0": "int8 with its per-32 scales (CPU float32 int8 path), else dequantized",
    "Q4_0": "dequantized at load",
    "Q4_1": "dequantized at load",
    "Q4_K": "dequantized at load",
    "Q5_K": "dequantized at load",
    "Q6_K": "dequantized at load",
}
_Q8_0_BLOCK_BYTES = 2 + Q8_0_GROUP  # one float16 scale, then the group's int8 values

# GGUF tensors that carry no weights for this decoder.
_IGNORED = frozenset({"rope_freqs.weight"})
# Families whose q/k rows llama.cpp's converter permuted (its LlamaModel.permute).
_PERMUTED_QK = frozenset({"llama"})


Reader = Callable[[bool], "torch.Tensor | QuantizedRows"]  # read(keep_q8_0) -> tensor


def _unpermute_qk(rows: np.ndarray | torch.Tensor, num_heads: int) -> np.ndarray | torch.Tensor:
    """Inverse of llama.cpp's q/k permutation, which stored each head's rows in
    ``[d/2, 2]`` order (pairs interleaved) where the checkpoint has ``[2, d/2]`` (halves).
    ``rows``: ``[num_heads * head_dim, ...]``."""
    n = rows.shape[0]
    shaped = rows.reshape(num_heads, n // num_heads // 2, 2, *rows.shape[1:])
    if isinstance(shaped, torch.Tensor):
        return shaped.transpose(1, 2).reshape(rows.shape)
    return shaped.swapaxes(1, 2).reshape(rows.shape)


def _split_q8_0(raw: np.ndarray, cols: int) -> QuantizedRows:
    """``[N, K / 32 * 34]`` bytes -> int8 ``[N, K]`` and float32 ``[N, K / 32]``."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, cols // Q8_0_GROUP, _Q8_0_BLOCK_BYTES)
    scales = blocks[:, :, :2].copy().view(np.float16).reshape(n, -1).astype(np.float32)
    values = blocks[:, :, 2:].copy().view(np.int8).reshape(n, cols)
    return QuantizedRows(torch.from_numpy(values), torch.from_numpy(scales))


def gguf_entries(path: str, config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    """``(hf_name, torch-order shape, read)`` for each weight tensor of the GGUF file ``path``.

    ``read(keep_q8_0)`` returns the tensor (float32 or as stored for float types), or, for
    a Q8_0 tensor with ``keep_q8_0``, its ``QuantizedRows``."""
    reader = open_gguf(path)
    unsupported = sorted({t.tensor_type.name for t in reader.tensors} - set(TENSOR_TYPES))
    if unsupported:
        names = [t.name for t in reader.tensors if t.tensor_type.name in unsupported][:3]
        raise ModelLoadError(
            f"{path}: GGUF tensor type(s) {', '.join(unsupported)} are not supported (e.g. "
            f"{', '.join(names)}); supported: {', '.join(TENSOR_TYPES)}"
        )
    arch = _gguf_arch(config.model_type)
    to_hf = _hf_names(arch, config)
    permute = config.model_type in _PERMUTED_QK
    for tensor in reader.tensors:
        if tensor.name in _IGNORED:
            continue
        hf_name = to_hf.get(tensor.name)
        if hf_name is None:
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {tensor.name!r} (no parameter takes it)")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        heads = None
        if permute and hf_name.endswith("self_attn.q_proj.weight"):
            heads = config.num_heads
        elif permute and hf_name.endswith("self_attn.k_proj.weight"):
            heads = config.num_kv_heads
        yield hf_name, shape, _reader(tensor, shape, heads)


def _reader(tensor: ReaderTensor, shape: tuple[int, ...], heads: int | None) -> Reader:
    import gguf

    def read(keep_q8_0: bool) -> torch.Tensor | QuantizedRows:
        kind = tensor.tensor_type
        data = tensor.data
        if kind == gguf.GGMLQuantizationType.Q8_0 and keep_q8_0 and len(shape) == 2:
            q = _split_q8_0(data, shape[1])
            if heads is not None:
                q = QuantizedRows(_unpermute_qk(q.values, heads).contiguous(), _unpermute_qk(q.scales, heads).contiguous())
            return q
        if kind.name in ("F32", "F16"):
            array = np.array(data, copy=True).reshape(shape)  # owned: the map is read-only
        elif kind.name == "BF16":  # numpy has no bfloat16: the bits, widened
            bits = np.asarray(data).view(np.uint16).reshape(shape).astype(np.uint32) << 16
            array = bits.view(np.float32)
        else:
            array = gguf.quants.dequantize(data, kind).reshape(shape)
        if heads is not None:
            array = _unpermute_qk(array, heads)
        return torch.from_numpy(np.ascontiguousarray(array))

    return read


def _gguf_arch(model_type: str) -> object:
    import gguf

    for arch, name in gguf.MODEL_ARCH_NAMES.items():
        if name == model_type:
            return arch
    raise ModelLoadError(f"GGUF: no tensor name table for model type {model_type!r}")


def _hf_names(arch: object, config: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for every tensor this config can hold."""
    import gguf

    table = gguf.get_tensor_name_map(arch, config.num_layers)
    names = list(weight_targets(config))
    if config.tie_word_embeddings:
        names.append("lm_head.weight")  # some tied files still carry output.weight
    out: dict[str, str] = {}
    for hf in names:
        gguf_name = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            out[gguf_name] = hf
    return out
