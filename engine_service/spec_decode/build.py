"""Speculative decoding's scheduler feature as start-up builds it: the ``Speculator``, with
a draft model its ``DraftModel`` over a KV cache of its own, and the costs that size each
request's drafts, from the config or measured here on the engine's model (step_costs.py)."""

from __future__ import annotations

import functools
import logging

import torch

from engine_service.config import EngineConfig
from engine_service.kv_cache.memory import allocate_kv_caches
from engine_service.spec_decode.draft_model import DraftModel, load_draft_model
from engine_service.spec_decode.speculator import Speculator
from engine_service.spec_decode.step_costs import decode_seconds, token_cost
from kernels.dispatch import KernelOps
from tandem.protocol.model_config import ModelConfig

logger = logging.getLogger(__name__)


def build_speculator(
    config: EngineConfig, ops: KernelOps, model: torch.nn.Module, model_config: ModelConfig, num_blocks: int,
    draft: tuple[torch.nn.Module, ModelConfig, int] | None,
) -> Speculator:
    """Speculative decoding's scheduler feature; with a draft model (``load_draft_model``'s),
    its KV cache of ``num_blocks`` blocks. The costs of a draft row and a draft forward are
    the config's, or measured here (step_costs.py)."""
    spec = config.speculative
    assert spec is not None
    device, bs, dtype = config.torch_device, config.block_size, config.torch_dtype
    measured = []
    one_row = functools.cache(lambda: decode_seconds(model, model_config, bs, dtype, device))  # timed once
    cost = spec.draft_token_cost
    if not cost:
        cost = token_cost(model, model_config, bs, dtype, device, min(spec.num_speculative_tokens, 8), one_row())
        measured.append("row")
    if draft is None:
        logger.info("speculative decoding (%s): a draft row costs %.3f of a decode step%s", spec.method, cost,
                    " (measured)" if measured else "")
        return Speculator(spec, cost)
    draft_model, draft_config, draft_len = draft
    allocate = functools.partial(allocate_kv_caches, draft_config, num_blocks, bs, dtype, device)
    proposer = DraftModel(
        draft_model, allocate(), num_blocks, bs, draft_len, config.max_num_batched_tokens, device,
        reload=lambda: load_draft_model(config, ops, model_config, draft_len)[0],
        allocate=allocate,
    )
    forward_cost = spec.draft_model_cost
    if not forward_cost:
        forward_cost = decode_seconds(draft_model, draft_config, bs, dtype, device) / one_row()
        measured.append("draft forward")
    logger.info(
        "speculative decoding with draft model %s (%d KV blocks): a draft row costs %.3f of a decode step, "
        "a draft forward %.3f%s", spec.model, num_blocks, cost, forward_cost,
        f" (measured: {', '.join(measured)})" if measured else "",
    )
    return Speculator(spec, cost, proposer, forward_cost)
