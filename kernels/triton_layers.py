"""Triton kernels for RMSNorm (fused with the residual add) and neox rotary embedding.

Both load their inputs, compute in float32 and cast only when storing.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    out_ptr,  # [num_tokens, hidden]
    new_residual_ptr,  # [num_tokens, hidden]; unused without HAS_RESIDUAL
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden]; unused without HAS_RESIDUAL
    weight_ptr,  # [hidden]
    hidden,
    eps,
    stride_out,
    stride_new_residual,
    stride_x,
    stride_residual,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # hidden rounded up to a power of two
):
    """One program per token row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        h = h + res.to(tl.float32)
        new_res_ptrs = new_residual_ptr + row * stride_new_residual + cols
        tl.store(new_res_ptrs, h.to(new_residual_ptr.dtype.element_ty), mask=mask)
    # Masked columns hold 0, so they add nothing to the sum of squares.
    variance = tl.sum(h * h, axis=0) / hidden
    inv_rms = 1.0 / tl.sqrt(variance + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = h * inv_rms * w
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    base_ptr,  # this token's [num_heads, head_dim] rows
    stride_head,
    num_heads: tl.constexpr,
    cos,  # [HALF_P] fp32
    sin,  # [HALF_P] fp32
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    HEADS_P: tl.constexpr,
):
    """Rotate halves in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    heads = tl.arange(0, HEADS_P)
    cols = tl.arange(0, HALF_P)
    mask = (heads < num_heads)[:, None] & (cols < HALF)[None, :]  # [HEADS_P, HALF_P]
    first = base_ptr + heads[:, None] * stride_head + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    rotated_1 = x1 * cos[None, :] - x2 * sin[None, :]
    rotated_2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, rotated_1.to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, rotated_2.to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_embedding_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_ptr,  # [max_position, head_dim]: cos in [:HALF], sin in [HALF:]
    positions_ptr,  # [num_tokens]
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cos_sin,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    HALF_P: tl.constexpr,  # HALF rounded up to a power of two
    HEADS_P: tl.constexpr,  # NUM_HEADS rounded up to a power of two
    KV_HEADS_P: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
):
    """One program per token: rotates all its query and key heads."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    cols = tl.arange(0, HALF_P)
    cos_ptrs = cos_sin_ptr + pos * stride_cos_sin + cols
    cos = tl.load(cos_ptrs, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_ptrs + HALF, mask=cols < HALF, other=0.0).to(tl.float32)
    q_base = query_ptr + tok * stride_q_tok
    k_base = key_ptr + tok * stride_k_tok
    _rotate_heads(q_base, stride_q_head, NUM_HEADS, cos, sin, HALF, HALF_P, HEADS_P)
    _rotate_heads(k_base, stride_k_head, NUM_KV_HEADS, cos, sin, HALF, HALF_P, KV_HEADS_P)
