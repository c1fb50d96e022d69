"""Verification of draft tokens: the target's own sample at each drafted position.

A request with drafts ``d_0 .. d_{k-1}`` runs ``k + 1`` rows this step: row ``j`` holds
the logits after the known tokens plus ``d_0 .. d_{j-1}``. The runner samples every row
with the ordinary sampler, each row with the state it would have if the drafts before it
were the output (penalties see them, min_tokens and a seeded row's output position count
them): ``t_j``. Then

    a = the first j with t_j != d_j (or k),   accepted: d_0 .. d_{a-1},   then t_a.

Why this is exact. The drafts here come from proposers without probabilities (n-gram,
suffix decoding: a point mass on ``d_j``), for which the rejection rule of speculative
sampling (accept ``d`` with probability ``min(1, p(d) / q(d)) = p(d)``, else draw from
``max(p - q, 0)`` normalized, i.e. ``p`` without ``d``) gives token ``x`` at a position
with probability ``p(d)`` for ``x = d`` and ``(1 - p(d)) p(x) / (1 - p(d)) = p(x)``
otherwise: ``p`` itself. Drawing ``t_j ~ p`` and keeping it is the same law, with the
draft accepted exactly when ``t_j = d_j``. So each output position is drawn from the
target's distribution given the tokens before it, as without speculation; and with the
sampler's draws keyed by (seed, output position) a seeded request gets the very tokens it
gets without speculation, and greedy rows (argmax) too.
"""

from __future__ import annotations

from collections.abc import Sequence


def verify(drafts: Sequence[int], sampled: Sequence[int]) -> tuple[list[int], int]:
    """``sampled[j]`` (``len(drafts) + 1`` tokens): the target's token at draft position j.
    Returns the accepted drafts (a prefix of ``drafts``) and the token that follows them."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled tokens, got {len(sampled)}")
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return list(drafts[:a]), int(sampled[a])
