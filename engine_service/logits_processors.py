"""The logits processors of the sampler, each on a whole [B, V] batch at once.

Masks (allowed token ids, min_tokens), logit bias and the penalties edit the logits in
place (``*_`` names); min-p, top-k and top-p return a copy with the dropped tokens at
-inf; ``exponential_race`` draws one token per row (see ``Sampler`` for the order).

Extreme but valid knobs keep the logits usable: a token is either masked (-inf) or has a
finite logit in [-MAX_LOGIT, MAX_LOGIT]. Biases and penalised logits saturate at
MAX_LOGIT instead of overflowing float32 (an inf beside a -inf mask made NaN), a masked
token stays masked whatever is added to it or multiplied into it, and a mask that would
leave a row no token at all yields to the masks applied before it (the structured-output
constraint, applied before the sampler, always wins).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernels.reference import seeded_uniform as reference_seeded_uniform

_NEG_INF = float("-inf")
# A finite logit never leaves [-MAX_LOGIT, MAX_LOGIT]: divided by the smallest sampling
# temperature (1e-5) it stays finite in float32 (max ~3.4e38), and a logit this large
# already wins every softmax, so saturating here changes no normal result.
MAX_LOGIT = 1e30
# A repetition penalty acts within [1 / MAX_REPETITION, MAX_REPETITION]: beyond it a seen
# token's logit saturates at +-MAX_LOGIT (or ~0) anyway; in float32 1e-300 would be 0 and
# 1e300 inf, which made inf and NaN logits.
MAX_REPETITION = 1e30


def apply_allowed_token_ids_(
    logits: torch.Tensor, allowed_token_ids: list[list[int] | None]
) -> None:
    """Set every token outside a row's allowed list to -inf.

    A row whose allowed tokens are all masked already (by a structured-output constraint
    that allows none of them) keeps its logits: the constraint wins, so the row still has
    a token to sample."""
    rows = [r for r, ids in enumerate(allowed_token_ids) if ids is not None]
    if not rows:
        return
    row_index, token_index = _flatten_ids([allowed_token_ids[r] or [] for r in rows], logits)
    blocked = torch.ones(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    blocked[row_index, token_index] = False  # [R, V]
    rows_t = torch.tensor(rows, dtype=torch.long, device=logits.device)
    masked = logits[rows_t].masked_fill(blocked, _NEG_INF)  # [R, V]
    left = (masked > _NEG_INF).any(dim=-1)  # [R]: the row still has a token
    if bool(left.all()):
        logits[rows_t] = masked
    else:
        logits[rows_t[left]] = masked[left]


def apply_logit_bias_(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> None:
    """Add each row's bias to its listed tokens; a bias saturates at +-MAX_LOGIT (a
    masked token stays masked)."""
    rows: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    for row, bias in enumerate(logit_bias):
        if bias:
            rows.extend([row] * len(bias))
            tokens.extend(bias.keys())
            biases.extend(bias.values())
    if not rows:
        return
    index = _index_pair(rows, tokens, logits)
    bias_t = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    logits.index_put_(index, bias_t.clamp_(-MAX_LOGIT, MAX_LOGIT), accumulate=True)


def apply_min_tokens_(logits: torch.Tensor, min_tokens_block: list[set[int] | None]) -> None:
    """Set each row's blocked tokens (EOS, stop tokens) to -inf.

    A row left with no token (its structured-output constraint or allowed_token_ids
    allow only blocked tokens) keeps them: the request may stop before min_tokens
    rather than sample a token it may not."""
    rows: list[int] = []
    tokens: list[int] = []
    for row, block in enumerate(min_tokens_block):
        if block:
            rows.extend([row] * len(block))
            tokens.extend(block)
    if not rows:
        return
    index = _index_pair(rows, tokens, logits)
    saved = logits[index]  # [N]
    logits[index] = _NEG_INF
    blocked_rows = torch.unique(index[0])  # [R], sorted
    empty = ~(logits[blocked_rows] > _NEG_INF).any(dim=-1)  # [R]
    if bool(empty.any()):
        restore = torch.isin(index[0], blocked_rows[empty])  # [N]
        logits[index[0][restore], index[1][restore]] = saved[restore]


def apply_penalties_(
    logits: torch.Tensor,  # [B, V], contiguous
    presence_penalties: torch.Tensor | None,  # [B]
    frequency_penalties: torch.Tensor | None,  # [B]
    repetition_penalties: torch.Tensor | None,  # [B]
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> None:
    """vLLM's penalties, on the rows that use any of them.

    repetition: tokens seen in prompt or output have positive logits divided and
    negative logits multiplied by the penalty; frequency: subtract penalty * count in
    output; presence: subtract penalty once if the token is in the output.
    Works on the touched (row, token) pairs only: no [B, V] temporaries. A masked token
    (-inf) stays masked, and the others stay finite, saturating at +-MAX_LOGIT (a
    repetition penalty of 1e-30 makes a seen token's positive logit huge, not inf).
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    presence = _or_neutral(presence_penalties, num_rows, 0.0, device)
    frequency = _or_neutral(frequency_penalties, num_rows, 0.0, device)
    repetition = _or_neutral(repetition_penalties, num_rows, 1.0, device)
    is_active = ((presence != 0) | (frequency != 0) | (repetition != 1)).tolist()
    uses_prompt = (repetition != 1).tolist()
    rows = [r for r in range(num_rows) if is_active[r]]
    if not rows:
        return
    # Keys row * V + token: one per output token (repeats kept, for counts), and one per
    # prompt token of rows with a repetition penalty.
    out_rows, out_tokens = _flatten_ids([output_token_ids[r] for r in rows], logits)
    row_map = torch.tensor(rows, dtype=torch.long, device=device)  # local -> batch row
    output_keys = row_map[out_rows] * vocab_size + out_tokens  # [N_out]
    prompt_rows = [r for r in rows if uses_prompt[r]]
    p_rows, p_tokens = _flatten_ids([prompt_token_ids[r] for r in prompt_rows], logits)
    p_map = torch.tensor(prompt_rows, dtype=torch.long, device=device)
    prompt_keys = p_map[p_rows] * vocab_size + p_tokens  # [N_prompt]
    keys = torch.unique(torch.cat([output_keys, prompt_keys]))  # [N], sorted
    if keys.numel() == 0:
        return
    counts = torch.zeros(keys.shape[0], dtype=logits.dtype, device=device)  # [N]
    counts.index_add_(
        0, torch.searchsorted(keys, output_keys), torch.ones_like(output_keys, dtype=logits.dtype)
    )
    key_rows = keys // vocab_size  # [N]
    flat = logits.view(-1)  # [B * V]
    values = flat[keys]  # [N]
    masked = values == _NEG_INF  # [N]
    # [N]; every key was seen in prompt or output
    rep = repetition[key_rows].clamp(1.0 / MAX_REPETITION, MAX_REPETITION)
    values = torch.where(values > 0, values / rep, values * rep)
    values = values - frequency[key_rows] * counts - presence[key_rows] * (counts > 0)
    flat[keys] = values.clamp_(-MAX_LOGIT, MAX_LOGIT).masked_fill_(masked, _NEG_INF)


def _or_neutral(
    values: torch.Tensor | None, num_rows: int, neutral: float, device: torch.device
) -> torch.Tensor:
    if values is None:
        return torch.full((num_rows,), neutral, dtype=torch.float32, device=device)
    return values


def _flatten_ids(
    per_row: list[list[int]], logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(local row index, token id) pairs of ragged per-row token lists; ids checked in vocab."""
    rows = [r for r, ids in enumerate(per_row) for _ in ids]
    tokens = [t for ids in per_row for t in ids]
    return _index_pair(rows, tokens, logits)


def _index_pair(
    rows: list[int], tokens: list[int], logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    device = logits.device
    token_t = torch.tensor(tokens, dtype=torch.long, device=device)
    if token_t.numel() and (int(token_t.min()) < 0 or int(token_t.max()) >= logits.shape[1]):
        raise ValueError(f"token id outside the vocabulary [0, {logits.shape[1]})")
    return torch.tensor(rows, dtype=torch.long, device=device), token_t


# ---------------------------------------------------------------------------------------
# Truncation of the random rows' distribution. Each returns logits with dropped tokens
# at -inf; rows whose knob is neutral are left unchanged.


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with prob >= min_p * (max prob of the row).  logits [B, V], min_p [B]."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep exactly the k highest logits of each row (k = V keeps all).  top_k [B] int64."""
    vocab_size = logits.shape[1]
    enabled = top_k < vocab_size  # [B]
    if not bool(enabled.any()):
        return logits
    max_k = int(top_k[enabled].max())
    top_index = logits.topk(max_k, dim=-1).indices  # [B, max_k], best first
    in_k = torch.arange(max_k, device=logits.device)[None, :] < top_k[:, None]  # [B, max_k]
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top_index, in_k)  # [B, V]
    keep |= ~enabled[:, None]
    return logits.masked_fill(~keep, _NEG_INF)


_TOP_P_CANDIDATES = 256  # top-p looks at this many best tokens before sorting a whole row


def apply_top_k_top_p(
    logits: torch.Tensor,  # [B, V]
    top_k: torch.Tensor | None,  # [B] int64, V = disabled
    top_p: torch.Tensor | None,  # [B] float32, 1 = disabled
    num_candidates: int = _TOP_P_CANDIDATES,
) -> torch.Tensor:
    """Top-k, then top-p on the renormalised top-k distribution.

    Top-p keeps the smallest set of most likely tokens whose mass reaches p. It first
    looks only at the ``num_candidates`` best tokens of each row (a partial top-k, far
    cheaper than a sort); only rows whose candidates hold less than p of the mass
    fall back to sorting their whole row.
    """
    if top_p is None:
        return logits if top_k is None else apply_top_k(logits, top_k)
    num_rows, vocab_size = logits.shape
    device = logits.device
    if top_k is None:
        top_k = torch.full((num_rows,), vocab_size, dtype=torch.long, device=device)
    k_enabled = top_k < vocab_size  # [B]
    num_candidates = max(num_candidates, int(top_k[k_enabled].max()) if k_enabled.any() else 1)
    if 2 * num_candidates >= vocab_size:
        return _top_k_top_p_sorted(logits, top_k, top_p)

    values, index = logits.topk(num_candidates, dim=-1)  # [B, C], best first
    position = torch.arange(num_candidates, device=device)[None, :]  # [1, C]
    values = values.masked_fill(position >= top_k[:, None], _NEG_INF)
    # Log of each row's normaliser: its k kept candidates, or the whole row without top-k.
    log_total = torch.where(k_enabled, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - log_total[:, None]).exp()  # [B, C]: probabilities after top-k
    mass_before = probs.cumsum(dim=-1) - probs  # [B, C]: mass of the more likely tokens
    p = top_p[:, None]  # [B, 1]
    values = values.masked_fill((mass_before >= p) & (p < 1.0) & (position > 0), _NEG_INF)

    keep_all = ~k_enabled & (top_p >= 1.0)  # [B]: neither knob set on this row
    # Without top-k, candidates holding less than p leave the cut beyond them.
    too_few = ~k_enabled & ~keep_all & (mass_before[:, -1] + probs[:, -1] < top_p)  # [B]
    keep = torch.zeros_like(logits, dtype=torch.bool)  # [B, V]
    keep.scatter_(1, index, torch.isfinite(values))
    keep |= keep_all[:, None]
    out = logits.masked_fill(~keep, _NEG_INF)
    if bool(too_few.any()):
        rows = too_few.nonzero().flatten()  # [R]
        out[rows] = _top_k_top_p_sorted(logits[rows], top_k[rows], top_p[rows])
    return out


def _top_k_top_p_sorted(
    logits: torch.Tensor,  # [B, V]
    top_k: torch.Tensor,  # [B] int64, V = disabled
    top_p: torch.Tensor,  # [B] float32, 1 = disabled
) -> torch.Tensor:
    """Top-k then top-p by sorting each whole row."""
    vocab_size = logits.shape[1]
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)  # [B, V]
    position = torch.arange(vocab_size, device=logits.device)[None, :]  # [1, V]
    sorted_logits = sorted_logits.masked_fill(position >= top_k[:, None], _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)  # [B, V], descending
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V]: mass of the more likely tokens
    p = top_p[:, None]  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(
        (mass_before >= p) & (p < 1.0) & (position > 0), _NEG_INF
    )
    return torch.empty_like(logits).scatter_(1, sorted_index, sorted_logits)


SeededUniform = Callable[[Sequence[int], Sequence[int], int], torch.Tensor]


def exponential_race(
    probs: torch.Tensor,  # [B, V], each row proportional to its probabilities
    seeds: dict[int, tuple[int, int]],  # row -> (seed, output position)
    seeded_uniform: SeededUniform = reference_seeded_uniform,
) -> torch.Tensor:  # [B] int64
    """Sample one token per row: argmax(probs / q) with q ~ Exp(1) i.i.d.

    q = -log(u) with u ~ U(0, 1). Seeded rows take their [V] u from
    ``seeded_uniform`` (a function of seed and position only); the rest from the
    default generator of probs' device.
    """
    num_rows, vocab_size = probs.shape
    u = torch.empty_like(probs)  # [B, V]
    if len(seeds) < num_rows:
        u.uniform_()
    if seeds:
        rows = list(seeds)
        draws = seeded_uniform([seeds[r][0] for r in rows], [seeds[r][1] for r in rows], vocab_size)
        u[rows] = draws.to(device=probs.device, dtype=probs.dtype)
    # u = 0 would make q infinite and could zero a whole row: keep q finite and > 0.
    q = u.clamp_(min=torch.finfo(u.dtype).tiny).log_().neg_()  # [B, V] ~ Exp(1)
    return torch.div(probs, q, out=q).argmax(dim=-1)
