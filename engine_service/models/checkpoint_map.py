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
    offset: float = 0.0  # added to every value as it loads (Gemma's norm scales: w -> 1 + w)

    @property
    def num_rows(self) -> int:
        """Rows this target writes into ``param``."""
        if self.take is not None and self.take[0] == 0:
            return self.take[2] - self.take[1]
        return self.shape[0]


def weight_targets(config: ModelConfig) -> dict[str, WeightTarget]:
    """The complete map from checkpoint tensor names to model parameter slices."""
    h = config.hidden_size
    norm_offset = config.features.norm_offset
    targets: dict[str, WeightTarget] = {
        "model.embed_tokens.weight": WeightTarget("embed_tokens", 0, (config.vocab_size, h)),
        "model.norm.weight": WeightTarget("norm.weight", 0, (h,), offset=norm_offset),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = WeightTarget("lm_head", 0, (config.vocab_size, h))
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.features.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        for norm in norms:
            targets[f"{src}.{norm}.weight"] = WeightTarget(f"{dst}.{norm}.weight", 0, (h,), offset=norm_offset)
        _attention_targets(config, f"{src}.self_attn", f"{dst}.self_attn", targets)
        if config.is_moe_layer(i):
            _moe_targets(config, src, f"{dst}.mlp", targets)
        else:
            _mlp_targets(config, f"{src}.mlp", f"{dst}.mlp", config.intermediate_size, targets)
    return targets


def _attention_targets(config: ModelConfig, src: str, dst: str, targets: dict[str, WeightTarget]) -> None:
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    f = config.features
    for part, start, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
        targets[f"{src}.{part}_proj.weight"] = WeightTarget(f"{dst}.qkv_proj.weight", start, (rows, h))
        if f.qkv_bias:
            targets[f"{src}.{part}_proj.bias"] = WeightTarget(f"{dst}.qkv_proj.bias", start, (rows,))
    targets[f"{src}.o_proj.weight"] = WeightTarget(f"{dst}.o_proj.weight", 0, (h, q))
    if f.o_proj_bias:
        targets[f"{src}.o_proj.bias"] = WeightTarget(f"{dst}.o_proj.bias", 0, (h,))
    if f.qk_norm or f.qk_norm_whole:
        sizes = {"q": q, "k": kv} if f.qk_norm_whole else {"q": config.head_dim, "k": config.head_dim}
        for part, size in sizes.items():
            targets[f"{src}.{part}_norm.weight"] = WeightTarget(
                f"{dst}.{part}_norm.weight", 0, (size,), offset=f.norm_offset
            )


def _mlp_targets(
    config: ModelConfig, src: str, dst: str, inter: int, targets: dict[str, WeightTarget], names: tuple[str, ...] = ()
) -> None:
    """A gated MLP: gate/up into ``gate_up_proj`` (or Phi-3's fused tensor), down.
    ``names``: the checkpoint's (gate, up, down) names when not gate_proj/up_proj/down_proj."""
    h, bias = config.hidden_size, config.features.mlp_bias
    gate, up, down = names or ("gate_proj", "up_proj", "down_proj")
    for part, start in ((gate, 0), (up, inter)):
        targets[f"{src}.{part}.weight"] = WeightTarget(f"{dst}.gate_up_proj.weight", start, (inter, h))
        if bias:
            targets[f"{src}.{part}.bias"] = WeightTarget(f"{dst}.gate_up_proj.bias", start, (inter,))
    targets[f"{src}.{down}.weight"] = WeightTarget(f"{dst}.down_proj.weight", 0, (h, inter))
    if bias:
        targets[f"{src}.{down}.bias"] = WeightTarget(f"{dst}.down_proj.bias", 0, (h,))


def _moe_targets(config: ModelConfig, src: str, dst: str, targets: dict[str, WeightTarget]) -> None:
    """Router, stacked experts (moe.py's w13 / w2 row ranges) and Qwen2-MoE's shared expert."""
    moe = config.moe
    assert moe is not None
    h, inter, e = config.hidden_size, moe.intermediate_size, moe.num_experts
    if moe.naming == "mixtral":
        block, (gate, up, down) = f"{src}.block_sparse_moe", ("w1", "w3", "w2")
    else:
        block, (gate, up, down) = f"{src}.mlp", ("gate_proj", "up_proj", "down_proj")
    targets[f"{block}.gate.weight"] = WeightTarget(f"{dst}.router.weight", 0, (e, h))
    for x in range(e):
        expert = f"{block}.experts.{x}"
        targets[f"{expert}.{gate}.weight"] = WeightTarget(f"{dst}.w13", x * 2 * inter, (inter, h))
        targets[f"{expert}.{up}.weight"] = WeightTarget(f"{dst}.w13", x * 2 * inter + inter, (inter, h))
        targets[f"{expert}.{down}.weight"] = WeightTarget(f"{dst}.w2", x * h, (h, inter))
    if moe.shared_intermediate_size:
        _mlp_targets(config, f"{block}.shared_expert", f"{dst}.shared_expert", moe.shared_intermediate_size, targets)
        targets[f"{block}.shared_expert_gate.weight"] = WeightTarget(f"{dst}.shared_expert_gate.weight", 0, (1, h))


def fused_checkpoint_parts(config: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
    """A checkpoint that stores projections fused (Phi-3's ``qkv_proj``, ``gate_up_proj``):
    fused tensor name -> ``(name of the separate tensor, first row, rows)`` of each part.
    The loader splits them into the separate names ``weight_targets`` maps, so tensor
    parallelism and quantized formats see a Llama-shaped checkpoint. Empty for others."""
    if not config.features.fused_checkpoint:
        return {}
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    parts: dict[str, list[tuple[str, int, int]]] = {}
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        parts[f"{attn}.qkv_proj.weight"] = [
            (f"{attn}.q_proj.weight", 0, q), (f"{attn}.k_proj.weight", q, kv), (f"{attn}.v_proj.weight", q + kv, kv)
        ]
        if not config.is_moe_layer(i):
            parts[f"{mlp}.gate_up_proj.weight"] = [(f"{mlp}.gate_proj.weight", 0, inter), (f"{mlp}.up_proj.weight", inter, inter)]
    return parts
