"""The decoder's tensor-parallel shard: the same modules as ``DecoderForCausalLM``,
built with the shard's shapes (``ShardPlan.local_config``), plus the collectives.

q/k/v and gate/up are column-parallel and need no communication: each rank computes
its own heads and its own MLP columns. o and down are row-parallel: each rank's
partial product is summed by one all-reduce. The embedding is vocab-parallel (each
rank looks up the ids in its rows, zeros elsewhere, one all-reduce); the LM head is
vocab-parallel too, its logits gathered on rank 0 for sampling. The hidden state
between layers (and after the final norm) is therefore whole on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_service.distributed.parallel_state import Communicator
from engine_service.distributed.sharding import ShardPlan
from engine_service.models.decoder import DecoderForCausalLM, FusedLinear
from engine_service.models.loader import WeightLoader, load_weights
from engine_service.models.moe import MoEBlock
from kernels.dispatch import KernelOps
from tandem.protocol.model_config import ModelConfig


class RowParallelLinear(FusedLinear):
    """``all_reduce(x_r @ W_r.T) + bias``: ``x_r``/``W_r`` are this rank's input columns."""

    def __init__(self, base: FusedLinear, comm: Communicator) -> None:
        weight = base.weight
        if weight is None:
            raise ValueError("build RowParallelLinear before packing the weights")
        super().__init__(weight.shape[1], weight.shape[0], base.bias is not None, weight.dtype, weight.device)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in / N] -> [n, out]
        y = self.matmul(x, None)
        self.comm.all_reduce(y)
        if self.bias is not None:
            y.add_(self.bias)  # once, not once per rank
        return y


class ShardedDecoderForCausalLM(DecoderForCausalLM):
    """One rank's shard. ``compute_logits`` is a collective: every rank calls it with
    the same rows, and rank 0 gets ``[n, vocab_size]`` float32 (the others None)."""

    def __init__(
        self, plan: ShardPlan, ops: KernelOps, dtype: torch.dtype, device: torch.device, comm: Communicator
    ) -> None:
        super().__init__(plan.local_config, ops, dtype, device)
        self.plan = plan
        self.comm = comm
        self.vocab_size = plan.config.vocab_size
        for layer in self.layers:
            layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, comm)
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.all_reduce = comm.all_reduce
            else:
                layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, comm)
        # The last rank's padding rows are never read (ids masked, logits cut off);
        # zeros keep them finite.
        with torch.no_grad():
            self.embed_tokens.zero_()
            if self.lm_head is not None:
                self.lm_head.zero_()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.plan.vocab_start
        outside = (local < 0) | (local >= self.plan.vocab_per_rank)  # [num_tokens] bool
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.scale_embeddings(self.comm.all_reduce(hidden))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """None: a shard's argmax is not the model's (the logits are gathered first)."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        local = super().compute_logits(hidden)  # [n, vocab_per_rank] float32
        full = self.comm.gather_last_dim(local)
        if full is None or full.shape[1] == self.vocab_size:
            return full
        return full[:, : self.vocab_size].contiguous()  # the last shard's padding cut off


def load_sharded_model(
    model_dir: str, dtype: torch.dtype, device: torch.device, ops: KernelOps, comm: Communicator
) -> tuple[ShardedDecoderForCausalLM, ModelConfig]:
    """This rank's shard of ``model_dir``, weights loaded (only its slices are read), eval
    mode; and the whole model's config."""
    config = ModelConfig.from_pretrained(model_dir)
    plan = ShardPlan.build(config, comm.rank, comm.world_size)
    model = ShardedDecoderForCausalLM(plan, ops, dtype, device, comm)
    load_weights(WeightLoader(model, config, plan.weight_targets()), model_dir, config)
    return model.eval(), config
