"""What the engine needs to know about a Hugging Face checkpoint, read from its JSON files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded: a file, field or tensor is missing or wrong."""


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


@dataclass(frozen=True)
class ArchitectureFeatures:
    """How one supported architecture differs from plain Llama."""

    qkv_bias: bool = False  # q/k/v projections carry a bias
    o_proj_bias: bool = False  # the output projection carries a bias
    mlp_bias: bool = False  # gate/up/down projections carry a bias
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary


# architecture name in config.json -> the model_type transformers writes for it.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# Rope types this engine can build a cos/sin cache for (see models.rotary).
SUPPORTED_ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "llama3"})


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
        fields = _ConfigFields(raw, source)
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
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelLoadError(f"{source}: hidden_act {hidden_act!r} is not supported (only silu)")
        _check_full_attention(raw, source)
        rope_theta, rope_scaling = _rope_settings(raw, source)
        features = _features(model_type, raw)
        return cls(
            architecture=architecture,
            model_type=model_type,
            hidden_size=hidden_size,
            num_layers=fields.positive_int("num_hidden_layers"),
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
        )


class _ConfigFields:
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


def _check_full_attention(raw: dict[str, Any], source: str) -> None:
    if raw.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: use_sliding_window=true is not supported")
    layer_types = raw.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ModelLoadError(f"{source}: only full_attention layers are supported, got {layer_types!r}")
    partial = raw.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor {partial!r} is not supported")


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
    return float(theta), scaling


def _features(model_type: str, raw: dict[str, Any]) -> ArchitectureFeatures:
    if model_type == "qwen2":
        return ArchitectureFeatures(qkv_bias=True)
    attention_bias = bool(raw.get("attention_bias", False))
    mlp_bias = bool(raw.get("mlp_bias", False)) if model_type == "llama" else False
    return ArchitectureFeatures(
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=mlp_bias,
        qk_norm=model_type == "qwen3",
    )


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
