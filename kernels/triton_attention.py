"""Triton kernel for unified paged attention over a flattened varlen batch.

One kernel serves decode tokens and prefill chunks alike. The grid is
``(query tiles, kv heads)``: a program owns ``BLOCK_Q`` consecutive query tokens of one
sequence and all ``GROUP`` query heads that share one KV head, so each K/V row it loads
serves ``BLOCK_Q * GROUP`` query rows. It walks the sequence's keys in tiles of
``TILE_N``, looking each key up through the block table, with an online softmax in
float32.

Program ids are spread over sequences without a host sync: sequence ``s`` owns ids
``[query_start_loc[s] // BLOCK_Q + s, query_start_loc[s + 1] // BLOCK_Q + s + 1)``, a
range at least as long as its tile count ``cdiv(q_len, BLOCK_Q)``; ids past that count
exit at once. The grid therefore needs ``num_tokens // BLOCK_Q + num_seqs`` ids.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest ``s`` in ``[0, num_seqs)`` with ``query_start_loc[s] // BLOCK_Q + s <= pid``."""
    lo = pid * 0  # int32 scalar; the answer stays in [lo, hi)
    hi = lo + num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first_id = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        owns = first_id <= pid
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid)
    return lo


@triton.jit
def paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    scale,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_block,
    stride_k_row,
    stride_k_head,
    stride_v_block,
    stride_v_row,
    stride_v_head,
    stride_bt_seq,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_M: tl.constexpr,  # query rows per program: BLOCK_Q tokens x GROUP_P heads
    BLOCK_Q: tl.constexpr,  # BLOCK_M // GROUP_P
    TILE_N: tl.constexpr,  # keys per inner iteration
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size
    COMPUTE_F32: tl.constexpr,  # upcast Q/K/V and use exact fp32 dots
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    tile_start = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first token of the tile
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix_len = seq_len - q_len  # tokens cached before this step's chunk

    # Row m of the tile is token tile_start + m // GROUP_P, head m % GROUP_P of the group.
    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP_P  # [BLOCK_M] token index within the chunk
    head_in_group = rows % GROUP_P
    row_valid = (tok < q_len) & (head_in_group < GROUP)  # [BLOCK_M]
    head = kv_head * GROUP + head_in_group
    q_pos = prefix_len + tok  # [BLOCK_M] position in the sequence; sees keys 0..q_pos
    dims = tl.arange(0, HEAD_P)
    dim_valid = dims < HEAD_DIM

    tok64 = (q_start + tok).to(tl.int64)
    q_offs = tok64[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + q_offs, mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_P]
    if COMPUTE_F32:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp

    # Keys beyond the tile's last query position are invisible to every row.
    kv_end = tl.minimum(seq_len, prefix_len + tile_start + BLOCK_Q)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head_ptr = key_cache_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head_ptr = value_cache_ptr + kv_head.to(tl.int64) * stride_v_head

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    for key_start in range(0, kv_end, TILE_N):
        keys = key_start + tl.arange(0, TILE_N)  # [TILE_N] positions
        key_valid = keys < kv_end
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        row_in_block = (keys % BLOCK_SIZE).to(tl.int64)
        kv_mask = key_valid[:, None] & dim_valid[None, :]  # [TILE_N, HEAD_P]
        k_offs = block[:, None] * stride_k_block + row_in_block[:, None] * stride_k_row
        v_offs = block[:, None] * stride_v_block + row_in_block[:, None] * stride_v_row
        k = tl.load(k_head_ptr + k_offs + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_head_ptr + v_offs + dims[None, :], mask=kv_mask, other=0.0)
        if COMPUTE_F32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))  # [BLOCK_M, TILE_N], fp32 accumulation
        visible = (keys[None, :] <= q_pos[:, None]) & key_valid[None, :]
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        # Key 0 is visible to every row, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if COMPUTE_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = tok64[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
