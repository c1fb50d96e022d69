"""Reading and writing whole KV-cache blocks as bytes (the runner's caches, the
wire's ``PullBlocksResponse.data``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine_service.kv_transfer.base import CacheLayout

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KvBlockIO:
    """Copies blocks of one layer's K or V cache out (to bytes) and in (from tensors)."""

    def __init__(
        self, caches: Callable[[], Sequence[tuple[torch.Tensor, torch.Tensor]]], layout: CacheLayout
    ) -> None:
        self.caches = caches
        self.layout = layout
        self.dtype = DTYPES[layout.dtype]
        self.block_shape = (layout.block_size, layout.num_kv_heads, layout.head_dim)
        element = torch.tensor([], dtype=self.dtype).element_size()
        # Bytes of one block of one layer's K (or V).
        self.block_bytes = layout.block_size * layout.num_kv_heads * layout.head_dim * element

    def _cache(self, layer: int, kind: int) -> torch.Tensor:
        return self.caches()[layer][kind]

    def read(self, layer: int, kind: int, block_ids: Sequence[int]) -> bytes:
        """``kind``: 0 K, 1 V. The blocks' elements, block after block, little-endian."""
        cache = self._cache(layer, kind)
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=cache.device)
        blocks = cache.index_select(0, index).to("cpu").contiguous()
        return blocks.reshape(-1).view(torch.uint8).numpy().tobytes()

    def decode(self, data: bytes, num_blocks: int) -> torch.Tensor:
        """Bytes of ``num_blocks`` blocks as a CPU tensor [num_blocks, *block_shape]."""
        if len(data) != num_blocks * self.block_bytes:
            raise ValueError(f"{len(data)} bytes for {num_blocks} blocks of {self.block_bytes}")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(self.dtype).reshape(num_blocks, *self.block_shape)

    def write(self, layer: int, kind: int, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Put ``blocks`` ([len(block_ids), *block_shape]) into the cache (step thread)."""
        cache = self._cache(layer, kind)
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=cache.device)
        cache.index_copy_(0, index, blocks.to(cache.device, cache.dtype))
