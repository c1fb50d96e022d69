"""Prompt-lookup (n-gram) draft proposer.

The draft for a request is what followed an earlier occurrence of the sequence's tail: the
longest tail n-gram (``max_n`` down to ``min_n``) that occurs earlier in the sequence wins, and
among that n-gram's occurrences the latest one followed by a whole draft's worth of tokens
(else the earliest). vLLM takes the earliest; the latest follows the text being written
where it repeats itself with changes (a loop, a list, an edited copy): on SmolLM2-135M
repeating a list, the earliest match alternated 3 and 1 accepted tokens a step.

Cost per call, for a sequence of L tokens: one conversion to an int64 array when a ``list`` is
passed (none for a 1-D integer ``np.ndarray``), one vectorized comparison over L tokens, then at
most ``max_n - 1`` filtering passes over the positions that still match (usually few). No
Python-level loop over the sequence. Measured (Intel Xeon Processor, 2 cores under load,
min_n=1, max_n=4, k=5): 2-5 us for a 2,000-4,000-token ``np.ndarray``; a ``list`` adds the
conversion, about 13 us per 1,000 tokens (28-32 us at 2,000 tokens, 110 us at 8,000).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Stateless n-gram proposer: ``propose`` depends only on its arguments.

    Invariants: ``1 <= min_n <= max_n`` and ``num_speculative_tokens >= 1``.
    """

    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        if min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n must be >= min_n, got max_n={max_n} < min_n={min_n}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.min_n = min_n
        self.max_n = max_n
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_tokens: int) -> list[int]:
        """Draft tokens for one request.

        ``token_ids``: the request's whole sequence, shape [L] (prompt + output so far; the
        last element is the newest token). ``max_tokens``: the most draft tokens the caller
        can use (e.g. what is left of the request's max_tokens budget).

        Returns ``token_ids[e + 1 : e + 1 + k]`` with ``k = min(num_speculative_tokens,
        max_tokens)``, where ``token_ids[e - n + 1 : e + 1] == token_ids[L - n : L]``,
        ``e <= L - 2`` (the occurrence ends before the last position), n is the largest value in
        ``[min_n, max_n]`` for which such an e exists, and e is the largest such end with
        ``e + k <= L - 1`` (k tokens follow it), else the smallest. The draft has between 1
        and k tokens (fewer than k when the sequence ends first), or is ``[]`` when no n-gram
        matches or ``max_tokens <= 0``.
        """
        k = min(self.num_speculative_tokens, max_tokens)
        if k <= 0:
            return []
        if isinstance(token_ids, np.ndarray):
            arr = token_ids
        else:
            arr = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
        length = arr.shape[0]
        if length < self.min_n + 1:
            return []
        # ends: the end positions e <= L - 2 whose match with the tail has length >= matched.
        ends = np.flatnonzero(arr[: length - 1] == arr[length - 1])
        if ends.size == 0:
            return []
        matched = 1
        while matched < self.max_n:
            j = matched  # compare token e - j with token L - 1 - j
            candidates = ends[ends >= j] if ends[0] < j else ends
            if candidates.size == 0:
                break
            candidates = candidates[arr[candidates - j] == arr[length - 1 - j]]
            if candidates.size == 0:
                break
            ends = candidates
            matched += 1
        if matched < self.min_n:
            return []
        whole = ends[ends + k <= length - 1]
        start = int(whole[-1] if whole.size else ends[0]) + 1
        return arr[start : start + k].tolist()
