"""How each supported family differs from Llama, read from its ``config.json``: the typed
options the one decoder takes (``ArchitectureFeatures``, per-layer attention types, the
rotated part of a head, Gemma 3's local rope base, ``MoEConfig``). ``model_config.py``
reads the shared fields and calls these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded: a file, field or tensor is missing or wrong."""


class ConfigFields:
    """Typed reads of required config fields with errors that name the field and file."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self._raw = raw
        self._source = source

    def positive_int(self, name: str, default: Any = ...) -> Any:
        value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelLoadError(f"{self._source}: field {name!r} must be a positive integer, got {value!r}")
        return value

    def positive_float(self, name: str) -> float:
        value = self._get(name, ...)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(f"{self._source}: field {name!r} must be a positive number, got {value!r}")
        return float(value)

    def _get(self, name: str, default: Any) -> Any:
        value = self._raw.get(name, default)
        if value is ...:
            raise ModelLoadError(f"{self._source}: required field {name!r} is missing")
        return value


@dataclass(frozen=True)
class ArchitectureFeatures:
    """How one supported architecture differs from plain Llama (one decoder, these options)."""

    qkv_bias: bool = False  # q/k/v projections carry a bias
    o_proj_bias: bool = False  # the output projection carries a bias
    mlp_bias: bool = False  # gate/up/down projections carry a bias
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3)
    # RMSNorm on all of q and all of k (OLMoE: scales of q_size and kv_size), not per head
    qk_norm_whole: bool = False
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] (OLMoE)
    activation: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh"
    # Stored RMSNorm scales are w where the norm multiplies by (1 + w) (Gemma): the loader
    # adds this to every norm scale, so the kernels see the scale they multiply by.
    norm_offset: float = 0.0
    # Gemma 2/3: the attention and MLP outputs are normed before the residual add
    # (post_attention_layernorm, post_feedforward_layernorm) and the MLP's input by
    # pre_feedforward_layernorm.
    sandwich_norms: bool = False
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    query_scale: float | None = None  # attention scale; None: head_dim ** -0.5
    # The checkpoint stores qkv_proj and gate_up_proj already fused (Phi-3).
    fused_checkpoint: bool = False


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: router softmax over ``num_experts``, ``top_k`` chosen."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool  # the top-k weights rescaled to sum 1 (Mixtral; Qwen/OLMoE norm_topk_prob)
    # A dense expert every token takes, gated by sigmoid(x @ gate) (Qwen2-MoE); 0: none.
    shared_intermediate_size: int = 0
    # Per layer: True where the MLP is the MoE (Qwen's decoder_sparse_step / mlp_only_layers).
    sparse_layers: tuple[bool, ...] = ()
    # Checkpoint names: "mixtral" (block_sparse_moe.experts.E.w1/w3/w2) or "mlp" (mlp.experts.E.*).
    naming: str = "mlp"


# Activations the gated MLP computes, by config.json's name.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


def layer_types(
    model_type: str, raw: dict[str, Any], num_layers: int, source: str
) -> tuple[tuple[str, ...], int | None]:
    """Each layer's attention type and the sliding window, from ``layer_types`` where the
    config has it, else from each family's older fields (Mistral's and Phi-3's
    ``sliding_window`` on every layer; Qwen2's ``use_sliding_window`` from
    ``max_window_layers`` on; Gemma 2 alternating; Gemma 3 five sliding to one full)."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not raw.get("use_sliding_window"):
        window = None  # these configs carry a window that only use_sliding_window turns on
    if types is None:
        if model_type in ("mistral", "phi3", "mixtral"):
            types = [SLIDING_ATTENTION if window else FULL_ATTENTION] * num_layers
        elif model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and window:
            start = raw.get("max_window_layers", num_layers)
            types = [SLIDING_ATTENTION if i >= start else FULL_ATTENTION for i in range(num_layers)]
        elif model_type == "gemma2":
            types = [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(num_layers)]
        elif model_type == "gemma3_text":
            pattern = raw.get("sliding_window_pattern", 6)
            types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
        else:
            types = [FULL_ATTENTION] * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelLoadError(f"{source}: layer_types must list one type per layer ({num_layers}), got {types!r}")
    unknown = sorted({t for t in types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
    if unknown:
        raise ModelLoadError(
            f"{source}: layer type(s) {', '.join(map(repr, unknown))} are not supported "
            f"(only {FULL_ATTENTION!r} and {SLIDING_ATTENTION!r})"
        )
    if SLIDING_ATTENTION not in types:
        return (), None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{source}: sliding layers need a positive sliding_window, got {window!r}")
    return tuple(types), window


def rotary_dim(raw: dict[str, Any], scaling: dict[str, Any] | None, head_dim: int, source: str) -> int | None:
    partial = raw.get("partial_rotary_factor", (scaling or {}).get("partial_rotary_factor", 1.0))
    if isinstance(partial, bool) or not isinstance(partial, int | float) or not 0 < partial <= 1:
        raise ModelLoadError(f"{source}: partial_rotary_factor must be in (0, 1], got {partial!r}")
    if partial == 1.0:
        return None
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2:
        raise ModelLoadError(f"{source}: the rotated part of a head ({rotary_dim}) must be even")
    return rotary_dim


def local_theta(model_type: str, raw: dict[str, Any], source: str) -> float | None:
    """Gemma 3's sliding layers rotate with their own base (``rope_local_base_freq``)."""
    if model_type != "gemma3_text":
        return None
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(SLIDING_ATTENTION), dict):
        theta = params[SLIDING_ATTENTION].get("rope_theta", 10000.0)
    else:
        theta = raw.get("rope_local_base_freq", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise ModelLoadError(f"{source}: the local rope theta must be a positive number, got {theta!r}")
    return float(theta)


def moe(model_type: str, raw: dict[str, Any], num_layers: int, source: str) -> MoEConfig | None:
    if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        return None
    fields = ConfigFields(raw, source)
    if model_type == "mixtral":
        return MoEConfig(
            num_experts=fields.positive_int("num_local_experts"),
            top_k=fields.positive_int("num_experts_per_tok"),
            intermediate_size=fields.positive_int("intermediate_size"),
            renormalize=True,
            sparse_layers=(True,) * num_layers,
            naming="mixtral",
        )
    # transformers 5 writes num_local_experts where released checkpoints say num_experts
    num_experts = fields.positive_int("num_experts" if "num_experts" in raw else "num_local_experts")
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok ({top_k}) exceeds num_experts ({num_experts})")
    if model_type == "olmoe":
        return MoEConfig(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=fields.positive_int("intermediate_size"),
            renormalize=bool(raw.get("norm_topk_prob", False)),
            sparse_layers=(True,) * num_layers,
        )
    step = fields.positive_int("decoder_sparse_step", default=1)
    dense = set(raw.get("mlp_only_layers") or [])
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=fields.positive_int("moe_intermediate_size"),
        renormalize=bool(raw.get("norm_topk_prob", model_type == "qwen3_moe")),
        shared_intermediate_size=(
            fields.positive_int("shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0
        ),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
    )


def features(model_type: str, raw: dict[str, Any], hidden_size: int, source: str) -> ArchitectureFeatures:
    act_name = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    activation = _ACTIVATIONS.get(act_name)
    if activation is None:
        raise ModelLoadError(
            f"{source}: hidden_act {act_name!r} is not supported (supported: {', '.join(sorted(_ACTIVATIONS))})"
        )
    if model_type in ("qwen2", "qwen2_moe"):
        return ArchitectureFeatures(qkv_bias=True, activation=activation)
    attention_bias = bool(raw.get("attention_bias", False))
    if model_type in ("gemma2", "gemma3_text"):
        scalar = raw.get("query_pre_attn_scalar", 256)
        if isinstance(scalar, bool) or not isinstance(scalar, int | float) or scalar <= 0:
            raise ModelLoadError(f"{source}: query_pre_attn_scalar must be a positive number, got {scalar!r}")
        return ArchitectureFeatures(
            qkv_bias=attention_bias,
            o_proj_bias=attention_bias,
            qk_norm=model_type == "gemma3_text",
            activation=activation,
            norm_offset=1.0,
            sandwich_norms=True,
            embed_scale=hidden_size**0.5,
            attn_softcap=_optional_positive(raw, "attn_logit_softcapping", source),
            final_softcap=_optional_positive(raw, "final_logit_softcapping", source),
            query_scale=float(scalar) ** -0.5,
        )
    return ArchitectureFeatures(
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)) if model_type == "llama" else False,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        qk_norm_whole=model_type == "olmoe",
        clip_qkv=_optional_positive(raw, "clip_qkv", source) if model_type == "olmoe" else None,
        activation=activation,
        fused_checkpoint=model_type == "phi3",
    )


def _optional_positive(raw: dict[str, Any], name: str, source: str) -> float | None:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ModelLoadError(f"{source}: {name} must be a positive number or null, got {value!r}")
    return float(value)
