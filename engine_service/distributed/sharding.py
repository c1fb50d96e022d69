"""Which part of each weight (and of the KV cache) a tensor-parallel rank holds.

With N ranks, rank r holds:
- q heads ``[r*H/N, (r+1)*H/N)`` and the kv heads they read: ``[r*K/N, (r+1)*K/N)``
  when N divides the K kv heads, else (K divides N) the one kv head ``r*K//N``,
  replicated on the N/K ranks whose q heads share it;
- columns ``[r*I/N, (r+1)*I/N)`` of gate and up, the matching input columns of down,
  and the matching input columns of o (o and down are row-parallel: one all-reduce each);
- vocabulary rows ``[r*V', (r+1)*V')`` of the embedding and LM head, V' = ceil(V/N)
  (the last rank's shard is zero-padded);
- the norms and o/down biases whole.
Its KV cache holds only its kv heads: the block ids are the engine's, shared by all ranks.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from engine_service.config import ConfigError
from engine_service.models.loader import WeightTarget, weight_targets
from tandem.protocol.model_config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)$")


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``world_size``'s slice of a ``ModelConfig``."""

    config: ModelConfig  # the whole model's
    rank: int
    world_size: int

    @classmethod
    def build(cls, config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
        """Raises ConfigError when the model cannot be split ``world_size`` ways."""
        n = world_size
        problems = []
        if config.num_heads % n:
            problems.append(f"num_attention_heads={config.num_heads} is not divisible by it")
        if config.num_kv_heads % n and n % config.num_kv_heads:
            problems.append(
                f"num_key_value_heads={config.num_kv_heads} neither divides it nor is divisible by it"
            )
        if config.intermediate_size % n:
            problems.append(f"intermediate_size={config.intermediate_size} is not divisible by it")
        if problems:
            raise ConfigError(f"tensor_parallel_size={n} does not fit the model: " + "; ".join(problems))
        if not 0 <= rank < n:
            raise ValueError(f"rank {rank} outside [0, {n})")
        return cls(config, rank, world_size)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.world_size

    @property
    def kv_replicated(self) -> bool:
        return self.config.num_kv_heads < self.world_size

    @property
    def num_kv_heads(self) -> int:
        return 1 if self.kv_replicated else self.config.num_kv_heads // self.world_size

    @property
    def first_kv_head(self) -> int:
        if self.kv_replicated:
            return self.rank * self.config.num_kv_heads // self.world_size
        return self.rank * self.num_kv_heads

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_stop(self) -> int:  # exclusive; <= vocab_start + vocab_per_rank
        return min(self.config.vocab_size, self.vocab_start + self.vocab_per_rank)

    @property
    def local_config(self) -> ModelConfig:
        """The shard's shapes: the decoder built from it has exactly this rank's parameters
        (vocab_size is the padded shard's rows)."""
        return dataclasses.replace(
            self.config,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_per_rank,
        )

    def weight_targets(self) -> dict[str, WeightTarget]:
        """``weight_targets`` of the whole model, cut to this rank's slices."""
        return {name: self._shard(name, t) for name, t in weight_targets(self.config).items()}

    def _shard(self, name: str, target: WeightTarget) -> WeightTarget:
        hd = self.config.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return dataclasses.replace(target, take=(0, self.vocab_start, self.vocab_stop))
        m = _LAYER.match(name)
        if m is None:
            return target  # norms: whole
        _, _, proj, kind = m.groups()
        q_rows, kv_rows, inter = self.num_heads * hd, self.num_kv_heads * hd, self.intermediate_size
        if proj == "q":
            return dataclasses.replace(target, take=(0, self.rank * q_rows, (self.rank + 1) * q_rows))
        if proj in ("k", "v"):
            start = self.first_kv_head * hd
            row_start = q_rows if proj == "k" else q_rows + kv_rows
            return dataclasses.replace(target, row_start=row_start, take=(0, start, start + kv_rows))
        if proj in ("gate", "up"):
            row_start = 0 if proj == "gate" else inter
            span = (self.rank * inter, (self.rank + 1) * inter)
            return dataclasses.replace(target, row_start=row_start, take=(0, *span))
        if kind == "bias":  # o / down: added once, after the all-reduce
            return target
        cols = q_rows if proj == "o" else inter
        return dataclasses.replace(target, take=(1, self.rank * cols, (self.rank + 1) * cols))
