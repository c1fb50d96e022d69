"""Decode steps replayed from captured CUDA graphs.

A decode step of a small model on a GPU is bound by the host, not the GPU: on an H200 an
eager bench-135m step took many times the time its kernels kept the GPU busy, at batch 1
and at batch 64 alike (a torch profile: hundreds of Triton launches and cuBLAS calls a
step, each with its host time, plus the Python between them; benchmarks/NOTES.md). A
graph captured once per padded batch size replays the whole forward in one launch.

Each graph reads fixed input buffers and writes a fixed output buffer:
  input_ids, positions, slot_mapping [max_batch] int64; seq_lens [max_batch] int32;
  block_tables [max_batch, max_blocks_per_seq]; query_start_loc = 0..max_batch;
  out: the [size, hidden_size] hidden states the captured forward returned.
A batch of B decode tokens runs the graph of the smallest captured size P >= B: rows
B..P are padding (token 0 at position 0, KV slot -1 so nothing is written, a context of
one token read from block 0), and their outputs are dropped. Graphs capture the model's
weights and the KV cache tensors by address: ``release()`` drops them before either
moves (sleep mode), ``capture()`` makes them again.

The capture itself is a parameter (``GraphCapture``) so the buffer and padding logic
runs on CPU in the tests, replayed by calling the forward again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine_service.attention import AttentionMetadata

# capture(forward) -> replay: runs ``forward`` (which reads the fixed buffers and returns
# the output tensor) once under capture and returns (replay, output); each replay()
# refills that output tensor from the buffers' current contents.
GraphCapture = Callable[[Callable[[], torch.Tensor], Any], tuple[Callable[[], None], torch.Tensor]]


def cuda_capture(forward: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
    """``torch.cuda.CUDAGraph`` capture after one eager run on a side stream (lazy
    initialisation such as cuBLAS workspaces must not happen under capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph.replay, out


def eager_capture(forward: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
    """The same contract without a GPU: replay runs ``forward`` again into the output."""
    out = forward()

    def replay() -> None:
        out.copy_(forward())

    return replay, out


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes with a graph: 1, 2, 4, 8, then every multiple of 16 up to
    ``max_batch`` (and ``max_batch`` itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """One captured decode forward per padded batch size; see the module docstring."""

    def __init__(
        self,
        max_batch: int,
        max_blocks_per_seq: int,
        device: torch.device,
        capture: GraphCapture = cuda_capture,
    ) -> None:
        if max_batch < 1 or max_blocks_per_seq < 1:
            raise ValueError(f"max_batch and max_blocks_per_seq must be >= 1, got {max_batch}, {max_blocks_per_seq}")
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_batch = max_batch
        self.sizes = capture_sizes(max_batch)
        self._capture = capture
        m, w = max_batch, max_blocks_per_seq
        # The inputs live in two packed device buffers, so that a staged step (``stage``)
        # reaches them in two host-to-device copies:
        #   _ids [3M] int64: input_ids [0, M) | positions [M, 2M) | slot_mapping [2M, 3M)
        #   _meta [M + M*W] int32: seq_lens [0, M) | block_tables [M, W] from M on
        # with a pinned host mirror of each (written by ``stage``, then copied).
        pinned = device.type == "cuda"
        with torch.inference_mode():
            self._ids = torch.zeros(3 * m, dtype=torch.int64, device=device)
            self._meta = torch.zeros(m + m * w, dtype=torch.int32, device=device)
            self._ids_host = torch.zeros(3 * m, dtype=torch.int64, pin_memory=pinned)
            self._meta_host = torch.zeros(m + m * w, dtype=torch.int32, pin_memory=pinned)
            self.input_ids = self._ids[:m]
            self.positions = self._ids[m : 2 * m]
            self.slot_mapping = self._ids[2 * m :]
            self.seq_lens = self._meta[:m]
            self.block_tables = self._meta[m:].view(m, w)
            self.slot_mapping.fill_(-1)
            self.seq_lens.fill_(1)
            self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._ids_np = self._ids_host.numpy()
        self._meta_np = self._meta_host.numpy()
        # Recorded after a stage's copies: the host mirrors are not rewritten before the
        # copies out of them are done (None on CPU, where the copies are synchronous).
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}  # size -> (replay, out)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def capture(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Capture ``model``'s forward over ``kv_caches`` at every size (largest first, so
        the smaller ones reuse its memory pool)."""
        self.release()
        pool = torch.cuda.graph_pool_handle() if self._capture is cuda_capture else None
        with torch.inference_mode():
            for size in sorted(self.sizes, reverse=True):
                attn = AttentionMetadata(
                    slot_mapping=self.slot_mapping[:size],
                    block_tables=self.block_tables[:size],
                    query_start_loc=self.query_start_loc[: size + 1],
                    seq_lens=self.seq_lens[:size],
                    max_query_len=1,
                    max_seq_len=self.max_blocks_per_seq,  # not read by the kernels a graph holds
                )

                def forward(size: int = size, attn: AttentionMetadata = attn) -> torch.Tensor:
                    attn.workspace.clear()
                    return model(self.input_ids[:size], self.positions[:size], kv_caches, attn)

                self._graphs[size] = self._capture(forward, pool)

    def release(self) -> None:
        self._graphs.clear()

    def padded_size(self, batch: int) -> int | None:
        """The captured size a batch of ``batch`` decode tokens runs at (None: none fits)."""
        if not self._graphs:
            return None
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    def stage(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_table: list[int],  # [B * width], rows zero-padded to ``width``
        width: int,
    ) -> int | None:
        """Write a decode batch of B sequences (one new token each) into the graph's
        buffers, padding rows included, in two host-to-device copies; returns the padded
        size to ``replay``, or None when no graph fits (nothing written: run it eagerly).
        The batch's inputs are then ``input_ids[:B]`` etc. (``batch_views``)."""
        batch = len(input_ids)
        size = self.padded_size(batch)
        if size is None or width > self.max_blocks_per_seq:
            return None
        if self._copied is not None:
            self._copied.synchronize()
        m, w = self.max_batch, self.max_blocks_per_seq
        ids, meta = self._ids_np, self._meta_np
        # padding rows: token 0 at position 0, KV slot -1 (nothing written), a context
        # of one token read from block 0
        ids[:batch] = input_ids
        ids[batch:size] = 0
        ids[m : m + batch] = positions
        ids[m + batch : m + size] = 0
        ids[2 * m : 2 * m + batch] = slot_mapping
        ids[2 * m + batch : 2 * m + size] = -1
        meta[:batch] = seq_lens
        meta[batch:size] = 1
        tables = meta[m : m + size * w].reshape(size, w)
        tables[:batch, :width] = np.asarray(block_table, dtype=np.int32).reshape(batch, width)
        tables[batch:size, 0] = 0
        cuda = self._ids.device.type == "cuda"
        self._ids.copy_(self._ids_host, non_blocking=cuda)
        self._meta[: m + size * w].copy_(self._meta_host[: m + size * w], non_blocking=cuda)
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return size

    def batch_views(self, batch: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(input_ids, positions, attn)`` of the batch ``stage`` wrote (B rows)."""
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            max_query_len=1,
            max_seq_len=max_seq_len,
        )
        return self.input_ids[:batch], self.positions[:batch], attn

    def replay(self, size: int, batch: int) -> torch.Tensor:
        """``[batch, hidden_size]`` hidden states of the batch ``stage`` wrote (padded to ``size``)."""
        replay, out = self._graphs[size]
        replay()
        return out[:batch]
