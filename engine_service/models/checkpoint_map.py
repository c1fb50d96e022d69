"""Where each checkpoint tensor of a ``DecoderForCausalLM`` goes: ``weight_targets``.

Hugging Face tensor names map onto the decoder's parameters, or onto a row range of a
fused one (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``). The weight loader
(loader.py) checks every checkpoint against this map, the GGUF reader (gguf_weights.py)
names a GGUF file's tensors by it, and tensor parallelism (distributed/sharding.py)
narrows it to one rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.protocol.model_config import ModelConfig


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: rows ``[row_start, row_start + num_rows)`` of ``param``.

    ``take`` (a tensor-parallel shard): only ``[start, stop)`` along dimension ``dim`` of
    the checkpoint tensor is read; None: all of it.
    """

    param: str  # name in model.named_parameters()
    row_start: int  # first row inside the (possibly fused) parameter
    shape: tuple[int, ...]  # expected checkpoint tensor shape (the whole tensor)
    take: tuple[int, int, int] | None = None  # (dim, start, stop)

    @property
    def num_rows(self) -> int:
        """Rows this target writes into ``param``."""
        if self.take is not None and self.take[0] == 0:
            return self.take[2] - self.take[1]
        return self.shape[0]


def weight_targets(config: ModelConfig) -> dict[str, WeightTarget]:
    """The complete map from checkpoint tensor names to model parameter slices."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    f = config.features
    targets: dict[str, WeightTarget] = {
        "model.embed_tokens.weight": WeightTarget("embed_tokens", 0, (config.vocab_size, h)),
        "model.norm.weight": WeightTarget("norm.weight", 0, (h,)),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = WeightTarget("lm_head", 0, (config.vocab_size, h))
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        attn, mlp = f"{src}.self_attn", f"{src}.mlp"
        targets[f"{src}.input_layernorm.weight"] = WeightTarget(f"{dst}.input_layernorm.weight", 0, (h,))
        targets[f"{src}.post_attention_layernorm.weight"] = WeightTarget(
            f"{dst}.post_attention_layernorm.weight", 0, (h,)
        )
        for part, start, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
            targets[f"{attn}.{part}_proj.weight"] = WeightTarget(
                f"{dst}.self_attn.qkv_proj.weight", start, (rows, h)
            )
            if f.qkv_bias:
                targets[f"{attn}.{part}_proj.bias"] = WeightTarget(
                    f"{dst}.self_attn.qkv_proj.bias", start, (rows,)
                )
        targets[f"{attn}.o_proj.weight"] = WeightTarget(f"{dst}.self_attn.o_proj.weight", 0, (h, q))
        if f.o_proj_bias:
            targets[f"{attn}.o_proj.bias"] = WeightTarget(f"{dst}.self_attn.o_proj.bias", 0, (h,))
        if f.qk_norm:
            for part in ("q", "k"):
                targets[f"{attn}.{part}_norm.weight"] = WeightTarget(
                    f"{dst}.self_attn.{part}_norm.weight", 0, (config.head_dim,)
                )
        for part, start in (("gate", 0), ("up", inter)):
            targets[f"{mlp}.{part}_proj.weight"] = WeightTarget(
                f"{dst}.mlp.gate_up_proj.weight", start, (inter, h)
            )
            if f.mlp_bias:
                targets[f"{mlp}.{part}_proj.bias"] = WeightTarget(
                    f"{dst}.mlp.gate_up_proj.bias", start, (inter,)
                )
        targets[f"{mlp}.down_proj.weight"] = WeightTarget(f"{dst}.mlp.down_proj.weight", 0, (h, inter))
        if f.mlp_bias:
            targets[f"{mlp}.down_proj.bias"] = WeightTarget(f"{dst}.mlp.down_proj.bias", 0, (h,))
    return targets
