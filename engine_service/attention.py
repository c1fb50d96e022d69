"""The per-step description of a flattened batch that attention layers read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens lie in the flattened batch and in the KV cache.

    The batch holds ``num_tokens`` new tokens from ``num_seqs`` sequences; sequence ``s``
    owns tokens ``query_start_loc[s]:query_start_loc[s + 1]`` (a prefill chunk or one
    decode token) and its context after this step is ``seq_lens[s]`` tokens.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: KV-cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int
    max_seq_len: int
    # The sliding-window layers' own slots and tables (kv_cache/sliding.py), when they
    # keep their KV apart; None: every layer reads the two above.
    window_slot_mapping: torch.Tensor | None = None  # [num_tokens] int64
    window_block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks_per_seq] int32
    # Per-step scratch the attention backend may fill on the first layer and reuse in
    # the others (plans that depend on the batch only, not on the layer).
    workspace: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
