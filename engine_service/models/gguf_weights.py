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
- Q4_0, Q4_1, Q4_K (4-bit codes with per-32 scales and mins): kept as they are in the one
  4-bit form (``Int4Rows``, quantized.py) when the model's linears take 4-bit panels (CPU,
  float32, ``--quantization auto|int8``); dequantized to the model's dtype otherwise. The
  codes are not touched, only re-ordered; the scales and mins are the file's (Q4_0: ``d`` and
  ``-8 d``; Q4_1: ``d`` and ``m``; Q4_K: each 32-weight sub-block's 6-bit scale and min
  times its super-block's ``d`` and ``dmin``), float32, so ``Int4Rows.dequantize`` equals
  ``gguf.quants.dequantize`` bit for bit.
- Q5_0, Q5_1, Q5_K (Q4_0, Q4_1, Q4_K with a fifth bit a weight; Q5_0 is what llama.cpp's
  K-quant mixes such as Q4_K_M fall back to for rows whose length is not a multiple of
  256): ``Int4Rows`` with their fifth bits (``high``) under ``keep_int4``; Q5_0 as int8
  values ``q - 16`` with its scales under ``keep_int8`` alone.
- Q6_K (super-blocks of 256: 6-bit values, an 8-bit scale per 16 times a float16 d): kept
  as int8 values ``q - 32`` with float32 scales ``d * scale`` per 16 (``QuantizedRows``,
  group 16), which the int8 panels store as float16 (rounded: ``d * scale`` can need 19
  bits; a relative 2^-12 at most, far below the format's own step).


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
from engine_service.models.quantized import Q8_0_GROUP, Int4Rows, QuantizedRows
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
    "Q4_0": "4-bit with its per-32 scales (CPU float32 4-bit path), else dequantized",
    "Q4_1": "4-bit with its per-32 scales and mins (CPU float32 4-bit path), else dequantized",
    "Q4_K": "4-bit with per-32 scales and mins from its 6-bit sub-block ones (CPU float32 4-bit path), else dequantized",
    "Q5_0": "5-bit with its per-32 scales (CPU float32 4-bit path; int8 beside int8 rows), else dequantized",
    "Q5_1": "5-bit with its per-32 scales and mins (CPU float32 4-bit path), else dequantized",
    "Q5_K": "5-bit with per-32 scales and mins from its 6-bit sub-block ones (CPU float32 4-bit path), else dequantized",
    "Q6_K": "int8 (its 6-bit values minus 32) with per-16 scales, float16 in the panels (CPU float32 int8 path), else dequantized",
}
_Q8_0_BLOCK_BYTES = 2 + Q8_0_GROUP  # one float16 scale, then the group's int8 values
# 4-bit blocks (ggml-common.h): Q4_0 = float16 d, 16 bytes of codes (byte i: element i in the
# low nibble, i + 16 in the high); Q4_1 = d, m, the same 16 bytes; Q4_K = a super-block of
# 256: float16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of codes (bytes
# 32c..32c+31: sub-block 2c in the low nibbles, 2c + 1 in the high).
Q4_GROUP = 32
_Q4_K_SUPER = 256
_Q4_BLOCK_BYTES = {"Q4_0": 2 + 16, "Q4_1": 4 + 16, "Q4_K": 4 + 12 + 128}
# 5-bit blocks: Q4_0's and Q4_1's with 4 bytes of fifth bits (bit j: element j) after d (and
# m); Q4_K's with 32 bytes of them before the codes (byte e, bit s: sub-block s, element e).
_Q5_BLOCK_BYTES = {"Q5_0": 2 + 4 + 16, "Q5_1": 4 + 4 + 16, "Q5_K": 4 + 12 + 32 + 128}

# GGUF tensors that carry no weights for this decoder.
_IGNORED = frozenset({"rope_freqs.weight"})
# Families whose q/k rows llama.cpp's converter permuted (its LlamaModel.permute).
_PERMUTED_QK = frozenset({"llama"})


# read(keep_int8, keep_int4) -> the tensor, or its stored form (see gguf_entries).
Reader = Callable[[bool, bool], "torch.Tensor | QuantizedRows | Int4Rows"]


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


def _split_q5_0(raw: np.ndarray, cols: int) -> QuantizedRows:
    """Q5_0 bytes ``[N, K / 32 * 22]`` (a block: float16 d, 32 high bits, 16 bytes of low
    nibbles as Q4_0's) -> int8 ``q - 16`` ``[N, K]`` and float32 d ``[N, K / 32]``: exactly
    the weight ``gguf.quants.dequantize`` gives (``d (q - 16)``)."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, cols // Q8_0_GROUP, 22)
    scales = _f16(blocks[..., 0:2])
    high = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [N, G, 1]: bit j = element j's fifth bit
    high = ((high >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)  # [N, G, 32]
    low = (blocks[..., 6:, None] >> np.array([0, 4], dtype=np.uint8)) & np.uint8(0x0F)  # [N, G, 16, 2]
    low = low.transpose(0, 1, 3, 2).reshape(n, -1, 32)  # elements 0-15 low nibbles, 16-31 high
    values = ((low | (high << np.uint8(4))).astype(np.int16) - 16).astype(np.int8).reshape(n, cols)
    return QuantizedRows(torch.from_numpy(values), torch.from_numpy(np.ascontiguousarray(scales)))


def _split_q6_k(raw: np.ndarray, cols: int) -> QuantizedRows:
    """Q6_K bytes ``[N, K / 256 * 210]`` (a block: 128 bytes of low nibbles, 64 of high 2-bit
    pairs, 16 int8 scales, float16 d) -> int8 ``q - 32`` ``[N, K]`` and float32 ``d * scale``
    ``[N, K / 16]`` (group 16): exactly the weight ``gguf.quants.dequantize`` gives."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, 210)  # [N S, 210]
    low = (blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1))
    high = high & np.uint8(0x03)
    values = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << np.uint8(4))).astype(np.int16) - 32
    d = _f16(blocks[:, 208:210])  # [N S]
    scales = d[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [N S, 16]
    return QuantizedRows(
        torch.from_numpy(values.astype(np.int8).reshape(n, cols)),
        torch.from_numpy(np.ascontiguousarray(scales.reshape(n, cols // 16), dtype=np.float32)),
        16,
    )


def _f16(raw: np.ndarray) -> np.ndarray:
    """``[..., 2]`` bytes -> ``[...]`` float32 of the float16 they hold."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _pair_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 ``[N, K]`` codes (one a byte) -> ``[N, K / 2]``, column 2j low, 2j + 1 high."""
    return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4)))


def split_q4(raw: np.ndarray, cols: int, kind: str) -> Int4Rows:
    """A Q4_0 / Q4_1 / Q4_K (or Q5_0 / Q5_1 / Q5_K) matrix's bytes ``[N, K / block *
    block_bytes]`` -> ``Int4Rows`` (group 32; the 5-bit ones with ``high``): the file's codes
    re-ordered, scales and mins in float32 such that ``codes * scale + min`` is exactly what
    ``gguf.quants.dequantize`` computes."""
    n = raw.shape[0]
    high = None
    if kind in _Q5_BLOCK_BYTES:  # the fifth bits out, then the rest as the 4-bit kind
        four = "Q4" + kind[2:]
        per_block = 256 if kind == "Q5_K" else Q4_GROUP
        blocks = np.ascontiguousarray(raw).reshape(n, cols // per_block, _Q5_BLOCK_BYTES[kind])
        head = 16 if kind == "Q5_K" else (2 if kind == "Q5_0" else 4)  # bytes before the bits
        nbits = 32 if kind == "Q5_K" else 4
        bits = blocks[..., head : head + nbits]
        if kind == "Q5_K":  # byte e, bit s -> sub-block s, element e: [N, S, 8 sub-blocks, 32]
            bits = (bits[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)
        else:  # little-endian 32 bits, bit j -> element j
            bits = np.unpackbits(bits, axis=-1, bitorder="little")
        high = np.packbits(bits.reshape(n, cols), axis=-1, bitorder="little")  # [N, K / 8]
        raw = np.concatenate([blocks[..., :head], blocks[..., head + nbits :]], axis=-1).reshape(n, -1)
        kind = four
    if kind == "Q4_K":
        blocks = np.ascontiguousarray(raw).reshape(n, cols // _Q4_K_SUPER, _Q4_BLOCK_BYTES[kind])
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [N, S]
        from gguf.quants import Q4_K

        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))  # [N S, 8] uint8 each
        scales = (d.reshape(-1, 1) * sc.astype(np.float32)).reshape(n, -1)  # [N, K / 32]
        mins = -(dmin.reshape(-1, 1) * mn.astype(np.float32)).reshape(n, -1)
        qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)  # [N, S, chunk c, 1, 32]
        codes = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & np.uint8(0x0F)
        codes = codes.reshape(n, cols)  # [c, low | high] = sub-blocks 2c, 2c + 1
    else:
        blocks = np.ascontiguousarray(raw).reshape(n, cols // Q4_GROUP, _Q4_BLOCK_BYTES[kind])
        scales = _f16(blocks[..., 0:2])  # [N, K / 32]
        # Q4_0: -8 d, exact (a power of two times a float16); Q4_1: the block's m.
        mins = -8.0 * scales if kind == "Q4_0" else _f16(blocks[..., 2:4])
        qs = blocks[..., -16:].reshape(n, -1, 1, 16)
        codes = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        codes = codes.reshape(n, cols)  # [low: elements 0-15 | high: 16-31] per block
    if high is not None and kind == "Q4_0":
        mins = 2.0 * mins  # Q5_0: d (q - 16), q = code + 16 x bit
    return Int4Rows(
        torch.from_numpy(_pair_nibbles(codes)),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32)),
        Q4_GROUP,
        high=None if high is None else torch.from_numpy(np.ascontiguousarray(high)),
    )


def gguf_entries(path: str, config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    """``(hf_name, torch-order shape, read)`` for each weight tensor of the GGUF file ``path``.

    ``read(keep_int8, keep_int4)`` returns the tensor (float32 or as stored for float
    types), or, for a Q8_0 matrix with ``keep_int8``, its ``QuantizedRows``; for a Q4_0,
    Q4_1 or Q4_K matrix with ``keep_int4``, its ``Int4Rows``."""
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

    def read(keep_int8: bool, keep_int4: bool = False) -> torch.Tensor | QuantizedRows | Int4Rows:
        kind = tensor.tensor_type
        data = tensor.data
        if (kind.name in _Q4_BLOCK_BYTES or kind.name in _Q5_BLOCK_BYTES) and keep_int4 and len(shape) == 2:
            q4 = split_q4(data, shape[1], kind.name)
            if heads is not None:
                q4 = Int4Rows(
                    *(_unpermute_qk(t, heads).contiguous() for t in (q4.codes, q4.scales, q4.mins)),
                    q4.group,
                    high=None if q4.high is None else _unpermute_qk(q4.high, heads).contiguous(),
                )
            return q4
        if kind.name in _INT8_SPLITS and keep_int8 and len(shape) == 2:
            q = _INT8_SPLITS[kind.name](data, shape[1])
            if heads is not None:
                q = QuantizedRows(
                    _unpermute_qk(q.values, heads).contiguous(), _unpermute_qk(q.scales, heads).contiguous(), q.group
                )
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


# Types kept as int8 with group scales (keep_int8): their readers.
_INT8_SPLITS: dict[str, Callable[[np.ndarray, int], QuantizedRows]] = {
    "Q8_0": _split_q8_0,
    "Q5_0": _split_q5_0,
    "Q6_K": _split_q6_k,
}


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
