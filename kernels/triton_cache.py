"""Triton kernel that writes a step's new K/V rows into the paged KV cache."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]; slot b * block_size + i, or -1 for padding
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_row,
    stride_kc_head,
    stride_vc_block,
    stride_vc_row,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copies its [NUM_KV_HEADS, HEAD_DIM] K and V rows."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_P)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]  # [HEADS_P, HEAD_P]

    k_offs = tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
    v_offs = tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    k = tl.load(key_ptr + k_offs, mask=mask)
    v = tl.load(value_ptr + v_offs, mask=mask)
    kc_offs = block * stride_kc_block + row * stride_kc_row + heads[:, None] * stride_kc_head
    vc_offs = block * stride_vc_block + row * stride_vc_row + heads[:, None] * stride_vc_head
    # Converting through fp32 is exact for every supported pair of dtypes.
    k = k.to(tl.float32).to(key_cache_ptr.dtype.element_ty)
    v = v.to(tl.float32).to(value_cache_ptr.dtype.element_ty)
    tl.store(key_cache_ptr + kc_offs + dims[None, :], k, mask=mask)
    tl.store(value_cache_ptr + vc_offs + dims[None, :], v, mask=mask)
