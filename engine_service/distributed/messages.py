"""What rank 0 broadcasts to the workers: one message per step or control action.

A step's message is the flattened batch the forward reads (token ids, positions, KV
slots and block tables) and the rows whose logits are gathered: a few small arrays,
pickled once, whatever the number of layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_service.attention import AttentionMetadata


@dataclass
class StepDescription:
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    max_query_len: int
    max_seq_len: int
    logit_rows: np.ndarray  # [num_logit_rows] int64: rows of the hidden state the LM head reads
    # > 0: run on a throwaway cache of this many blocks (rank 0's memory profiling),
    # not on the rank's KV cache.
    scratch_blocks: int = 0

    @classmethod
    def from_tensors(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        logit_rows: list[int],
        scratch_blocks: int = 0,
    ) -> StepDescription:
        def host(t: torch.Tensor) -> np.ndarray:
            return t.detach().cpu().numpy()

        return cls(
            host(input_ids), host(positions), host(attn.slot_mapping), host(attn.block_tables),
            host(attn.query_start_loc), host(attn.seq_lens), attn.max_query_len, attn.max_seq_len,
            np.asarray(logit_rows, dtype=np.int64), scratch_blocks,
        )

    def to_tensors(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, attention metadata, logit rows) on ``device``."""

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        attn = AttentionMetadata(
            slot_mapping=dev(self.slot_mapping),
            block_tables=dev(self.block_tables),
            query_start_loc=dev(self.query_start_loc),
            seq_lens=dev(self.seq_lens),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
        )
        return dev(self.input_ids), dev(self.positions), attn, dev(self.logit_rows)


@dataclass
class AllocateKVCache:
    """Allocate (``num_blocks`` > 0) or free (0) the rank's KV cache."""

    num_blocks: int


@dataclass
class Sleep:
    """Sleep mode: drop the KV cache; level 2 also drops the weights (reloaded on wake),
    level 1 on CUDA moves them to host memory."""

    level: int


@dataclass
class WakeUp:
    """Undo ``Sleep``: the weights back; the KV cache comes with ``AllocateKVCache``."""


@dataclass
class Shutdown:
    """Leave the loop and the group, exit 0."""


Message = StepDescription | AllocateKVCache | Sleep | WakeUp | Shutdown
