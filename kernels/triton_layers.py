"""Triton kernels for RMSNorm (fused with the residual add), SwiGLU's activation
(``silu_and_mul``), neox rotary embedding, and rotary embedding fused with the KV-cache
write (``rotary_and_cache``).

All load their inputs, compute in float32 and cast only when storing.
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
def silu_and_mul_kernel(
    out_ptr,  # [num_tokens, inter]
    gate_up_ptr,  # [num_tokens, 2 * inter]: gate in [:inter], up in [inter:]
    inter,
    stride_out,
    stride_gate_up,
    BLOCK: tl.constexpr,  # columns per program, a power of two
):
    """Grid (num_tokens, cdiv(inter, BLOCK)): program (t, j) writes columns
    [j * BLOCK, (j + 1) * BLOCK) of row t, so one token still spreads over many programs."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptrs = gate_up_ptr + row * stride_gate_up + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g * sigmoid(g); for g -> -inf, exp(-g) = inf and g / inf = -0 (no NaN).
    out = gate / (1.0 + tl.exp(-gate)) * up
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
    """Rotate halves in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). Returns the
    two rotated halves as stored ([HEADS_P, HALF_P] each, in the tensor's dtype)."""
    heads = tl.arange(0, HEADS_P)
    cols = tl.arange(0, HALF_P)
    mask = (heads < num_heads)[:, None] & (cols < HALF)[None, :]  # [HEADS_P, HALF_P]
    first = base_ptr + heads[:, None] * stride_head + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    rotated_1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(base_ptr.dtype.element_ty)
    rotated_2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(base_ptr.dtype.element_ty)
    tl.store(first, rotated_1, mask=mask)
    tl.store(first + HALF, rotated_2, mask=mask)
    return rotated_1, rotated_2


@triton.jit
def _cos_sin(cos_sin_ptr, positions_ptr, tok, stride_cos_sin, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """Token ``tok``'s cos and sin rows ([HALF_P] fp32 each, 0 beyond HALF)."""
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    cols = tl.arange(0, HALF_P)
    cos_ptrs = cos_sin_ptr + pos * stride_cos_sin + cols
    cos = tl.load(cos_ptrs, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_ptrs + HALF, mask=cols < HALF, other=0.0).to(tl.float32)
    return cos, sin


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
    cos, sin = _cos_sin(cos_sin_ptr, positions_ptr, tok, stride_cos_sin, HALF, HALF_P)
    q_base = query_ptr + tok * stride_q_tok
    k_base = key_ptr + tok * stride_k_tok
    _rotate_heads(q_base, stride_q_head, NUM_HEADS, cos, sin, HALF, HALF_P, HEADS_P)
    _rotate_heads(k_base, stride_k_head, NUM_KV_HEADS, cos, sin, HALF, HALF_P, KV_HEADS_P)


@triton.jit
def rotary_and_cache_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_ptr,  # [max_position, head_dim]: cos in [:HALF], sin in [HALF:]
    positions_ptr,  # [num_tokens]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]; slot b * block_size + i, or -1 for padding
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cos_sin,
    stride_kc_block,
    stride_kc_row,
    stride_kc_head,
    stride_vc_block,
    stride_vc_row,
    stride_vc_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    HALF_P: tl.constexpr,  # HALF rounded up to a power of two
    HEADS_P: tl.constexpr,  # NUM_HEADS rounded up to a power of two
    KV_HEADS_P: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # rows per cache block
):
    """One program per token: ``rotary_embedding_kernel`` then ``reshape_and_cache_kernel``.

    Rotates the token's query heads in place and its key heads in place, and (unless its
    slot is -1) writes the rotated key rows, rounded to key's dtype as the two-kernel
    path stores them, and its value rows into the cache slot. Padding tokens are still
    rotated, as ``rotary_embedding`` rotates every token.
    """
    tok = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_ptr, positions_ptr, tok, stride_cos_sin, HALF, HALF_P)
    q_base = query_ptr + tok * stride_q_tok
    _rotate_heads(q_base, stride_q_head, NUM_HEADS, cos, sin, HALF, HALF_P, HEADS_P)
    # Key: rotated and stored in place (every token, padding ones too); k1, k2 are the
    # stored halves, in key's dtype.
    k_base = key_ptr + tok * stride_k_tok
    k1, k2 = _rotate_heads(k_base, stride_k_head, NUM_KV_HEADS, cos, sin, HALF, HALF_P, KV_HEADS_P)

    heads = tl.arange(0, KV_HEADS_P)
    cols = tl.arange(0, HALF_P)
    mask = (heads < NUM_KV_HEADS)[:, None] & (cols < HALF)[None, :]  # [KV_HEADS_P, HALF_P]

    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:  # (a branch: the interpreter rejects a block mask & a scalar bool)
        block = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        # The cache gets ``key.to(cache dtype)`` of the key-dtype values just stored,
        # converted through fp32 as reshape_and_cache_kernel converts them.
        kc_first = (
            key_cache_ptr
            + block * stride_kc_block
            + row * stride_kc_row
            + heads[:, None] * stride_kc_head
            + cols[None, :]
        )
        kc_ty = key_cache_ptr.dtype.element_ty
        tl.store(kc_first, k1.to(tl.float32).to(kc_ty), mask=mask)
        tl.store(kc_first + HALF, k2.to(tl.float32).to(kc_ty), mask=mask)
        # Value: a copy into the cache, in the same two halves.
        v_first = value_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + cols[None, :]
        v1 = tl.load(v_first, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_first + HALF, mask=mask, other=0.0).to(tl.float32)
        vc_first = (
            value_cache_ptr
            + block * stride_vc_block
            + row * stride_vc_row
            + heads[:, None] * stride_vc_head
            + cols[None, :]
        )
        vc_ty = value_cache_ptr.dtype.element_ty
        tl.store(vc_first, v1.to(vc_ty), mask=mask)
        tl.store(vc_first + HALF, v2.to(vc_ty), mask=mask)
