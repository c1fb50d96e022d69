"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

A router scores the ``E`` experts per token; the top ``k`` (softmax probabilities, renormalized
to sum 1 where the family does) each run a SwiGLU MLP of ``moe.intermediate_size`` on the
token, and their outputs are summed with those weights. Qwen2-MoE adds a shared expert every
token takes, gated by ``sigmoid(x @ shared_expert_gate)``.

Expert weights are stacked, so a checkpoint's per-expert tensors land in row ranges
(checkpoint_map.py): ``w13`` is ``[E * 2I, H]``, expert ``e``'s gate rows then up rows at
``e * 2I``; ``w2`` is ``[E * H, I]``, expert ``e``'s down rows at ``e * H``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_service.models.layers import MLP, FusedLinear, empty_param
from kernels.dispatch import KernelOps
from tandem.protocol.model_config import ModelConfig


def route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # float32 [T, k], int64 [T, k]
    """Softmax over experts in float32, the top ``k`` (ties as ``torch.topk`` breaks them),
    rescaled to sum 1 when ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_forward(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows then up rows
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k] int64
) -> torch.Tensor:  # [T, H]
    """``sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` over each token's
    chosen experts: tokens are grouped by expert, so each expert runs one GEMM pair on all
    of its tokens (experts with no tokens are skipped)."""
    num_tokens, top_k = ids.shape
    flat = ids.flatten()  # [T * k]
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // top_k  # [T * k] the token of each grouped pair
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        rows = tokens[start : start + count]
        start += count
        gate_up = F.linear(x[rows], w13[expert])  # [count, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])  # [count, H]
        out.index_add_(0, rows, y.float() * weights.flatten()[pairs, None])
    return out.to(x.dtype)


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
        h, inter = config.hidden_size, moe.intermediate_size
        self.router = FusedLinear(h, moe.num_experts, False, dtype, device)  # scores [T, E]
        self.w13 = empty_param(moe.num_experts * 2 * inter, h, dtype=dtype, device=device)
        self.w2 = empty_param(moe.num_experts * h, inter, dtype=dtype, device=device)
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(config, ops, dtype, device, moe.shared_intermediate_size)
            self.shared_expert_gate = FusedLinear(h, 1, False, dtype, device)
        # Tensor parallelism: each rank's experts hold a slice of the intermediate columns,
        # so the output is a partial sum, all-reduced once (shared expert included).
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = route(self.router(x), self.top_k, self.renormalize)
        e, h = self.num_experts, x.shape[1]
        out = experts_forward(x, self.w13.view(e, -1, h), self.w2.view(e, h, -1), weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.all_reduce is None else self.all_reduce(out)
