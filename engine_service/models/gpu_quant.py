"""4-bit and FP8 checkpoint weights kept quantized on CUDA (kernels/triton_quant_linear.py).

The loader hands a quantized checkpoint's matrices over as stored (``int4_rows``: GPTQ,
AWQ and GGUF Q4 ``Int4Rows``; ``fp8_rows``: compressed-tensors ``Fp8Rows`` when loaded with
``keep_fp8``), one entry per checkpoint tensor, keyed by the parameter it lands in and its
first row there, and fills the dense parameters too. ``pack_quantized_cuda`` then gives
every ``FusedLinear`` whose weight came wholly quantized its packed GPU weight and drops
the dense one: 4-bit weights take about a quarter of bfloat16's memory, FP8 half.

A fused parameter (q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``) is packed from its
parts concatenated in row order, when they tile its rows exactly and agree: one 4-bit group
size (a multiple of 32 dividing K) and one act-order permutation, or FP8 scales (per-tensor
scales that differ become per-channel ones). Otherwise the layer stays dense, as it does
for parameters that are not ``FusedLinear`` weights (MoE experts, the LM head, embeddings).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from engine_service.models.layers import FusedLinear
from engine_service.models.quantized import Fp8Rows, Int4Rows

logger = logging.getLogger(__name__)

# 4-bit groups the kernel takes: multiples of this dividing K (INT4_GROUP_MULTIPLE of
# kernels/triton_quant_linear.py, repeated here so that planning does not import triton).
INT4_GROUP_MULTIPLE = 32

Parts = list[tuple[int, Any]]  # (row_start, Int4Rows or Fp8Rows) of one parameter


class QuantizedLinearWeight(nn.Module):
    """A ``FusedLinear``'s packed quantized weight (``Int4Weight`` / ``Fp8Weight``), its
    tensors registered as buffers so that ``model.to()`` (sleep mode) moves them."""

    def __init__(self, packed: Any) -> None:
        super().__init__()
        self._tensor_fields: list[str] = []
        for f in fields(packed):
            value = getattr(packed, f.name)
            if isinstance(value, torch.Tensor):
                self.register_buffer(f.name, value, persistent=False)
                self._tensor_fields.append(f.name)
        self.packed = packed

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> QuantizedLinearWeight:  # type: ignore[override]
        super()._apply(fn, recurse)
        self.packed = replace(self.packed, **{name: getattr(self, name) for name in self._tensor_fields})
        return self

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.packed.linear(x, bias)


@dataclass(frozen=True)
class PackPlan:
    """What ``pack_quantized_cuda`` does with one ``FusedLinear`` weight."""

    param: str  # parameter name, e.g. "layers.0.self_attn.qkv_proj.weight"
    kind: str  # "int4" or "fp8"
    num_rows: int
    parts: Parts  # as the loader collected them
    reason: str = ""  # why it stays dense; "": packed

    @property
    def packable(self) -> bool:
        return not self.reason

    def merged(self) -> Int4Rows | Fp8Rows:
        rows = merge_parts(self.parts, self.num_rows)
        assert not isinstance(rows, str), rows
        return rows


def check_parts(parts: Parts, num_rows: int) -> str | None:
    """None when ``merge_parts`` can join one parameter's parts, else why not: they must
    cover rows ``[0, num_rows)`` exactly, in one format, and (4-bit) share the group size
    (a multiple of ``INT4_GROUP_MULTIPLE`` dividing K) and the act-order permutation."""
    parts = sorted(parts, key=lambda part: part[0])
    expected = 0
    for start, rows in parts:
        if start != expected:
            return f"rows {expected}..{start} are not quantized" if start > expected else "parts overlap"
        expected += rows.values.shape[0] if isinstance(rows, Fp8Rows) else rows.shape[0]
    if expected != num_rows:
        return f"rows {expected}..{num_rows} are not quantized"
    kinds = {type(rows) for _, rows in parts}
    if len(kinds) != 1:
        return "parts of different formats"
    if kinds == {Fp8Rows}:
        dtypes = {rows.values.dtype for _, rows in parts}
        return None if dtypes == {torch.float8_e4m3fn} else f"values are {sorted(map(str, dtypes))}"
    first = parts[0][1]
    if any(rows.group != first.group for _, rows in parts):
        return f"parts have different group sizes {sorted({rows.group for _, rows in parts})}"
    perms = [rows.perm for _, rows in parts]
    if any(p is None for p in perms) != all(p is None for p in perms) or (
        first.perm is not None and any(not torch.equal(p, first.perm) for p in perms)  # type: ignore[arg-type]
    ):
        return "parts have different act-order permutations"
    k = first.shape[1]
    if first.group % INT4_GROUP_MULTIPLE or k % first.group:
        return f"group {first.group} is not a multiple of {INT4_GROUP_MULTIPLE} dividing K = {k}"
    return None


def merge_parts(parts: Parts, num_rows: int) -> Int4Rows | Fp8Rows | str:
    """One parameter's parts concatenated in row order, or why they cannot be (``check_parts``)."""
    why = check_parts(parts, num_rows)
    if why is not None:
        return why
    rows = [r for _, r in sorted(parts, key=lambda part: part[0])]
    if len(rows) == 1:
        return rows[0]
    if isinstance(rows[0], Fp8Rows):
        values = torch.cat([r.values for r in rows])
        first = rows[0].scales
        if not any(r.per_channel for r in rows) and all(torch.equal(r.scales, first) for r in rows):
            return Fp8Rows(values, first)  # one per-tensor scale stays one
        return Fp8Rows(values, torch.cat([r.row_scales() for r in rows]))
    return Int4Rows(
        torch.cat([r.codes for r in rows]),
        torch.cat([r.scales for r in rows]),
        torch.cat([r.mins for r in rows]),
        rows[0].group,
        rows[0].perm,
    )


def plan_quantized(model: nn.Module) -> list[PackPlan]:
    """For each ``FusedLinear`` weight (still dense) with quantized parts, what
    ``pack_quantized_cuda`` does: pack its merged parts, or leave it dense and why."""
    int4: dict[str, Parts] = getattr(model, "int4_rows", None) or {}
    fp8: dict[str, Parts] = getattr(model, "fp8_rows", None) or {}
    plans = []
    for module_name, module in model.named_modules():
        if type(module) is not FusedLinear or module.weight is None:
            continue
        param = f"{module_name}.weight"
        parts = int4.get(param, []) + fp8.get(param, [])
        if not parts:
            continue
        kind = "fp8" if isinstance(parts[0][1], Fp8Rows) else "int4"
        num_rows = module.weight.shape[0]
        plans.append(PackPlan(param, kind, num_rows, parts, check_parts(parts, num_rows) or ""))
    return plans


def pack_quantized_cuda(model: nn.Module, device: torch.device | str | None = None) -> list[PackPlan]:
    """Give each ``FusedLinear`` whose weight came wholly quantized its packed weight on
    ``device`` (default: where the weight is; CUDA, or CPU under the Triton interpreter)
    and drop the dense weight; then empty ``int4_rows`` and ``fp8_rows`` (nothing else reads
    them on CUDA). Returns the plan it followed."""
    plans = plan_quantized(model)
    if any(plan.packable for plan in plans):
        from kernels.triton_quant_linear import pack_fp8, pack_int4  # imports triton
    modules = dict(model.named_modules())
    packed_bytes = dense_bytes = done = 0
    for plan in plans:
        if not plan.packable:
            logger.info("%s stays dense on the GPU: %s", plan.param, plan.reason)
            continue
        module = modules[plan.param.removesuffix(".weight")]
        weight = module.weight
        target = weight.device if device is None else torch.device(device)
        rows = plan.merged()  # a copy for fused parameters: one layer's at a time
        packed = pack_int4(rows, target) if isinstance(rows, Int4Rows) else pack_fp8(rows.values, rows.scales, target)
        del rows
        dense_bytes += weight.nbytes
        packed_bytes += packed.nbytes
        done += 1
        module.weight = None
        module.packed_weight = QuantizedLinearWeight(packed)
    model.int4_rows = {}
    model.fp8_rows = {}
    if done:
        logger.info(
            "%d quantized linear weights packed for the GPU: %.1f MiB instead of %.1f MiB dense",
            done, packed_bytes / 2**20, dense_bytes / 2**20,
        )
    return plans
