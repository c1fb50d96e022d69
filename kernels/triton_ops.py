"""Triton implementations of Tandem's kernels, with the signatures of ``kernels.reference``.

Importing this module imports triton. The launch plumbing is in ``triton_launch``, paged
attention's planning in ``triton_attention_ops``. Each op is split in two:
- ``plan_<op>`` validates the inputs and returns a ``KernelLaunch`` (kernel, grid,
  arguments, compile-time constants). It touches no device, so tests can also hand the
  same launch to ``triton.compile`` for a GPU target on a machine without one.
- ``<op>`` checks that the tensors can be launched on, runs the plan and returns what the
  reference returns.

With ``TRITON_INTERPRET=1`` set before triton is imported, the kernels run on CPU
tensors through Triton's interpreter. The interpreter gets bfloat16 arithmetic wrong, so
there the attention kernel upcasts bfloat16 to float32 right after loading.
"""

from __future__ import annotations

import torch
import triton

# paged_attention and its planning live in triton_attention_ops; exported here with the rest.
from kernels.triton_attention_ops import (
    AttentionTiles,
    SplitKVLaunch,
    SplitKVPartials,
    _num_sms,
    attention_num_splits,
    default_attention_tiles,
    paged_attention,
    plan_paged_attention,
    plan_split_kv_attention,
    split_kv_splits,
    use_split_kv,
)
from kernels.triton_cache import reshape_and_cache_kernel
from kernels.triton_launch import (
    _FLOAT_DTYPES,
    _INDEX_DTYPES,
    _PLANS,
    KernelLaunch,
    PlanCache,
    _check_cache_pair,
    _pow2,
    _require,
    _require_dim,
    _require_dtype,
    _require_launchable,
    _require_unit_last_stride,
    interpreting,
    layout,
)
from kernels.triton_layers import (
    rms_norm_kernel,
    rotary_and_cache_kernel,
    rotary_embedding_kernel,
    silu_and_mul_kernel,
)

__all__ = [
    "_PLANS",
    "AttentionTiles",
    "KernelLaunch",
    "PlanCache",
    "SplitKVLaunch",
    "SplitKVPartials",
    "_num_sms",
    "attention_num_splits",
    "default_attention_tiles",
    "interpreting",
    "layout",
    "paged_attention",
    "plan_paged_attention",
    "plan_reshape_and_cache",
    "plan_rms_norm",
    "plan_rotary_and_cache",
    "plan_rotary_embedding",
    "plan_silu_and_mul",
    "plan_split_kv_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_and_cache",
    "rotary_embedding",
    "silu_and_mul",
    "split_kv_splits",
    "use_split_kv",
]


# ---------------------------------------------------------------- reshape_and_cache


def _check_cache_write(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 marks a padding token
) -> None:
    """The inputs of a KV-cache write (``reshape_and_cache``, ``rotary_and_cache``)."""
    _require_dim(key, 3, "key")
    _require(
        key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    )
    _check_cache_pair(key_cache, value_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    _require(
        tuple(key_cache.shape[2:]) == (num_kv_heads, head_dim),
        f"cache heads/dim {tuple(key_cache.shape[2:])} != key's {(num_kv_heads, head_dim)}",
    )
    _require_dtype(key, _FLOAT_DTYPES, "key")
    _require_dtype(value, _FLOAT_DTYPES, "value")
    _require_unit_last_stride(key, "key")
    _require_unit_last_stride(value, "value")
    _require(
        slot_mapping.shape == (num_tokens,),
        f"slot_mapping must have shape ({num_tokens},), got {tuple(slot_mapping.shape)}",
    )
    _require_dtype(slot_mapping, _INDEX_DTYPES, "slot_mapping")


def plan_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 marks a padding token
) -> KernelLaunch:
    _check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    args = {
        "key_ptr": key,
        "value_ptr": value,
        "key_cache_ptr": key_cache,
        "value_cache_ptr": value_cache,
        "slot_mapping_ptr": slot_mapping,
        "stride_k_tok": key.stride(0),
        "stride_k_head": key.stride(1),
        "stride_v_tok": value.stride(0),
        "stride_v_head": value.stride(1),
        "stride_kc_block": key_cache.stride(0),
        "stride_kc_row": key_cache.stride(1),
        "stride_kc_head": key_cache.stride(2),
        "stride_vc_block": value_cache.stride(0),
        "stride_vc_row": value_cache.stride(1),
        "stride_vc_head": value_cache.stride(2),
    }
    constexprs = {
        "NUM_KV_HEADS": num_kv_heads,
        "HEADS_P": _pow2(num_kv_heads),
        "HEAD_DIM": head_dim,
        "HEAD_P": _pow2(head_dim),
        "BLOCK_SIZE": key_cache.shape[1],
    }
    return KernelLaunch(reshape_and_cache_kernel, (num_tokens,), args, constexprs, num_warps=4)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padding token
) -> None:
    """Scatter new K/V rows into their cache slots; slots < 0 are skipped."""
    launch = plan_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    _require_launchable(key, value, key_cache, value_cache, slot_mapping)
    launch.run()


# ---------------------------------------------------------------- rms_norm


def plan_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None,  # [num_tokens, hidden]
    out: torch.Tensor,  # [num_tokens, hidden], written
    new_residual: torch.Tensor | None,  # [num_tokens, hidden], written iff residual is given
) -> KernelLaunch:
    _require_dim(x, 2, "x")
    _require_dtype(x, _FLOAT_DTYPES, "x")
    num_tokens, hidden = x.shape
    _require(weight.shape == (hidden,), f"weight must have shape ({hidden},)")
    _require_dtype(weight, _FLOAT_DTYPES, "weight")
    _require(out.shape == x.shape, "out must have x's shape")
    has_residual = residual is not None
    _require(
        (new_residual is not None) == has_residual,
        "new_residual must be given exactly when residual is",
    )
    row_tensors = [(x, "x"), (out, "out")]
    if residual is not None and new_residual is not None:
        _require(residual.shape == x.shape, "residual must have x's shape")
        _require(new_residual.shape == x.shape, "new_residual must have x's shape")
        row_tensors += [(residual, "residual"), (new_residual, "new_residual")]
    for t, name in row_tensors:
        _require_dtype(t, _FLOAT_DTYPES, name)
        _require_unit_last_stride(t, name)
    _require(weight.stride(0) == 1 or hidden <= 1, "weight must be contiguous")
    # Without a residual the kernel never touches these two; pass x to keep one signature.
    res = residual if residual is not None else x
    new_res = new_residual if new_residual is not None else out
    args = {
        "out_ptr": out,
        "new_residual_ptr": new_res,
        "x_ptr": x,
        "residual_ptr": res,
        "weight_ptr": weight,
        "hidden": hidden,
        "eps": float(eps),
        "stride_out": out.stride(0),
        "stride_new_residual": new_res.stride(0),
        "stride_x": x.stride(0),
        "stride_residual": res.stride(0),
    }
    block = _pow2(hidden)
    constexprs = {"HAS_RESIDUAL": has_residual, "BLOCK": block}
    num_warps = 1 if block <= 512 else (4 if block <= 4096 else 8)
    return KernelLaunch(rms_norm_kernel, (num_tokens,), args, constexprs, num_warps=num_warps)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm, fused with the residual add when ``residual`` is given.

    Returns ``(normed, new_residual)`` where ``new_residual = x + residual`` (or None
    when no residual was passed). Computed in float32, returned in x's dtype.
    """
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else None

    def plan() -> KernelLaunch:
        launch = plan_rms_norm(x, weight, eps, residual, out, new_residual)
        _require_launchable(*([x, weight, out] + ([residual] if residual is not None else [])))
        return launch

    # out and new_residual are x's layout; without a residual the kernel gets x and out
    # in their places (never read or written)
    tensors = {
        "out_ptr": out, "new_residual_ptr": out if new_residual is None else new_residual, "x_ptr": x,
        "residual_ptr": x if residual is None else residual, "weight_ptr": weight,
    }
    _PLANS.launch(("rms_norm", eps, layout(x), layout(weight), layout(residual)), tensors, plan)
    return out, new_residual


# ---------------------------------------------------------------- silu_and_mul

# Columns per silu_and_mul program. Small batches (decode) take narrow programs so that
# one token's row still spreads over many SMs (I = 8192: 32 programs); larger batches
# have programs enough and take wider ones. Untuned: no GPU was at hand.
_SILU_BLOCK_SMALL_BATCH = 256
_SILU_BLOCK = 1024
_SILU_SMALL_BATCH = 64  # tokens


def plan_silu_and_mul(
    gate_up: torch.Tensor,  # [num_tokens, 2 * inter]: gate in [:inter], up in [inter:]
    out: torch.Tensor,  # [num_tokens, inter], written
) -> KernelLaunch:
    _require_dim(gate_up, 2, "gate_up")
    _require_dtype(gate_up, _FLOAT_DTYPES, "gate_up")
    num_tokens, width = gate_up.shape
    _require(width % 2 == 0, f"gate_up width {width} must be even (gate and up halves)")
    inter = width // 2
    _require(
        out.shape == (num_tokens, inter) and out.dtype == gate_up.dtype,
        f"out must have shape ({num_tokens}, {inter}) and dtype {gate_up.dtype}, "
        f"got {tuple(out.shape)} {out.dtype}",
    )
    _require_unit_last_stride(gate_up, "gate_up")
    _require_unit_last_stride(out, "out")
    wide = _SILU_BLOCK if num_tokens >= _SILU_SMALL_BATCH else _SILU_BLOCK_SMALL_BATCH
    block = min(wide, _pow2(inter))
    args = {
        "out_ptr": out,
        "gate_up_ptr": gate_up,
        "inter": inter,
        "stride_out": out.stride(0),
        "stride_gate_up": gate_up.stride(0),
    }
    grid = (num_tokens, triton.cdiv(inter, block))
    num_warps = max(1, min(4, block // 256))
    return KernelLaunch(silu_and_mul_kernel, grid, args, {"BLOCK": block}, num_warps=num_warps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2I] -> [num_tokens, I]
    """SwiGLU's activation: ``silu(gate_up[:, :I]) * gate_up[:, I:]``, computed in float32
    and returned in gate_up's dtype."""
    _require_dim(gate_up, 2, "gate_up")
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    def plan() -> KernelLaunch:
        launch = plan_silu_and_mul(gate_up, out)
        _require_launchable(gate_up, out)
        return launch

    _PLANS.launch(("silu_and_mul", layout(gate_up)), {"out_ptr": out, "gate_up_ptr": gate_up}, plan)
    return out


# ---------------------------------------------------------------- rotary_embedding


def _check_rotary(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:d/2], sin in [d/2:]
) -> None:
    """The inputs of a rotary embedding (``rotary_embedding``, ``rotary_and_cache``)."""
    _require_dim(query, 3, "query")
    _require_dim(key, 3, "key")
    _require_dim(cos_sin_cache, 2, "cos_sin_cache")
    num_tokens, head_dim = query.shape[0], query.shape[2]
    _require(
        key.shape[0] == num_tokens and key.shape[2] == head_dim,
        f"key {tuple(key.shape)} does not match query {tuple(query.shape)}",
    )
    _require(
        cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0,
        f"cos_sin_cache width {cos_sin_cache.shape[1]} must equal the even head_dim {head_dim}",
    )
    _require(positions.shape == (num_tokens,), f"positions must have shape ({num_tokens},)")
    _require_dtype(positions, _INDEX_DTYPES, "positions")
    for t, name in ((query, "query"), (key, "key"), (cos_sin_cache, "cos_sin_cache")):
        _require_dtype(t, _FLOAT_DTYPES, name)
        _require_unit_last_stride(t, name)


def plan_rotary_embedding(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:d/2], sin in [d/2:]
) -> KernelLaunch:
    _check_rotary(positions, query, key, cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half = head_dim // 2
    args = {
        "query_ptr": query,
        "key_ptr": key,
        "cos_sin_ptr": cos_sin_cache,
        "positions_ptr": positions,
        "stride_q_tok": query.stride(0),
        "stride_q_head": query.stride(1),
        "stride_k_tok": key.stride(0),
        "stride_k_head": key.stride(1),
        "stride_cos_sin": cos_sin_cache.stride(0),
    }
    constexprs = {
        "NUM_HEADS": num_heads,
        "NUM_KV_HEADS": num_kv_heads,
        "HALF": half,
        "HALF_P": _pow2(half),
        "HEADS_P": _pow2(num_heads),
        "KV_HEADS_P": _pow2(num_kv_heads),
    }
    return KernelLaunch(rotary_embedding_kernel, (num_tokens,), args, constexprs, num_warps=4)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:d/2], sin in [d/2:]
) -> None:
    """Neox-style rotary embedding (rotate halves), applied in place to query and key."""
    launch = plan_rotary_embedding(positions, query, key, cos_sin_cache)
    _require_launchable(positions, query, key, cos_sin_cache)
    launch.run()


# ---------------------------------------------------------------- rotary_and_cache


def plan_rotary_and_cache(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:d/2], sin in [d/2:]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 marks a padding token
) -> KernelLaunch:
    _check_rotary(positions, query, key, cos_sin_cache)
    _check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half = head_dim // 2
    args = {
        "query_ptr": query,
        "key_ptr": key,
        "value_ptr": value,
        "cos_sin_ptr": cos_sin_cache,
        "positions_ptr": positions,
        "key_cache_ptr": key_cache,
        "value_cache_ptr": value_cache,
        "slot_mapping_ptr": slot_mapping,
        "stride_q_tok": query.stride(0),
        "stride_q_head": query.stride(1),
        "stride_k_tok": key.stride(0),
        "stride_k_head": key.stride(1),
        "stride_v_tok": value.stride(0),
        "stride_v_head": value.stride(1),
        "stride_cos_sin": cos_sin_cache.stride(0),
        "stride_kc_block": key_cache.stride(0),
        "stride_kc_row": key_cache.stride(1),
        "stride_kc_head": key_cache.stride(2),
        "stride_vc_block": value_cache.stride(0),
        "stride_vc_row": value_cache.stride(1),
        "stride_vc_head": value_cache.stride(2),
    }
    constexprs = {
        "NUM_HEADS": num_heads,
        "NUM_KV_HEADS": num_kv_heads,
        "HALF": half,
        "HALF_P": _pow2(half),
        "HEADS_P": _pow2(num_heads),
        "KV_HEADS_P": _pow2(num_kv_heads),
        "BLOCK_SIZE": key_cache.shape[1],
    }
    return KernelLaunch(rotary_and_cache_kernel, (num_tokens,), args, constexprs, num_warps=4)


def rotary_and_cache(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:d/2], sin in [d/2:]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padding token
) -> None:
    """``rotary_embedding(positions, query, key, cos_sin_cache)`` then
    ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)``, in one launch:
    query and key are rotated in place and the rotated key and the value are written into
    their cache slots (slots < 0 are skipped)."""
    tensors = {
        "query_ptr": query, "key_ptr": key, "value_ptr": value, "cos_sin_ptr": cos_sin_cache,
        "positions_ptr": positions, "key_cache_ptr": key_cache, "value_cache_ptr": value_cache,
        "slot_mapping_ptr": slot_mapping,
    }

    def plan() -> KernelLaunch:
        launch = plan_rotary_and_cache(
            positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping
        )
        _require_launchable(*tensors.values())
        return launch

    _PLANS.launch(("rotary_and_cache", *map(layout, tensors.values())), tensors, plan)
