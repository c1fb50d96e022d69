"""What drafting costs, measured at start-up on the engine's own model and device.

Two shares of a batch-1 decode step, the inputs of each request's draft length
(speculator.py): a verified draft row's (``token_cost``: T(1 + k rows) - T(1) over k T(1))
and, with a draft model, one draft forward's (``draft_cost``: the draft's one-row decode
over the target's). Rows are timed as verification runs them, each its own one-token
sequence; each figure is the median of a few forwards after two warm-ups.
"""

from __future__ import annotations

import statistics
import time

import torch

from engine_service.kv_cache.memory import allocate_kv_caches
from engine_service.spec_decode.draft_model import DraftModel, _Seq
from tandem.protocol.model_config import ModelConfig


def decode_seconds(
    model: torch.nn.Module, model_config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
    rows: int = 1, repeats: int = 5,
) -> float:
    """The median time of ``model``'s decode of ``rows`` one-token sequences and their
    argmax, on a cache of its own (a block per row)."""
    caches = allocate_kv_caches(model_config, rows, block_size, dtype, device)
    probe = DraftModel(model, caches, rows, block_size, block_size, rows, device)
    feed = [(_Seq(blocks=[i]), [3 + i], 0) for i in range(rows)]
    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            start = time.perf_counter()
            probe._forward(feed)
            if i >= 2:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def token_cost(model: torch.nn.Module, model_config: ModelConfig, block_size: int, dtype: torch.dtype,
               device: torch.device, k: int, one: float) -> float:
    """A verified draft row's share of a batch-1 decode step, from steps of 1 + k rows and
    of one row (``one``: its ``decode_seconds``)."""
    more = decode_seconds(model, model_config, block_size, dtype, device, rows=1 + k)
    return max(0.0, (more - one) / (k * one))
