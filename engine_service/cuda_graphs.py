"""Decode steps replayed from captured CUDA graphs.

A decode step of a small model on a GPU is bound by the host, not the GPU: bench-135m on
an H200 took ~15 ms a step at batch 1 and at batch 64 while its kernels kept the GPU
busy ~0.9 ms (a torch profile: ~270 Triton launches and ~120 cuBLAS calls a step, 6-25
us of host time each, plus the Python between them). A graph captured once per padded
batch size replays the whole forward in one launch.

Each graph reads fixed input buffers and writes a fixed output buffer:
  input_ids, positions, slot_mapping [max_batch]; seq_lens [max_batch];
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
        self.sizes = capture_sizes(max_batch)
        self._capture = capture
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
            self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
            self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
            self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
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

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor | None:
        """``[B, hidden_size]`` hidden states of a decode batch (one new token per
        sequence) from its graph, or None when no graph fits (run it eagerly)."""
        batch = input_ids.shape[0]
        width = attn.block_tables.shape[1]
        if attn.max_query_len != 1 or attn.num_seqs != batch or width > self.max_blocks_per_seq:
            return None
        size = self.padded_size(batch)
        if size is None:
            return None
        replay, out = self._graphs[size]
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(attn.slot_mapping)
        self.seq_lens[:batch].copy_(attn.seq_lens)
        self.block_tables[:batch, :width].copy_(attn.block_tables)
        if size > batch:  # padding rows: nothing written, one token of block 0 read
            self.input_ids[batch:size].zero_()
            self.positions[batch:size].zero_()
            self.slot_mapping[batch:size].fill_(-1)
            self.seq_lens[batch:size].fill_(1)
            self.block_tables[batch:size, 0].zero_()
        replay()
        return out[:batch]
