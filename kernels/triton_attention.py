"""Triton kernels for paged attention over a flattened varlen batch.

``paged_attention_kernel``: one kernel for decode tokens and prefill chunks alike. The
grid is ``(query tiles, kv heads)``: a program owns ``BLOCK_Q`` consecutive query tokens
of one sequence and all ``GROUP`` query heads that share one KV head, so each K/V row it
loads serves ``BLOCK_Q * GROUP`` query rows. It walks the sequence's keys in tiles of
``TILE_N``, looking each key up through the block table, with an online softmax in
float32.

Program ids are spread over sequences without a host sync: sequence ``s`` owns ids
``[query_start_loc[s] // BLOCK_Q + s, query_start_loc[s + 1] // BLOCK_Q + s + 1)``, a
range at least as long as its tile count ``cdiv(q_len, BLOCK_Q)``; ids past that count
exit at once. The grid therefore needs ``num_tokens // BLOCK_Q + num_seqs`` ids.

``split_kv_attention_kernel`` + ``split_kv_reduce_kernel``: the split-KV (flash-decoding)
path for decode-only batches, where the grid above is only ``num_seqs * num_kv_heads``
programs (8 at batch 1 on Llama-3.2-1B, for 132 SMs). The grid is ``(num_tokens,
num_kv_heads, NUM_SPLITS)``, i.e. ``(num_seqs, ...)`` with one token per sequence: program
``(i, h, j)`` takes the GROUP query heads of KV head ``h`` for token ``i`` and the
``j``-th of NUM_SPLITS contiguous segments of the keys it sees, and writes an
unnormalised partial result (numerator, running max, denominator) per query row; the
reduce kernel, grid ``(num_tokens, num_heads)``, merges a row's NUM_SPLITS partials. The
segment length is computed on the device from ``seq_lens``, so one launch (NUM_SPLITS
fixed on the host) serves every context length, as a CUDA graph replay needs.

Both paths share ``_attend_key_tile``, so they have the same numerics: scores and softmax
in float32 with exp2, and with ``COMPUTE_F32`` Q/K/V upcast to float32 and exact dots.
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
def _attend_key_tile(
    q,  # [BLOCK_M, HEAD_P] query rows (float32 when COMPUTE_F32)
    m_i,  # [BLOCK_M] float32 running row max of the scaled scores, log2 units
    l_i,  # [BLOCK_M] float32 running softmax denominator
    acc,  # [BLOCK_M, HEAD_P] float32 running numerator (softmax weights x V)
    keys,  # [TILE_N] key positions in the sequence
    key_valid,  # [TILE_N] keys that exist (loaded; the others read as 0)
    q_pos,  # [BLOCK_M] row positions: with CAUSAL a row sees keys <= its position
    table_row,  # the sequence's row of the block table
    k_head_ptr,  # key cache at the program's KV head
    v_head_ptr,  # value cache at the program's KV head
    stride_k_block,
    stride_k_row,
    stride_v_block,
    stride_v_row,
    dims,  # [HEAD_P] 0..HEAD_P-1
    dim_valid,  # [HEAD_P] dims < HEAD_DIM
    qk_scale,  # softmax scale x log2(e)
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size
    CAUSAL: tl.constexpr,  # mask keys past q_pos (else every valid key is visible)
    COMPUTE_F32: tl.constexpr,  # upcast K/V and use exact fp32 dots
):
    """One step of the online softmax over one tile of keys; returns the new
    ``(m_i, l_i, acc)``. A row must see at least one key of the tile or have seen one
    before (else its max stays -inf and exp2(-inf - -inf) is NaN)."""
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
    if CAUSAL:
        visible = (keys[None, :] <= q_pos[:, None]) & key_valid[None, :]
    else:
        visible = key_valid[None, :]
    scores = tl.where(visible, scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])  # [BLOCK_M, TILE_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if COMPUTE_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


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
        # Key 0 is visible to every row, so each row's max is finite from the first tile on.
        m_i, l_i, acc = _attend_key_tile(
            q, m_i, l_i, acc, keys, key_valid, q_pos, table_row, k_head_ptr, v_head_ptr,
            stride_k_block, stride_k_row, stride_v_block, stride_v_row, dims, dim_valid,
            qk_scale, BLOCK_SIZE, True, COMPUTE_F32,
        )  # fmt: skip

    out = acc / l_i[:, None]
    o_offs = tok64[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _token_sequence(query_start_loc_ptr, num_seqs, tok):
    """The sequence that owns token ``tok``: the largest ``s`` in ``[0, num_seqs)`` with
    ``query_start_loc[s] <= tok`` (sequences without tokens share the next one's start)."""
    lo = tok * 0  # int32 scalar; the answer stays in [lo, hi)
    hi = lo + num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        owns = tl.load(query_start_loc_ptr + mid).to(tl.int32) <= tok
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid)
    return lo


@triton.jit
def split_kv_attention_kernel(
    acc_ptr,  # [num_tokens, NUM_HEADS, NUM_SPLITS, HEAD_DIM] float32, written
    max_ptr,  # [num_tokens, NUM_HEADS, NUM_SPLITS] float32, written: row max, log2 units
    denom_ptr,  # [num_tokens, NUM_HEADS, NUM_SPLITS] float32, written: softmax denominator
    query_ptr,  # [num_tokens, NUM_HEADS, HEAD_DIM]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    scale,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_k_block,
    stride_k_row,
    stride_k_head,
    stride_v_block,
    stride_v_row,
    stride_v_head,
    stride_bt_seq,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # query rows per program: GROUP padded to a power of two >= 16
    TILE_N: tl.constexpr,  # keys per inner iteration
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size
    NUM_SPLITS: tl.constexpr,  # key segments per token (the grid's third axis)
    COMPUTE_F32: tl.constexpr,  # upcast Q/K/V and use exact fp32 dots
):
    """Partial attention of token ``program_id(0)``, the GROUP query heads of KV head
    ``program_id(1)``, over key segment ``program_id(2)`` of the token's context.

    The partials are unnormalised: for query row (token t, head h) and split j,
    ``acc[t, h, j] = sum_k exp2(s_k - max[t, h, j]) * v_k`` and
    ``denom[t, h, j] = sum_k exp2(s_k - max[t, h, j])`` over the segment's keys k, with
    ``s_k`` the scaled score in log2 units. An empty segment writes max = -inf, denom = 0
    and acc = 0. Every (token, head, split) of the batch is written exactly once.

    In a decode-only batch token i is sequence i's one token (the grid is then
    ``(num_seqs, num_kv_heads, NUM_SPLITS)``); otherwise (sequences with 0 or several
    tokens) the token's sequence is found by a binary search over query_start_loc, and
    the results stay right.
    """
    tok = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tok
    q_start = tl.load(query_start_loc_ptr + tok).to(tl.int32)
    q_end = tl.load(query_start_loc_ptr + tok + 1).to(tl.int32)
    if (q_start != tok) | (q_end != tok + 1):  # not a decode-only batch
        seq = _token_sequence(query_start_loc_ptr, num_seqs, tok)
        q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
        q_end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # The token sits at position seq_len - q_len + (tok - q_start) and sees the keys up to
    # it: all seq_len of them for a decode token.
    num_visible = seq_len - q_end + tok + 1

    # This program's keys: [seg_start, seg_end). The segment length is a multiple of
    # TILE_N, so segments split the keys on tile boundaries; the last segments of a short
    # context are empty (seg_start >= num_visible). Inside a segment every key is visible.
    chunk = tl.cdiv(tl.cdiv(num_visible, NUM_SPLITS), TILE_N) * TILE_N
    seg_start = split * chunk
    seg_end = tl.minimum(seg_start + chunk, num_visible)

    rows = tl.arange(0, BLOCK_M)  # row r is query head kv_head * GROUP + r
    row_valid = rows < GROUP
    head = kv_head * GROUP + rows  # [BLOCK_M]
    dims = tl.arange(0, HEAD_P)
    dim_valid = dims < HEAD_DIM
    q_mask = row_valid[:, None] & dim_valid[None, :]  # [BLOCK_M, HEAD_P]
    tok64 = tok.to(tl.int64)
    q_offs = tok64 * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(query_ptr + q_offs, mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_P]
    if COMPUTE_F32:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head_ptr = key_cache_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head_ptr = value_cache_ptr + kv_head.to(tl.int64) * stride_v_head

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # stays so for an empty segment
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    # Each tile holds key_start < seg_end, visible to every row: the max stays finite.
    for key_start in range(seg_start, seg_end, TILE_N):
        keys = key_start + tl.arange(0, TILE_N)  # [TILE_N] positions
        key_valid = keys < seg_end
        m_i, l_i, acc = _attend_key_tile(
            q, m_i, l_i, acc, keys, key_valid, rows, table_row, k_head_ptr, v_head_ptr,
            stride_k_block, stride_k_row, stride_v_block, stride_v_row, dims, dim_valid,
            qk_scale, BLOCK_SIZE, False, COMPUTE_F32,
        )  # fmt: skip

    # Partial (token, head, split) is entry (tok * NUM_HEADS + head) * NUM_SPLITS + split.
    part = (tok64 * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M] int64
    tl.store(max_ptr + part, m_i, mask=row_valid)
    tl.store(denom_ptr + part, l_i, mask=row_valid)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)


@triton.jit
def split_kv_reduce_kernel(
    out_ptr,  # [num_tokens, NUM_HEADS, HEAD_DIM]
    acc_ptr,  # [num_tokens, NUM_HEADS, NUM_SPLITS, HEAD_DIM] float32
    max_ptr,  # [num_tokens, NUM_HEADS, NUM_SPLITS] float32, log2 units
    denom_ptr,  # [num_tokens, NUM_HEADS, NUM_SPLITS] float32
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    NUM_SPLITS: tl.constexpr,
):
    """``out[t, h] = sum_j w_j acc[t, h, j] / sum_j w_j denom[t, h, j]`` with
    ``w_j = exp2(max[t, h, j] - max_j max[t, h, j])``: the partials of
    ``split_kv_attention_kernel`` rescaled to a common max. Grid ``(num_tokens, NUM_HEADS)``."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_P)
    dim_valid = dims < HEAD_DIM
    part = (tok * NUM_HEADS + head) * NUM_SPLITS + splits  # [NUM_SPLITS]
    m = tl.load(max_ptr + part)
    denom = tl.load(denom_ptr + part)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=dim_valid[None, :])
    m_max = tl.max(m, axis=0)
    # Empty splits have max -inf and weight exp2(-inf) = 0. Segment 0 holds key 0, so
    # m_max is finite; were every split empty, the row would come out 0 instead of NaN.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [NUM_SPLITS]
    total = tl.sum(w * denom, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(acc * w[:, None], axis=0) / total  # [HEAD_P]
    o_offs = tok * stride_o_tok + head * stride_o_head + dims
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=dim_valid)
