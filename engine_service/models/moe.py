"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

A router scores the ``E`` experts per token; the top ``k`` (softmax probabilities, renormalized
to sum 1 where the family does) each run a SwiGLU MLP of ``moe.intermediate_size`` on the
token, and their outputs are summed with those weights (``kernels.moe``: the native grouped
op on CPU over packed experts, the fused Triton kernel on CUDA, the reference otherwise).
Qwen2-MoE adds a shared expert every token takes, gated by ``sigmoid(x @ shared_expert_gate)``.

Expert weights are stacked, so a checkpoint's per-expert tensors land in row ranges
(checkpoint_map.py): ``w13`` is ``[E * 2I, H]``, expert ``e``'s gate rows then up rows at
``e * 2I``; ``w2`` is ``[E * H, I]``, expert ``e``'s down rows at ``e * H``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine_service.models.layers import MLP, FusedLinear, empty_param
from kernels.dispatch import KernelOps
from kernels.moe import ExpertWeights, fused_moe, route
from tandem.protocol.model_config import ModelConfig


class MoEBlock(nn.Module):
    """Router, ``E`` stacked SwiGLU experts, and the optional gated shared expert."""

    def __init__(self, config: ModelConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("MoEBlock needs a config with moe settings")
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        # Qwen2/3-MoE and OLMoE round the routing weights to the model's dtype; Mixtral not.
        self.weights_dtype = None if moe.naming == "mixtral" else dtype
        h, inter = config.hidden_size, moe.intermediate_size
        self.router = FusedLinear(h, moe.num_experts, False, dtype, device)  # scores [T, E]
        # Stacked experts as the loader fills them; pack() moves them into ``packed``.
        self.w13: nn.Parameter | None = empty_param(moe.num_experts * 2 * inter, h, dtype=dtype, device=device)
        self.w2: nn.Parameter | None = empty_param(moe.num_experts * h, inter, dtype=dtype, device=device)
        self.packed: ExpertWeights | None = None
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(config, ops, dtype, device, moe.shared_intermediate_size)
            self.shared_expert_gate = FusedLinear(h, 1, False, dtype, device)
        # Tensor parallelism: each rank's experts hold a slice of the intermediate columns,
        # so the output is a partial sum, all-reduced once (shared expert included).
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def experts(self) -> ExpertWeights:
        """The experts as ``kernels.moe`` takes them: packed, or views of the stacked weights."""
        if self.packed is not None:
            return self.packed
        assert self.w13 is not None and self.w2 is not None
        e, h = self.num_experts, self.w13.shape[1]
        return ExpertWeights(self.w13.view(e, -1, h), self.w2.view(e, h, -1))

    def pack(self, layout: str) -> None:
        """Pack the experts for the native CPU op (``ExpertWeights.pack``'s layouts: float32
        or int8 panels) and drop the stacked dense copies."""
        if self.packed is None:
            self.packed = self.experts().pack(layout)
            self.w13 = self.w2 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = route(self.router(x), self.top_k, self.renormalize, self.weights_dtype)
        out = fused_moe(x, self.experts(), weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.all_reduce is None else self.all_reduce(out)
