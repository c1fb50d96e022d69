"""Write GPTQ, AWQ and compressed-tensors FP8 checkpoints for tests, each with its float reference.

An independent writer: it follows each format's documented packing (AutoGPTQ's
``QuantLinear.pack``, AutoAWQ's ``WQLinear_GEMM.from_linear``, compressed-tensors'
float-quantized layout) with numpy and shares no code with the engine's reader
(engine_service/models/quant_formats.py). Every linear projection (q/k/v/o/gate/up/down)
of a float checkpoint is quantized round-to-nearest per group; the reference checkpoint
holds, for each of them, the float32 weight the format's formula gives from the stored
integers and scales (the other tensors are copied to both as they are).

Scales are float16 (GPTQ, AWQ) so that ``scale * (q - zero)`` is exact in float32 whichever
way it is evaluated: the engine's dequantized weights equal the reference's bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

LINEAR = re.compile(r"(.*\.(?:q|k|v|o|gate|up|down)_proj)\.weight$")
AWQ_PACK_ORDER = (
    0,
    2,
    4,
    6,
    1,
    3,
    5,
    7,
)  # AutoAWQ: value i of a word holds output order[i] of its 8
_COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass(frozen=True)
class Spec:
    """One quantized checkpoint to write."""

    method: str  # "gptq", "awq" or "fp8"
    group: int = 128  # gptq/awq: inputs per scale, -1: one group per row
    sym: bool = True  # gptq
    act_order: bool = False  # gptq: desc_act with a random g_idx
    v2: bool = False  # gptq: checkpoint_format gptq_v2 (zero points stored as they are)
    strategy: str = "tensor"  # fp8: "tensor" or "channel"
    static_input: bool = False  # fp8: static input activations (an input_scale per layer)
    not_converted: tuple[str, ...] = ()  # layers left in float (AWQ's modules_to_not_convert)
    zero_bias: bool = False  # gptq: a zero bias for every quantized layer (old AutoGPTQ files)
    split: bool = False  # two shard files, each quantized layer's tensors straddling them
    seed: int = 0


# ---- quantizers ------------------------------------------------------------------------------


def quantize_int4(
    w: np.ndarray, g_idx: np.ndarray, num_groups: int, sym: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest 4-bit per group: ``w`` float32 ``[N, K]``, ``g_idx[k]`` the group of
    input k. Returns ``q`` ``[K, N]`` (0..15), ``zeros`` ``[G, N]`` (0..15), ``scales``
    float16 ``[G, N]`` with ``w[n, k] ~ scales[g, n] * (q[k, n] - zeros[g, n])``."""
    n, k = w.shape
    q = np.zeros((k, n), np.int64)
    zeros = np.zeros((num_groups, n), np.int64)
    scales = np.zeros((num_groups, n), np.float16)
    for g in range(num_groups):
        cols = np.nonzero(g_idx == g)[0]
        block = w[:, cols]  # [N, cols]
        lo = np.minimum(block.min(axis=1), 0.0)
        hi = np.maximum(block.max(axis=1), 0.0)
        if sym:
            hi = np.maximum(np.abs(lo), hi)
            lo = -hi
        scale = ((hi - lo) / 15.0).astype(np.float16)
        scale[scale == 0] = 1.0
        zero = np.full(n, 8) if sym else np.clip(np.round(-lo / scale.astype(np.float32)), 0, 15)
        codes = np.round(block / scale.astype(np.float32)[:, None]) + zero[:, None]
        q[cols, :] = np.clip(codes, 0, 15).T
        zeros[g] = zero
        scales[g] = scale
    return q, zeros, scales


def dequantize_int4(
    q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray
) -> np.ndarray:
    """The formula: ``w[n, k] = scales[g, n] * (q[k, n] - zeros[g, n])``, ``g = g_idx[k]``, float32 ``[N, K]``."""
    s = scales.astype(np.float32)[g_idx]  # [K, N]
    return (s * (q - zeros[g_idx]).astype(np.float32)).T.copy()


def pack_along_rows(values: np.ndarray) -> np.ndarray:
    """AutoGPTQ's qweight packing: ``[R, C]`` (0..15) -> int32 ``[R/8, C]``, word i holding
    rows 8i..8i+7, row 8i+j in bits 4j..4j+3."""
    r, c = values.shape
    out = np.zeros((r // 8, c), np.uint32)
    for j in range(8):
        out |= (values[j::8].astype(np.uint32) & 0xF) << np.uint32(4 * j)
    return out.view(np.int32)


def pack_along_columns(values: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """``[R, C]`` (0..15) -> int32 ``[R, C/8]``: value i of word m holds column ``8m + order[i]``
    (GPTQ's qzeros: order 0..7; AWQ's qweight and qzeros: AWQ_PACK_ORDER)."""
    r, c = values.shape
    out = np.zeros((r, c // 8), np.uint32)
    for i, col in enumerate(order):
        out |= (values[:, col::8].astype(np.uint32) & 0xF) << np.uint32(4 * i)
    return out.view(np.int32)


def fp8_e4m3_to_float(bits: np.ndarray) -> np.ndarray:
    """Decode float8_e4m3fn bytes (sign, 4 exponent bits with bias 7, 3 mantissa bits; no
    infinities; exponent 0 subnormal) to float32, by the bit layout."""
    bits = bits.astype(np.int32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp = (bits >> 3) & 0xF
    man = bits & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    subnormal = (man / 8.0) * 2.0**-6
    value = sign * np.where(exp == 0, subnormal, normal)
    value = np.where((exp == 15) & (man == 7), np.nan, value)
    return value.astype(np.float32)


# ---- checkpoints -----------------------------------------------------------------------------


def widen_checkpoint(src: str, out: str, hidden: int, intermediate: int, seed: int = 0) -> str:
    """A random float checkpoint of ``src``'s family and tokenizer with other sizes (group 128
    needs inputs of 128 and more: the tiny presets have hidden 64)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from engine_service.make_model import _randomize_weights

    os.makedirs(out, exist_ok=True)
    _copy_side_files(src, out)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    heads = raw["num_attention_heads"]
    raw.update(hidden_size=hidden, intermediate_size=intermediate, head_dim=hidden // heads)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    config = AutoConfig.from_pretrained(out)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    _randomize_weights(model, seed, 0.1)
    model.save_pretrained(out)
    return out


def write_quantized(src: str, out: str, ref: str, spec: Spec) -> tuple[str, str]:
    """Quantize ``src``'s linear projections per ``spec`` into ``out`` (with its
    ``quantization_config``) and write the dequantized float reference to ``ref``."""
    rng = np.random.default_rng(spec.seed)
    weights = _read_weights(src)
    quantized: dict[str, np.ndarray] = {}
    reference: dict[str, np.ndarray] = {}
    for name, tensor in weights.items():
        match = LINEAR.match(name)
        if match is None or match.group(1) in spec.not_converted:
            quantized[name] = reference[name] = tensor
            continue
        prefix = match.group(1)
        tensor = tensor.astype(np.float32)
        if spec.method == "fp8":
            parts, reference[name] = fp8_layer(tensor, spec)
        else:
            parts, reference[name] = int4_layer(tensor, spec, rng)
        quantized.update({f"{prefix}.{part}": value for part, value in parts.items()})
        if spec.zero_bias and f"{prefix}.bias" not in weights:
            quantized[f"{prefix}.bias"] = np.zeros(tensor.shape[0], np.float16)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    _write(ref, src, config, reference, split=False)
    _write(
        out,
        src,
        {**config, "quantization_config": quantization_config(spec)},
        quantized,
        spec.split,
    )
    return out, ref


def int4_layer(
    w: np.ndarray, spec: Spec, rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One GPTQ or AWQ layer of ``w`` float32 ``[N, K]``: its tensors by part name, and the
    float32 weight the format's formula gives from them."""
    k = w.shape[1]
    group = k if spec.group == -1 else spec.group
    num_groups = -(-k // group)
    # act-order: each input's group from a random permutation of the inputs, cut in groups
    order = rng.permutation(k) if spec.act_order else np.arange(k)
    g_idx = np.argsort(order) // group
    sym = spec.sym if spec.method == "gptq" else False
    q, zeros, scales = quantize_int4(w, g_idx, num_groups, sym)
    if spec.method == "awq":
        parts = {
            "qweight": pack_along_columns(q, AWQ_PACK_ORDER),  # [K, N/8]
            "qzeros": pack_along_columns(zeros, AWQ_PACK_ORDER),  # [G, N/8]
            "scales": scales,
        }
        return parts, dequantize_int4(q, zeros, scales, g_idx)
    # GPTQ v1 stores zero - 1 (4 bits, wrapping); its kernels add the 1 back without wrapping.
    stored = zeros if spec.v2 else (zeros - 1) & 0xF
    effective = stored if spec.v2 else stored + 1
    parts = {
        "qweight": pack_along_rows(q),  # [K/8, N]
        "qzeros": pack_along_columns(stored),  # [G, N/8]
        "scales": scales,
        "g_idx": g_idx.astype(np.int32),
    }
    return parts, dequantize_int4(q, effective, scales, g_idx)


def fp8_layer(w: np.ndarray, spec: Spec) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One compressed-tensors FP8 layer of ``w``: its tensors, and ``weight * weight_scale``
    with the float8 codes decoded by ``fp8_e4m3_to_float``."""
    t = torch.from_numpy(w)
    if spec.strategy == "channel":
        scale = (t.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)  # [N, 1]
    else:
        scale = (t.abs().amax() / 448.0).clamp(min=1e-12).reshape(1)  # [1]
    codes = (t / scale).to(torch.float8_e4m3fn)
    bits = codes.view(torch.uint8).numpy()
    scale_np = scale.numpy().astype(np.float32)
    reference = fp8_e4m3_to_float(bits) * scale_np
    parts = {"weight": codes, "weight_scale": scale_np}
    if spec.static_input:
        parts["input_scale"] = np.array([0.02], np.float32)
    return parts, reference.astype(np.float32)


def quantization_config(spec: Spec) -> dict[str, Any]:
    """The ``quantization_config`` real checkpoints of ``spec``'s kind carry."""
    if spec.method == "gptq":
        return {
            "bits": 4,
            "checkpoint_format": "gptq_v2" if spec.v2 else "gptq",
            "damp_percent": 0.01,
            "desc_act": spec.act_order,
            "group_size": spec.group,
            "lm_head": False,
            "model_file_base_name": None,
            "model_name_or_path": None,
            "quant_method": "gptq",
            "static_groups": False,
            "sym": spec.sym,
            "true_sequential": True,
        }
    if spec.method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": spec.group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(spec.not_converted) or None,
        }
    activations = {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor" if spec.static_input else "token",
        "symmetric": True,
        "dynamic": not spec.static_input,
        "group_size": None,
        "block_structure": None,
        "observer": "minmax" if spec.static_input else None,
        "actorder": None,
        "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": spec.strategy,
                    "symmetric": True,
                    "dynamic": False,
                    "group_size": None,
                    "block_structure": None,
                    "observer": "minmax",
                    "actorder": None,
                    "observer_kwargs": {},
                },
                "input_activations": activations,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", *spec.not_converted],
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "sparsity_config": {},
        "version": "0.9.1",
    }


def _read_weights(model_dir: str) -> dict[str, np.ndarray]:
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    out: dict[str, np.ndarray] = {}
    for name in names:
        out.update(load_file(os.path.join(model_dir, name)))
    return out


def _copy_side_files(src: str, out: str) -> None:
    for name in _COPIED:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(out, name))


def _write(
    out: str, src: str, config: dict[str, Any], tensors: dict[str, Any], split: bool
) -> None:
    """config.json, side files and the weights: one file, or (``split``) two with an index,
    every scale in the second and everything else in the first."""
    os.makedirs(out, exist_ok=True)
    _copy_side_files(src, out)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        file = "model.safetensors"
        if split:
            file = (
                f"model-0000{2 if name.endswith(('scales', 'scale')) else 1}-of-00002.safetensors"
            )
        tensor = (
            value
            if isinstance(value, torch.Tensor)
            else torch.from_numpy(np.ascontiguousarray(value))
        )
        files.setdefault(file, {})[name] = tensor
    for file, part in files.items():
        save_file(part, os.path.join(out, file), metadata={"format": "pt"})
    if split:
        weight_map = {name: file for file, part in files.items() for name in part}
        with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
