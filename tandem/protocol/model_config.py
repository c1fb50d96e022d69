"""What the engine needs to know about a Hugging Face checkpoint, read from its JSON files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from tandem.protocol import model_families as families
from tandem.protocol.model_families import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ArchitectureFeatures,
    ConfigFields,
    ModelLoadError,
    MoEConfig,
)
from tandem.protocol.quantization import QuantizationConfig, parse_quantization_config

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "ArchitectureFeatures",
    "MoEConfig",
    "ModelConfig",
    "ModelLoadError",
    "check_checkpoint_dir",
]



# Files that make a directory a tokenizer (one of them suffices).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_checkpoint_dir(path: str, weights: bool = True) -> None:
    """Raise ModelLoadError (one line) unless ``path`` is a local checkpoint directory:
    ``config.json``, tokenizer files and, with ``weights``, ``*.safetensors``. Checked
    before anything loads, so a wrong path is named as such rather than as a hub lookup."""
    if not os.path.exists(path):
        raise ModelLoadError(
            f"{path}: no such directory (a local checkpoint directory or .gguf file is expected; "
            "nothing is downloaded: fetch a Hub model first, e.g. 'hf download ID --local-dir DIR', "
            "and pass DIR)"
        )
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path}: not a directory (a local checkpoint directory is expected)")
    names = set(os.listdir(path))
    if "config.json" not in names:
        raise ModelLoadError(
            f"{path}: holds no checkpoint (no config.json, and no .gguf file)"
        )
    if not names.intersection(_TOKENIZER_FILES):
        raise ModelLoadError(f"{path}: holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)})")
    if weights and not any(n.endswith(".safetensors") for n in names) and "gguf.json" not in names:
        raise ModelLoadError(
            f"{path}: holds no weights (no *.safetensors file; a .gguf file is passed as --model FILE)"
        )


# architecture name in config.json -> the model_type transformers writes for it.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}

# Rope types this engine can build a cos/sin cache for (see models.rotary).
SUPPORTED_ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "llama3", "longrope"})

@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only checkpoint's shape and settings, independent of transformers."""

    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    # Extra rope settings beyond theta (rope_type "llama3", "linear", ...); None = plain rope.
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    eos_token_ids: list[int]  # config.json's then generation_config.json's, de-duplicated
    bos_token_id: int | None
    torch_dtype: str | None  # dtype the checkpoint declares ("float32", "bfloat16", ...)
    features: ArchitectureFeatures = field(default_factory=ArchitectureFeatures)
    # Per layer: FULL_ATTENTION or SLIDING_ATTENTION; () means every layer is full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # a sliding layer's query sees this many keys, itself included
    # Sliding layers' own rope theta (Gemma 3's local base); None: the global one.
    rope_local_theta: float | None = None
    rotary_dim: int | None = None  # rotary on the first rotary_dim of head_dim; None: all of it
    moe: MoEConfig | None = None
    quantization: QuantizationConfig | None = None  # quantization_config (GPTQ, AWQ, FP8), if any

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_ATTENTION

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``; None for a full-attention layer."""
        return self.sliding_window if self.is_sliding(layer) else None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def rope_dim(self) -> int:
        """The rotated part of each head."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str]) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) from ``model_dir``."""
        model_dir = os.fspath(model_dir)
        if not os.path.isdir(model_dir):
            raise ModelLoadError(f"model directory {model_dir!r} does not exist")
        config_path = os.path.join(model_dir, "config.json")
        raw = _read_json(config_path)
        gen_path = os.path.join(model_dir, "generation_config.json")
        gen = _read_json(gen_path) if os.path.exists(gen_path) else {}
        return cls.from_dict(raw, generation_config=gen, source=config_path)

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        source: str = "config.json",
    ) -> ModelConfig:
        fields = ConfigFields(raw, source)
        architecture = _architecture(raw, source)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        hidden_size = fields.positive_int("hidden_size")
        num_heads = fields.positive_int("num_attention_heads")
        num_kv_heads = fields.positive_int("num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads != 0:
            raise ModelLoadError(
                f"{source}: num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = fields.positive_int("head_dim", default=None)
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ModelLoadError(
                    f"{source}: no head_dim and hidden_size ({hidden_size}) is not a multiple "
                    f"of num_attention_heads ({num_heads})"
                )
            head_dim = hidden_size // num_heads
        if head_dim % 2 != 0:
            raise ModelLoadError(f"{source}: head_dim must be even for rotary, got {head_dim}")
        rope_theta, rope_scaling = _rope_settings(raw, source)
        num_layers = fields.positive_int("num_hidden_layers")
        features = families.features(model_type, raw, hidden_size, source)
        layer_types, window = families.layer_types(model_type, raw, num_layers, source)
        rotary_dim = families.rotary_dim(raw, rope_scaling, head_dim, source)
        return cls(
            architecture=architecture,
            model_type=model_type,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=fields.positive_int("intermediate_size"),
            vocab_size=fields.positive_int("vocab_size"),
            max_position_embeddings=fields.positive_int("max_position_embeddings"),
            rms_norm_eps=fields.positive_float("rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(raw, generation_config or {}, source),
            bos_token_id=_optional_token_id(raw.get("bos_token_id"), "bos_token_id", source),
            torch_dtype=_declared_dtype(raw),
            features=features,
            layer_types=layer_types,
            sliding_window=window,
            rope_local_theta=families.local_theta(model_type, raw, source),
            rotary_dim=rotary_dim,
            moe=families.moe(model_type, raw, num_layers, source),
            quantization=parse_quantization_config(raw.get("quantization_config"), source),
        )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ModelLoadError(f"missing file {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object at top level")
    return data


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if not archs:
        # Configs saved without a model carry only model_type.
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        model_type = raw.get("model_type")
        if model_type in by_type:
            return by_type[model_type]
        raise ModelLoadError(
            f"{source}: no 'architectures' field and model_type {model_type!r} is not one of "
            f"{sorted(by_type)}"
        )
    if not isinstance(archs, list) or len(archs) != 1:
        raise ModelLoadError(f"{source}: expected exactly one entry in 'architectures', got {archs!r}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported architecture {arch!r}; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} (docs/models.md)"
        )
    return arch


def _rope_settings(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """Theta and the scaling dict, from transformers 5 ``rope_parameters`` or 4.x fields."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ModelLoadError(f"{source}: rope_parameters must be an object, got {params!r}")
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]  # per-layer-type form
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        scaling = dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", 10000.0)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
        )
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise ModelLoadError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "longrope":
        # Phi-3 keeps the original context at the top level; LongRoPE's default attention
        # factor comes from the ratio of the two contexts.
        original = scaling.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise ModelLoadError(f"{source}: longrope needs original_max_position_embeddings, got {original!r}")
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:
            scaling["factor"] = raw.get("max_position_embeddings", original) / original
    return float(theta), scaling


def _token_id_list(value: Any, name: str, source: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ModelLoadError(f"{source}: {name} must be a token id or a list of them, got {value!r}")
    return list(values)


def _optional_token_id(value: Any, name: str, source: str) -> int | None:
    ids = _token_id_list(value, name, source)
    return ids[0] if ids else None


def _eos_ids(raw: dict[str, Any], gen: dict[str, Any], source: str) -> list[int]:
    ids = _token_id_list(raw.get("eos_token_id"), "eos_token_id", source)
    ids += _token_id_list(gen.get("eos_token_id"), "eos_token_id", "generation_config.json")
    return list(dict.fromkeys(ids))


def _declared_dtype(raw: dict[str, Any]) -> str | None:
    value = raw.get("dtype", raw.get("torch_dtype"))
    return str(value) if value is not None else None
