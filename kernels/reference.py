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

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
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


def _gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n * block_size, num_kv_heads, head_dim], a fresh copy
    # index_select on [num_blocks, block_size * kvh * d] rows copies whole blocks at
    # memcpy speed; advanced indexing of the 4-D tensor is several times slower.
    rows = torch.index_select(cache.view(cache.shape[0], -1), 0, block_ids)
    return rows.view(-1, cache.shape[2], cache.shape[3])


@dataclass
class DecodePlan:
    """The b sequences with one query token."""

    tokens: torch.Tensor  # [b] int64: the query token (row of query/out) of each
    seqs: torch.Tensor  # [b] int64: its row of block_tables / seq_lens
    # Only for the padded PyTorch path (``pad=True`` in ``plan_attention``):
    blocks: torch.Tensor | None = None  # [b * max_blocks] int64
    valid: torch.Tensor | None = None  # [b, padded] bool: key position < seq_len
    pad_rows: torch.Tensor | None = None  # [num_pad] int64: rows of [b * padded] past their sequence
    padded: int = 0  # max_blocks * block_size


@dataclass
class AttentionPlan:
    """Everything about one step's batch that is the same in every layer.

    Built by the first layer's call and kept in the caller's per-step ``workspace``.
    """

    # (first token, end token, seq_len, block ids [n] int64, mask [q_len, seq_len] bool, or
    # None when the chunk is the whole sequence and plain causal attention applies)
    prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]]
    decode: DecodePlan | None
    prefill_seqs: torch.Tensor | None = None  # [P] int64: the sequences of ``prefills``


def plan_attention(
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    block_size: int,
    device: torch.device,
    workspace: dict[str, Any] | None,
    pad_decode: bool,
) -> AttentionPlan:
    """The step's plan, from ``workspace`` when an earlier layer built it already.

    ``pad_decode``: also lay the decode sequences out as one padded batch (what the
    PyTorch decode path needs; in-place kernels skip it).
    """
    key = "attention_plan_padded" if pad_decode else "attention_plan"
    plan = workspace.get(key) if workspace is not None else None
    if plan is None:
        plan = _build_plan(query_start_loc, seq_lens, block_tables, block_size, device, pad_decode)
        if workspace is not None:
            workspace[key] = plan
    return plan


def _build_plan(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    device: torch.device,
    pad_decode: bool,
) -> AttentionPlan:
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    prefills = []
    prefill_seqs: list[int] = []
    decode_seqs: list[int] = []
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 1:
            decode_seqs.append(s)
        elif q_len > 1:
            blocks = block_tables[s, : (seq_len + block_size - 1) // block_size].long()
            mask = None  # a whole prompt: plain causal attention
            if q_len < seq_len:
                # Query i sits at position seq_len - q_len + i and sees keys 0..that position.
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            prefills.append((q_start, q_end, seq_len, blocks, mask))
            prefill_seqs.append(s)
    seqs = torch.tensor(prefill_seqs, dtype=torch.int64, device=device) if prefill_seqs else None
    if not decode_seqs:
        return AttentionPlan(prefills, None, seqs)
    seq_idx = torch.tensor(decode_seqs, device=device)
    decode = DecodePlan(
        tokens=torch.tensor([starts[s] for s in decode_seqs], device=device), seqs=seq_idx
    )
    if pad_decode:
        max_blocks = (max(lens[s] for s in decode_seqs) + block_size - 1) // block_size
        decode.padded = max_blocks * block_size
        ctx = torch.tensor([lens[s] for s in decode_seqs], device=device)  # [b]
        decode.valid = torch.arange(decode.padded, device=device)[None, :] < ctx[:, None]
        decode.blocks = block_tables[seq_idx, :max_blocks].long().flatten()
        decode.pad_rows = (~decode.valid).flatten().nonzero().squeeze(1)
    return AttentionPlan(prefills, decode, seqs)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    workspace: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and itself.

    Decode sequences (one query token) are computed together as one padded batch;
    each prefill chunk is computed on its own. Softmax runs in float32. ``workspace`` is
    a dict the caller passes unchanged to every layer of one step (and renews per
    step): the layer-independent plan of the batch is built once and kept there.
    """
    if out is None:
        out = torch.empty_like(query)
    plan = plan_attention(
        query_start_loc, seq_lens, block_tables, key_cache.shape[1], query.device, workspace, True
    )
    prefill_attention(query, key_cache, value_cache, plan, scale, out)
    if plan.decode is not None:
        _decode_attention(query, key_cache, value_cache, plan.decode, scale, out)
    return out


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the prefill rows are written
) -> None:
    """The plan's prefill chunks (more than one query token), each on its own."""
    for q_start, q_end, seq_len, blocks, mask in plan.prefills:
        k = _gather_blocks(key_cache, blocks)[:seq_len]  # [seq_len, kvh, d]
        v = _gather_blocks(value_cache, blocks)[:seq_len]
        # is_causal lets SDPA skip the masked upper triangle; a later chunk of a prompt
        # needs the offset mask instead.
        q_len, num_heads, head_dim = q_end - q_start, query.shape[1], query.shape[2]
        kvh = k.shape[1]
        group = num_heads // kvh
        # GQA as a [kvh, group] batch over expanded (not copied) K/V: SDPA's CPU flash
        # kernel takes this; enable_gqa=True sent it to the slower math path.
        o = F.scaled_dot_product_attention(
            query[q_start:q_end].transpose(0, 1).float().view(kvh, group, q_len, head_dim),
            k.transpose(0, 1).float()[:, None].expand(kvh, group, seq_len, head_dim),
            v.transpose(0, 1).float()[:, None].expand(kvh, group, seq_len, head_dim),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
        )  # [kvh, group, q_len, head_dim]
        out[q_start:q_end] = o.reshape(num_heads, q_len, head_dim).transpose(0, 1).to(out.dtype)


def _decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One padded batched attention for the sequences that have a single query token."""
    assert plan.blocks is not None and plan.valid is not None and plan.pad_rows is not None
    num_kv_heads, head_dim = key_cache.shape[2:]
    num_heads = query.shape[1]
    b, padded = plan.tokens.shape[0], plan.padded
    k = _gather_blocks(key_cache, plan.blocks).view(b, padded, num_kv_heads, head_dim)
    v = _gather_blocks(value_cache, plan.blocks).view(b, padded, num_kv_heads, head_dim)
    # Rows past a sequence's length hold stale cache memory: a probability of 0 times
    # a NaN there would still be NaN, so zero them (k and v are our own copies).
    k.view(b * padded, -1)[plan.pad_rows] = 0
    v.view(b * padded, -1)[plan.pad_rows] = 0
    o = F.scaled_dot_product_attention(
        # [b, kvh, group, d]: the group of query heads sharing a KV head acts as q_len
        query[plan.tokens].float().view(b, num_kv_heads, num_heads // num_kv_heads, head_dim),
        k.transpose(1, 2).float(),  # [b, kvh, padded, d]
        v.transpose(1, 2).float(),
        attn_mask=plan.valid[:, None, None, :],
        scale=scale,
    )
    out[plan.tokens] = o.reshape(b, num_heads, head_dim).to(out.dtype)


def windowed_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    workspace: dict[str, Any] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``paged_attention`` with a sliding window and/or soft-capped scores.

    ``sliding_window`` W: the query at position p sees keys p - W + 1 .. p, and only the
    blocks holding those are read (a sliding layer's older blocks may be gone).
    ``softcap`` c: scores become ``c * tanh(scores / c)`` before the mask and softmax
    (Gemma 2). Computed per sequence in float32 with explicit masks.
    """
    if out is None:
        out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    num_heads, head_dim = query.shape[1], query.shape[2]
    kvh = key_cache.shape[2]
    group = num_heads // kvh
    bounds = workspace.get("seq_bounds") if workspace is not None else None
    if bounds is None:
        bounds = (query_start_loc.tolist(), seq_lens.tolist())
        if workspace is not None:
            workspace["seq_bounds"] = bounds
    starts, lens = bounds
    device = query.device
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        first_q = seq_len - q_len  # position of the first query token
        first_key = 0 if sliding_window is None else max(0, first_q - sliding_window + 1)
        first_block = first_key // block_size
        last_block = (seq_len + block_size - 1) // block_size
        blocks = block_tables[s, first_block:last_block].long()
        base = first_block * block_size  # position of the first gathered key
        k = _gather_blocks(key_cache, blocks)[: seq_len - base].float()  # [n, kvh, d]
        v = _gather_blocks(value_cache, blocks)[: seq_len - base].float()
        q = query[q_start:q_end].float().view(q_len, kvh, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale  # [kvh, group, q_len, n]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(first_q, seq_len, device=device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(base, seq_len, device=device)[None, :]  # [1, n]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v)  # [q_len, kvh, group, d]
        out[q_start:q_end] = o.reshape(q_len, num_heads, head_dim).to(out.dtype)
    return out


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


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2I] -> [num_tokens, I]
    """GeGLU's activation (Gemma): ``gelu_tanh(gate_up[:, :I]) * gate_up[:, I:]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2I] -> [num_tokens, I]
    """SwiGLU's activation: ``silu(gate_up[:, :I]) * gate_up[:, I:]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


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
    """``rotary_embedding`` (query and key rotated in place, every token) then
    ``reshape_and_cache`` of the rotated key and the value (slots < 0 skipped).

    The Triton backend fuses the two into one kernel; this is their definition.
    """
    rotary_embedding(positions, query, key, cos_sin_cache)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def apply_token_bitmask(
    logits: torch.Tensor,  # [B, V] float
    bitmask: torch.Tensor,  # [K, ceil(V / 32)] int32; bit j of word w allows token 32 w + j
    rows: torch.Tensor,  # [K] int64: the logits row that bitmask row k constrains
) -> None:
    """Set the logits of the tokens a structured-output grammar forbids to -inf, in place.

    Rows of ``logits`` not listed in ``rows`` are untouched. The bitmask layout is
    llguidance's and xgrammar's (little-endian bits of int32 words).
    """
    k, v = bitmask.shape[0], logits.shape[1]
    if k == 0:
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(k, -1)[:, :v].bool()  # [K, V]
    constrained = logits[rows]  # [K, V], a copy
    constrained.masked_fill_(~allowed, float("-inf"))
    logits[rows] = constrained


# ---- seeded sampling's random numbers ----------------------------------------------------
#
# A seeded request's token at output position p is drawn with the uniforms
#
#     u[v] = U(splitmix64(seed, n = p * V + v))     for each vocabulary entry v < V
#
# where splitmix64(seed, n) is the n-th output of SplitMix64 started from ``seed`` (state
# ``seed + (n + 1) * GAMMA`` mod 2^64, then its output mix). It is counter-based: any
# element is computed directly, without drawing the ones before it, so the draw of a
# position depends on (seed, p) only: not on the batch, on what the engine ran before, on
# preemption, or on the engine (a request continued elsewhere from its first p tokens
# draws what it would have drawn in place). SplitMix64 passes BigCrush. U keeps the top
# 23 bits: u = (k + 0.5) * 2^-23 lies in [2^-24, 1 - 2^-24], never 0 or 1.

_MASK64 = (1 << 64) - 1
SPLITMIX64_GAMMA = 0x9E3779B97F4A7C15  # the increment: 2^64 / golden ratio, odd


def seeded_offsets(seeds: Sequence[int], positions: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[S] int64 (the uint64 bits): ``seed + p * V * GAMMA`` mod 2^64 per row, so element
    v of row i has state ``offsets[i] + (v + 1) * GAMMA``."""
    if len(seeds) != len(positions):
        raise ValueError(f"{len(seeds)} seeds but {len(positions)} positions")
    values = [(s + p * vocab_size * SPLITMIX64_GAMMA) & _MASK64 for s, p in zip(seeds, positions)]
    return torch.from_numpy(np.array(values, dtype=np.uint64).view(np.int64))


@functools.lru_cache(maxsize=4)
def _splitmix_steps(vocab_size: int) -> np.ndarray:  # [V] uint64: (v + 1) * GAMMA mod 2^64
    with np.errstate(over="ignore"):
        return np.arange(1, vocab_size + 1, dtype=np.uint64) * np.uint64(SPLITMIX64_GAMMA)


def seeded_uniform(seeds: Sequence[int], positions: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[S, V] float32 CPU uniforms: row i for a request with ``seeds[i]`` sampling its
    output token number ``positions[i]`` (0 = the first token it generates)."""
    offsets = seeded_offsets(seeds, positions, vocab_size).numpy().view(np.uint64)
    with np.errstate(over="ignore"):
        z = offsets[:, None] + _splitmix_steps(vocab_size)[None, :]  # [S, V] uint64 states
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    u = (z >> np.uint64(41)).astype(np.float32)  # integers k in [0, 2^23)
    u += np.float32(0.5)
    u *= np.float32(2.0**-23)
    return torch.from_numpy(u)
