"""The KV cache's memory: bytes per block, the per-layer K/V tensors, and (CUDA) how
many blocks fit beside the model after a peak forward."""

from __future__ import annotations

import logging

import torch

from engine_service.config import ConfigError, EngineConfig
from engine_service.kv_cache.sliding import SlidingWindowBlocks
from tandem.protocol.model_config import ModelConfig

logger = logging.getLogger(__name__)


def kv_cache_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


def window_split(
    model_config: ModelConfig, num_blocks: int, block_size: int, max_num_seqs: int, max_chunk: int, max_model_len: int
) -> tuple[int, int]:
    """``(full-layer blocks, sliding-layer blocks)`` from a budget of ``num_blocks`` blocks
    of every layer, when the sliding-window layers keep their own blocks (sliding.py).

    The sliding layers get what ``max_num_seqs`` requests can hold at once (each at most
    the window plus one step's chunk), at most the budget; the memory they leave goes
    to the full layers. Without full layers their table is bookkeeping only (no tensors),
    sized so that it never limits a request."""
    assert model_config.sliding_window is not None
    layers = model_config.num_layers
    sliding = sum(model_config.is_sliding(i) for i in range(layers))
    full = layers - sliding
    if full == 0:
        return max(num_blocks, max_num_seqs * -(-max_model_len // block_size)), num_blocks
    per_request = SlidingWindowBlocks.blocks_needed_per_request(model_config.sliding_window, block_size, max_chunk)
    window_blocks = min(num_blocks, max_num_seqs * per_request)
    return num_blocks + (num_blocks - window_blocks) * sliding // full, window_blocks


def allocate_kv_caches(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    window_blocks: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: K and V, each ``[blocks, block_size, num_kv_heads, head_dim]``, where
    blocks is ``window_blocks`` for a sliding-window layer when given, else ``num_blocks``."""

    def zeros(blocks: int) -> torch.Tensor:
        shape = (blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
        # Zeros, not empty: masked-out slots are still multiplied by 0 in attention. On CPU,
        # huge pages: once the block pool is fragmented a decode step jumps between blocks
        # anywhere in the cache (a TLB miss every 4 KiB page otherwise).
        if device.type == "cpu":
            from kernels.cpu_ops import zeros_on_huge_pages

            return zeros_on_huge_pages(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    caches = []
    for layer in range(model_config.num_layers):
        blocks = window_blocks if window_blocks is not None and model_config.is_sliding(layer) else num_blocks
        caches.append((zeros(blocks), zeros(blocks)))
    return caches


def profile_num_gpu_blocks(
    config: EngineConfig, model: torch.nn.Module, block_bytes: int, run_dummy: object
) -> int:
    """On CUDA: blocks that fit in gpu_memory_utilization of the device after a peak forward."""
    device = config.torch_device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_dummy()  # type: ignore[operator]
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    available = int(total * config.gpu_memory_utilization) - peak
    if available <= 0:
        raise ConfigError(
            f"no memory left for the KV cache: the model's peak use is {peak / 2**30:.2f} GiB of "
            f"{total * config.gpu_memory_utilization / 2**30:.2f} GiB allowed by "
            f"gpu_memory_utilization={config.gpu_memory_utilization}"
        )
    logger.info("CUDA memory: peak %.2f GiB, %.2f GiB for the KV cache", peak / 2**30, available / 2**30)
    return available // block_bytes
