"""The fused mixture-of-experts MLP in Triton (CUDA; the interpreter on CPU in tests).

``fused_moe(x, w13, w2, topk_weights, topk_ids)`` computes what
``kernels.moe.fused_moe_reference`` does in three kernels and an alignment step:

1. ``moe_align`` (PyTorch ops on the device, no host sync, fixed output shapes for a
   given T: CUDA-graph friendly): the T k (token, choice) slots sorted by expert (stable:
   slot order within an expert), each expert's run padded to a multiple of ``BLOCK_M``
   with the sentinel ``T k``; ``block_expert[b]`` is the expert of block b, -1 past the
   last used block. Like vLLM's ``moe_align_block_size``.
2. ``moe_gate_up_kernel``: grid (block, tile of I). One program multiplies its block's
   rows of x (gathered by token, ``slot // k``) by one expert's gate and up rows of the
   tile (two accumulators over the same loads of x) and stores ``silu(gate) * up`` for
   those slots: the grouped GEMM and SiLU-and-mul in one pass, ``act [T k, I]``.
3. ``moe_down_kernel``: grid (block, tile of H). ``act @ w2[e].T`` for the block's slots,
   times each slot's routing weight in the epilogue, stored per slot: ``y [T k, H]``.
4. ``moe_sum_kernel``: ``out[t] = sum_j y[t k + j]`` in float32, choices in order. A
   second reduction pass rather than atomic adds into ``out``: deterministic, and no
   zeroing of ``out`` first. With k = 1 the down kernel writes ``out`` directly.

Accumulation is float32 (``tl.dot`` with IEEE float32 products for float32 inputs, not
TF32; bfloat16 upcast to float32 under the interpreter, whose bfloat16 arithmetic is
wrong); ``act`` and ``y`` are stored in x's dtype, as vLLM's intermediate caches are.
Each launch is planned by a ``plan_*`` function returning a ``KernelLaunch`` (see
``kernels.triton_launch``), which the tests also compile for sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_launch import (
    _FLOAT_DTYPES,
    _INDEX_DTYPES,
    KernelLaunch,
    _pow2,
    _require,
    _require_dim,
    _require_dtype,
    _require_launchable,
    _require_unit_last_stride,
    interpreting,
)

__all__ = [
    "MoeTiles",
    "fused_moe",
    "moe_align",
    "moe_tiles",
    "plan_moe_down",
    "plan_moe_gate_up",
    "plan_moe_sum",
]


@triton.jit
def moe_gate_up_kernel(
    act_ptr,  # [num_slots, I]
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]: rows [gate | up]
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] int32 slots; num_slots pads
    block_expert_ptr,  # [num_blocks] int32; -1: unused block
    num_slots,
    hidden,
    inter,
    stride_xm,
    stride_we,
    stride_wn,
    stride_am,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE_F32: tl.constexpr,  # float32 dots (IEEE, not TF32): float32 inputs, bfloat16 interpreted
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_valid = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate columns
    n_valid = n < inter
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_xm  # [BLOCK_M, 1]
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    gate_cols = w_base + n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    up_cols = w_base + (n + inter).to(tl.int64)[None, :] * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + cols
        k_valid = k < hidden
        a = tl.load(x_rows + k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & n_valid[None, :]
        wg = tl.load(gate_cols + k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(up_cols + k[:, None], mask=w_mask, other=0.0)
        if COMPUTE_F32:
            a = a.to(tl.float32)
            acc_gate = tl.dot(a, wg.to(tl.float32), acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, wu.to(tl.float32), acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, wg, acc_gate)
            acc_up = tl.dot(a, wu, acc_up)
    # silu(g) = g * sigmoid(g); for g -> -inf, exp(-g) = inf and g / inf = -0 (no NaN).
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out = act_ptr + slots.to(tl.int64)[:, None] * stride_am + n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def moe_down_kernel(
    y_ptr,  # [num_slots, H] (or [T, H] when TOP_K == 1)
    act_ptr,  # [num_slots, I]
    w2_ptr,  # [E, H, I]
    topk_weights_ptr,  # [num_slots] float32
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] int32
    block_expert_ptr,  # [num_blocks] int32
    num_slots,
    hidden,
    inter,
    stride_am,
    stride_we,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_valid = slots < num_slots
    rows = slots.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden columns
    n_valid = n < hidden
    cols = tl.arange(0, BLOCK_K)
    a_rows = act_ptr + rows[:, None] * stride_am
    w_cols = w2_ptr + expert.to(tl.int64) * stride_we + n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + cols
        k_valid = k < inter
        a = tl.load(a_rows + k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        if COMPUTE_F32:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    weight = tl.load(topk_weights_ptr + rows, mask=m_valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out = y_ptr + rows[:, None] * stride_ym + n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def moe_sum_kernel(
    out_ptr,  # [T, H]
    y_ptr,  # [T * TOP_K, H]
    hidden,
    stride_om,
    stride_ym,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (T, cdiv(H, BLOCK)): out[t, cols] = sum over j < TOP_K of y[t TOP_K + j, cols]."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * stride_ym + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- planning


class MoeTiles:
    """Tile sizes of one fused MoE call."""

    def __init__(self, block_m: int, block_n: int, block_k: int, num_warps: int) -> None:
        self.block_m, self.block_n, self.block_k, self.num_warps = block_m, block_n, block_k, num_warps

    def __repr__(self) -> str:
        return f"MoeTiles(block_m={self.block_m}, block_n={self.block_n}, block_k={self.block_k})"


def moe_tiles(num_slots: int, num_experts: int, hidden: int, inter: int) -> MoeTiles:
    """BLOCK_M from the rows an expert gets on average (16 for decode-sized batches, up to
    64 for prefill), BLOCK_N 64 (32 for narrow I or H), BLOCK_K 64 (32 for short K)."""
    per_expert = num_slots / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else (32 if per_expert <= 64 else 64)
    block_n = 64 if min(hidden, inter) >= 64 else 32
    block_k = 64 if min(hidden, inter) >= 64 else 32
    return MoeTiles(block_m, block_n, block_k, num_warps=4)


def _max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing: each non-empty expert pads fewer than BLOCK_M slots."""
    return triton.cdiv(num_slots + min(num_slots, num_experts) * (block_m - 1), block_m)


def moe_align(
    topk_ids: torch.Tensor,  # [T, k] int32 / int64
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [num_blocks * block_m] int32, block_expert [num_blocks] int32): the slots
    ``t k + j`` grouped by expert (stable), each expert's run padded to a multiple of
    ``block_m`` with ``T k``; ``block_expert[b]`` the expert of block b, -1 for a block past
    every run. ``num_blocks`` depends only on T k, E and ``block_m``. Ids must lie in [0, E)."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    device = flat.device
    num_blocks = _max_blocks(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts  # each expert's first slot in the unpadded order
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = (ends - padded)[expert_of] + torch.arange(n, device=device) - first[expert_of]
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _check_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    _require_dim(x, 2, "x")
    _require_dim(w13, 3, "w13")
    _require_dim(w2, 3, "w2")
    _require_dtype(x, _FLOAT_DTYPES, "x")
    _require(w13.dtype == x.dtype and w2.dtype == x.dtype, f"weights {w13.dtype}/{w2.dtype} must match x {x.dtype}")
    num_experts, two_i, hidden = w13.shape
    _require(two_i % 2 == 0 and hidden == x.shape[1], f"w13 {tuple(w13.shape)} must be [E, 2I, H = {x.shape[1]}]")
    _require(tuple(w2.shape) == (num_experts, hidden, two_i // 2),
             f"w2 {tuple(w2.shape)} must be [{num_experts}, {hidden}, {two_i // 2}]")
    _require_dim(topk_ids, 2, "topk_ids")
    _require_dtype(topk_ids, _INDEX_DTYPES, "topk_ids")
    _require(topk_ids.shape[0] == x.shape[0] and topk_weights.shape == topk_ids.shape,
             f"topk_weights {tuple(topk_weights.shape)} / topk_ids {tuple(topk_ids.shape)} must be [T = {x.shape[0]}, k]")
    _require(topk_weights.dtype == torch.float32, f"topk_weights must be float32, got {topk_weights.dtype}")
    for t, name in ((x, "x"), (w13, "w13"), (w2, "w2")):
        _require_unit_last_stride(t, name)


def _compute_f32(dtype: torch.dtype, interpret: bool) -> bool:
    """float32 dots: for float32 inputs (IEEE products, not TF32), and for bfloat16 under the
    interpreter, whose bfloat16 arithmetic is wrong (see ``kernels.triton_ops``)."""
    return dtype == torch.float32 or (interpret and dtype == torch.bfloat16)


def plan_moe_gate_up(
    act: torch.Tensor,  # [num_slots, I], written
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    tiles: MoeTiles,
    interpret: bool = False,
) -> KernelLaunch:
    num_slots, inter = act.shape
    _require(act.dtype == x.dtype and act.stride(1) == 1, "act must be [T k, I] in x's dtype, unit column stride")
    _require(w13.shape[1] == 2 * inter, f"act has {inter} columns; w13 {tuple(w13.shape)} has 2I rows")
    args = {
        "act_ptr": act,
        "x_ptr": x,
        "w13_ptr": w13,
        "sorted_ids_ptr": sorted_ids,
        "block_expert_ptr": block_expert,
        "num_slots": num_slots,
        "hidden": x.shape[1],
        "inter": inter,
        "stride_xm": x.stride(0),
        "stride_we": w13.stride(0),
        "stride_wn": w13.stride(1),
        "stride_am": act.stride(0),
    }
    constexprs = {
        "TOP_K": top_k,
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "COMPUTE_F32": _compute_f32(x.dtype, interpret),
    }
    grid = (block_expert.shape[0], triton.cdiv(inter, tiles.block_n))
    return KernelLaunch(moe_gate_up_kernel, grid, args, constexprs, num_warps=tiles.num_warps)


def plan_moe_down(
    y: torch.Tensor,  # [num_slots, H], written
    act: torch.Tensor,  # [num_slots, I]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [num_slots] float32, contiguous
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    tiles: MoeTiles,
    interpret: bool = False,
) -> KernelLaunch:
    num_slots, inter = act.shape
    hidden = w2.shape[1]
    _require(y.shape == (num_slots, hidden) and y.stride(1) == 1, f"y must be [{num_slots}, {hidden}]")
    _require(topk_weights.shape == (num_slots,) and topk_weights.is_contiguous(), "topk_weights must be flat")
    args = {
        "y_ptr": y,
        "act_ptr": act,
        "w2_ptr": w2,
        "topk_weights_ptr": topk_weights,
        "sorted_ids_ptr": sorted_ids,
        "block_expert_ptr": block_expert,
        "num_slots": num_slots,
        "hidden": hidden,
        "inter": inter,
        "stride_am": act.stride(0),
        "stride_we": w2.stride(0),
        "stride_wn": w2.stride(1),
        "stride_ym": y.stride(0),
    }
    constexprs = {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "COMPUTE_F32": _compute_f32(act.dtype, interpret),
    }
    grid = (block_expert.shape[0], triton.cdiv(hidden, tiles.block_n))
    return KernelLaunch(moe_down_kernel, grid, args, constexprs, num_warps=tiles.num_warps)


def plan_moe_sum(out: torch.Tensor, y: torch.Tensor, top_k: int) -> KernelLaunch:
    num_tokens, hidden = out.shape
    _require(y.shape == (num_tokens * top_k, hidden) and y.stride(1) == 1 and out.stride(1) == 1,
             f"y must be [{num_tokens * top_k}, {hidden}] for out {tuple(out.shape)} and k = {top_k}")
    block = min(1024, _pow2(hidden))
    args = {"out_ptr": out, "y_ptr": y, "hidden": hidden, "stride_om": out.stride(0), "stride_ym": y.stride(0)}
    grid = (num_tokens, triton.cdiv(hidden, block))
    return KernelLaunch(moe_sum_kernel, grid, args, {"TOP_K": top_k, "BLOCK": block}, num_warps=max(1, min(4, block // 256)))


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: rows [gate | up]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32 / int64, in [0, E)
    tiles: MoeTiles | None = None,
) -> torch.Tensor:  # [T, H] in x's dtype
    """``kernels.moe.fused_moe_reference``'s result through the fused kernels."""
    _check_moe(x, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    num_slots = num_tokens * top_k
    out = x.new_empty(num_tokens, hidden)
    if num_slots == 0:
        return out.zero_()
    _require_launchable(x, w13, w2, topk_weights, topk_ids)
    tiles = tiles or moe_tiles(num_slots, num_experts, hidden, inter)
    sorted_ids, block_expert = moe_align(topk_ids, num_experts, tiles.block_m)
    act = x.new_empty(num_slots, inter)
    interpret = interpreting()
    plan_moe_gate_up(act, x, w13, sorted_ids, block_expert, top_k, tiles, interpret).run()
    y = out if top_k == 1 else x.new_empty(num_slots, hidden)
    weights = topk_weights.reshape(-1).contiguous()
    plan_moe_down(y, act, w2, weights, sorted_ids, block_expert, tiles, interpret).run()
    if top_k > 1:
        plan_moe_sum(out, y, top_k).run()
    return out
