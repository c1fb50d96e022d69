"""Which part of each weight (and of the KV cache) a tensor-parallel rank holds.

With N ranks, H q heads and K kv heads (groups of G = H/K q heads), rank r holds:
- when K >= N: kv heads ``[r*K//N, (r+1)*K//N)`` and their whole q-head groups (N
  need not divide K: e.g. 3 kv heads over 2 ranks give 1 and 2 groups);
- when K < N (N a multiple of K): q heads ``[r*H/N, (r+1)*H/N)`` and the one kv head
  ``r*K//N`` they read, replicated on the N/K ranks whose q heads share it;
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
# An expert's (or the shared expert's) projection: gate_proj / up_proj / down_proj, or
# Mixtral's w1 (gate), w3 (up), w2 (down).
_EXPERT = re.compile(
    r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.(?:experts\.(\d+)|shared_expert)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _unsplit_reason(config: ModelConfig) -> str | None:
    """Why this model's tensors cannot be sharded by name here, or None."""
    if config.features.qk_norm_whole:
        return "RMSNorm over all of q and k"
    return None


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
        if config.num_kv_heads < n and (n % config.num_kv_heads or config.num_heads % n):
            problems.append(
                f"with num_key_value_heads={config.num_kv_heads} below it, it must be a multiple "
                f"of them and divide num_attention_heads={config.num_heads}"
            )
        if config.intermediate_size % n:
            problems.append(f"intermediate_size={config.intermediate_size} is not divisible by it")
        moe = config.moe
        if moe is not None:
            for name, size in (("expert", moe.intermediate_size), ("shared expert", moe.shared_intermediate_size)):
                if size % n:
                    problems.append(f"the {name} intermediate size {size} is not divisible by it")
        unsplit = _unsplit_reason(config)
        if unsplit:
            problems.append(f"{config.architecture} is not split yet ({unsplit})")
        if problems:
            raise ConfigError(f"tensor_parallel_size={n} does not fit the model: " + "; ".join(problems))
        if not 0 <= rank < n:
            raise ValueError(f"rank {rank} outside [0, {n})")
        return cls(config, rank, world_size)

    @property
    def kv_replicated(self) -> bool:
        return self.config.num_kv_heads < self.world_size

    @property
    def kv_heads(self) -> tuple[int, int]:
        """``[start, stop)`` of the kv heads this rank holds."""
        k, n, r = self.config.num_kv_heads, self.world_size, self.rank
        if self.kv_replicated:
            return r * k // n, r * k // n + 1
        return r * k // n, (r + 1) * k // n

    @property
    def q_heads(self) -> tuple[int, int]:
        """``[start, stop)`` of the q heads this rank computes (whole groups of its kv heads)."""
        h, n, r = self.config.num_heads, self.world_size, self.rank
        if self.kv_replicated:
            return r * h // n, (r + 1) * h // n
        group = h // self.config.num_kv_heads
        start, stop = self.kv_heads
        return start * group, stop * group

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def max_num_kv_heads(self) -> int:
        """The most kv heads any rank holds: what sizes every rank's KV-cache blocks."""
        k, n = self.config.num_kv_heads, self.world_size
        return 1 if self.kv_replicated else -(-k // n)

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
        moe = self.config.moe
        if moe is not None:  # experts split like the dense MLP: their intermediate columns
            n = self.world_size
            moe = dataclasses.replace(
                moe,
                intermediate_size=moe.intermediate_size // n,
                shared_intermediate_size=moe.shared_intermediate_size // n,
            )
        return dataclasses.replace(
            self.config,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_per_rank,
            moe=moe,
        )

    def weight_targets(self) -> dict[str, WeightTarget]:
        """``weight_targets`` of the whole model, cut to this rank's slices."""
        return {name: self._shard(name, t) for name, t in weight_targets(self.config).items()}

    def _shard(self, name: str, target: WeightTarget) -> WeightTarget:
        hd = self.config.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return dataclasses.replace(target, take=(0, self.vocab_start, self.vocab_stop))
        expert = _EXPERT.match(name)
        if expert is not None:
            return self._shard_expert(target, expert.group(1), _EXPERT_PART[expert.group(2)])
        m = _LAYER.match(name)
        if m is None:
            return target  # norms, routers: whole
        _, _, proj, kind = m.groups()
        q_rows, kv_rows, inter = self.num_heads * hd, self.num_kv_heads * hd, self.intermediate_size
        q_start = self.q_heads[0] * hd
        if proj == "q":
            return dataclasses.replace(target, take=(0, q_start, q_start + q_rows))
        if proj in ("k", "v"):
            start = self.kv_heads[0] * hd
            row_start = q_rows if proj == "k" else q_rows + kv_rows
            return dataclasses.replace(target, row_start=row_start, take=(0, start, start + kv_rows))
        if proj in ("gate", "up"):
            row_start = 0 if proj == "gate" else inter
            span = (self.rank * inter, (self.rank + 1) * inter)
            return dataclasses.replace(target, row_start=row_start, take=(0, *span))
        if kind == "bias":  # o / down: added once, after the all-reduce
            return target
        if proj == "o":
            return dataclasses.replace(target, take=(1, q_start, q_start + q_rows))
        return dataclasses.replace(target, take=(1, self.rank * inter, (self.rank + 1) * inter))

    def _shard_expert(self, target: WeightTarget, expert: str | None, part: str) -> WeightTarget:
        """Expert ``expert`` (None: the shared expert) of a MoE layer: gate and up rows and
        down columns ``[r*I/N, (r+1)*I/N)``, placed in the shard's stacked w13 / w2."""
        moe = self.config.moe
        assert moe is not None
        n, r = self.world_size, self.rank
        whole = moe.shared_intermediate_size if expert is None else moe.intermediate_size
        inter = whole // n
        span = (r * inter, (r + 1) * inter)
        if expert is None:  # a dense MLP of its own: gate_up_proj rows [gate | up]
            if part == "down":
                return dataclasses.replace(target, take=(1, *span))
            return dataclasses.replace(target, row_start=0 if part == "gate" else inter, take=(0, *span))
        e = int(expert)
        if part == "down":  # w2 rows [e*H, (e+1)*H), this rank's columns
            return dataclasses.replace(target, take=(1, *span))
        row_start = e * 2 * inter + (0 if part == "gate" else inter)
        return dataclasses.replace(target, row_start=row_start, take=(0, *span))
