"""A step's input lists onto the device in two copies, from persistent (pinned) buffers.

An eager step (prefill chunks, mixed batches: decode-only batches go to their CUDA graph's
own buffers, ``DecodeGraphs.stage``) needs six index tensors on the device. Made one by
one, each is a pinned allocation and a copy: on an H200 a visible share of a host-bound
engine's CPU (py-spy, benchmarks/NOTES.md). Here they are written into two persistent
host buffers and copied in one piece each:

  int64 [3 * T16]: input_ids [0, T) | positions [T16, T16 + T) | slot_mapping [2 T16, ...)
  int32: block_tables [S, W] from 0 | query_start_loc [S + 1] | seq_lens [S]

(T tokens, S sequences, W blocks per sequence; each region starts at a multiple of 16
elements, so every tensor is 64-byte aligned and Triton's launch sees the same pointer
divisibility as for a fresh allocation). Two sets of buffers alternate: a set's host side
is rewritten only after the event recorded behind its last copy has passed, so async
scheduling can stage step N+1 while step N's copies are queued. The device side needs no
wait: the next copy into it runs on the stream after the kernels that read it.
"""

from __future__ import annotations

import numpy as np
import torch


def _round16(n: int) -> int:
    return -(-n // 16) * 16


class _BufferSet:
    def __init__(self, num_i64: int, num_i32: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host_i64 = torch.zeros(num_i64, dtype=torch.int64, pin_memory=pinned)
        self.host_i32 = torch.zeros(num_i32, dtype=torch.int32, pin_memory=pinned)
        self.np_i64 = self.host_i64.numpy()
        self.np_i32 = self.host_i32.numpy()
        self.dev_i64 = torch.zeros(num_i64, dtype=torch.int64, device=device)
        self.dev_i32 = torch.zeros(num_i32, dtype=torch.int32, device=device)
        self.copied: torch.cuda.Event | None = None


class InputStaging:
    """Capacity: ``max_tokens`` new tokens, ``max_seqs`` sequences of at most
    ``max_blocks`` blocks; ``put`` returns None for a step beyond it (copy it otherwise)."""

    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, max_blocks: int) -> None:
        self.device = device
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        num_i64 = 3 * _round16(max_tokens)
        num_i32 = _round16(max_seqs * max_blocks) + _round16(max_seqs + 1) + _round16(max_seqs)
        self._sets = [_BufferSet(num_i64, num_i32, device) for _ in range(2)]
        self._next = 0

    def put(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        block_table: list[int],  # [S * width], rows zero-padded to ``width``
        width: int,
        query_start_loc: list[int],  # [S + 1]
        seq_lens: list[int],  # [S]
    ) -> tuple[torch.Tensor, ...] | None:
        """``(input_ids, positions, slot_mapping, block_tables [S, width], query_start_loc,
        seq_lens)`` on the device, or None when the step does not fit."""
        n, s = len(input_ids), len(seq_lens)
        if n > self.max_tokens or s > self.max_seqs or width > self.max_blocks:
            return None
        buf = self._sets[self._next]
        self._next ^= 1
        if buf.copied is not None:
            buf.copied.synchronize()  # its previous copies have left the host buffers
        t16 = _round16(n)
        ids = buf.np_i64
        ids[:n] = input_ids
        ids[t16 : t16 + n] = positions
        ids[2 * t16 : 2 * t16 + n] = slot_mapping
        bt_end = s * width
        qsl_at = _round16(bt_end)
        sl_at = qsl_at + _round16(s + 1)
        meta = buf.np_i32
        meta[:bt_end] = np.asarray(block_table, dtype=np.int32)
        meta[qsl_at : qsl_at + s + 1] = query_start_loc
        meta[sl_at : sl_at + s] = seq_lens
        cuda = self.device.type == "cuda"
        buf.dev_i64[: 3 * t16].copy_(buf.host_i64[: 3 * t16], non_blocking=cuda)
        buf.dev_i32[: sl_at + s].copy_(buf.host_i32[: sl_at + s], non_blocking=cuda)
        if cuda:
            buf.copied = torch.cuda.Event()
            buf.copied.record()
        d64, d32 = buf.dev_i64, buf.dev_i32
        return (
            d64[:n],
            d64[t16 : t16 + n],
            d64[2 * t16 : 2 * t16 + n],
            d32[:bt_end].view(s, width),
            d32[qsl_at : qsl_at + s + 1],
            d32[sl_at : sl_at + s],
        )
