"""PyTorch implementations of Tandem's kernels.

These are the ops the CPU path runs and the oracle the Triton kernels are tested
against. Each function has the same signature as its Triton twin in
``kernels.triton_ops``.

Layout conventions (shared by both backends):
- A step's batch is flattened: ``num_tokens`` query tokens from ``num_seqs`` sequences,
  sequence ``s`` owning tokens ``query_start_loc[s]:query_start_loc[s + 1]``.
- ``seq_lens[s]`` counts the sequence's tokens including the new ones, so the first
  new token of ``s`` sits at position ``seq_lens[s] - query_len[s]``.
- KV cache per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V;
  token slot ``b * block_size + i`` is row ``i`` of block ``b``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padding token
) -> None:
    """Scatter new K/V rows into their cache slots; slots < 0 are skipped."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat_k[slot_mapping] = key.to(flat_k.dtype)
        flat_v[slot_mapping] = value.to(flat_v.dtype)
        return
    slots = slot_mapping[valid]
    flat_k[slots] = key[valid].to(flat_k.dtype)
    flat_v[slots] = value[valid].to(flat_v.dtype)


def _gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [n, block_size, kvh, d]
    return blocks.flatten(0, 1)[:seq_len]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and itself.

    Decode sequences (one query token) are computed together as one padded batch;
    each prefill chunk is computed on its own. Softmax runs in float32.
    """
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_idx: list[int] = []
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len == 1:
            decode_idx.append(s)
            continue
        k = _gather_kv(key_cache, block_tables[s], seq_len)
        v = _gather_kv(value_cache, block_tables[s], seq_len)
        q = query[q_start:q_end]
        # Query i sits at position seq_len - q_len + i and sees keys 0..that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(),  # [num_heads, q_len, head_dim]
            k.transpose(0, 1).float().repeat_interleave(group, dim=0),
            v.transpose(0, 1).float().repeat_interleave(group, dim=0),
            attn_mask=mask,
            scale=scale,
        )
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
    if decode_idx:
        _decode_attention(
            query, key_cache, value_cache, block_tables, starts, lens, decode_idx, scale, out
        )
    return out


def _decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: list[int],
    lens: list[int],
    seqs: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """One padded batched attention for the sequences that have a single query token."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    device = query.device
    seq_idx = torch.tensor(seqs, device=device)
    tok_idx = torch.tensor([starts[s] for s in seqs], device=device)
    ctx = torch.tensor([lens[s] for s in seqs], device=device)  # [b]
    max_len = max(lens[s] for s in seqs)
    max_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[seq_idx, :max_blocks].long()  # [b, max_blocks]
    b = len(seqs)
    k = key_cache[tables].view(b, max_blocks * block_size, num_kv_heads, head_dim)[:, :max_len]
    v = value_cache[tables].view(b, max_blocks * block_size, num_kv_heads, head_dim)[:, :max_len]
    q = query[tok_idx].float().view(b, num_kv_heads, group, head_dim)
    # scores: [b, kv_heads, group, max_len]
    scores = torch.einsum("bhgd,bthd->bhgt", q, k.float()) * scale
    valid = torch.arange(max_len, device=device)[None, :] < ctx[:, None]  # [b, max_len]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Rows past a sequence's length are unwritten cache memory: a probability of 0 times
    # a NaN there would still be NaN, so zero those V rows.
    v = v.masked_fill(~valid[:, :, None, None], 0)
    o = torch.einsum("bhgt,bthd->bhgd", probs, v.float())
    out[tok_idx] = o.reshape(b, num_heads, head_dim).to(out.dtype)


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
    orig_dtype = x.dtype
    h = x.float()
    new_residual = None
    if residual is not None:
        h = h + residual.float()
        new_residual = h.to(orig_dtype)
    variance = h.pow(2).mean(dim=-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (h * weight.float()).to(orig_dtype), new_residual


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:d/2], sin in [d/2:]
) -> None:
    """Neox-style rotary embedding (rotate halves), applied in place to query and key."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions]  # [num_tokens, head_dim]
    cos = cos_sin[:, None, :half].float()
    sin = cos_sin[:, None, half:].float()
    for t in (query, key):
        x1 = t[..., :half].float()
        x2 = t[..., half:].float()
        # Both halves are computed before either is written: x1/x2 may alias t.
        rotated_1 = x1 * cos - x2 * sin
        rotated_2 = x2 * cos + x1 * sin
        t[..., :half] = rotated_1.to(t.dtype)
        t[..., half:] = rotated_2.to(t.dtype)
