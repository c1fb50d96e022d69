"""Read a PEFT-format LoRA adapter into per-module (A, B) pairs, checked against the model.

PEFT's ``save_pretrained`` writes ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ...) and ``adapter_model.safetensors`` with tensors
named ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``:
A is ``[r, in_features]``, B is ``[out_features, r]``, and the layer computes
``y = W x + scale * B (A x)`` with ``scale = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from tandem.protocol.lora import LoRARequest
from tandem.protocol.model_config import ModelConfig
from tandem.protocol.sampling_params import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT module name -> (our fused module under a layer, slice index in its output rows).
TARGET_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)

PATH_FIELD = "lora_request.lora_path"


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of that projection in ``config``."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


@dataclass
class LoRAAdapter:
    """One adapter in host memory. ``weights[(layer, module)] = (A [r, in], B [out, r] * scale)``."""

    request: LoRARequest
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _bad(value: object, reason: str) -> InvalidRequestError:
    return InvalidRequestError(PATH_FIELD, value, reason)


def read_adapter_config(path: str) -> dict:
    if not path or not os.path.isdir(path):
        raise _bad(path, "no such adapter directory")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise _bad(path, f"not a PEFT adapter: {CONFIG_FILE} is missing")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _bad(path, f"{CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise _bad(path, f"{CONFIG_FILE} is not a JSON object")
    return config


def load_adapter(
    request: LoRARequest, model_config: ModelConfig, max_lora_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Read and check the adapter at ``request.lora_path``; raise InvalidRequestError naming
    ``lora_request.lora_path`` when it is missing, malformed or does not fit the model."""
    path = request.lora_path
    config = read_adapter_config(path)
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _bad(path, f"peft_type {peft_type!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, int | float):
        raise _bad(path, f"{CONFIG_FILE} needs a positive integer r and a number lora_alpha")
    if rank > max_lora_rank:
        raise _bad(path, f"adapter rank r={rank} exceeds max_lora_rank={max_lora_rank}")
    if config.get("bias", "none") != "none":
        raise _bad(path, f"bias={config.get('bias')!r} adapters are not supported (only 'none')")
    if config.get("modules_to_save"):
        raise _bad(path, f"modules_to_save={config['modules_to_save']} is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise _bad(path, "per-module rank_pattern / alpha_pattern is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise _bad(path, f"target modules {unknown} are not in the model (it has {sorted(TARGET_MODULES)})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise _bad(path, f"not a PEFT adapter: {WEIGHTS_FILE} is missing")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                m = _KEY.match(key)
                if m is None:
                    raise _bad(path, f"unexpected tensor {key!r} (only lora_A/lora_B of {sorted(TARGET_MODULES)})")
                layer, module, half = int(m.group(1)), m.group(3), m.group(4)
                if module not in TARGET_MODULES:
                    raise _bad(path, f"target module {module!r} is not in the model")
                halves.setdefault((layer, module), {})[half] = f.get_tensor(key)
    except InvalidRequestError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise _bad(path, f"{WEIGHTS_FILE} is unreadable ({e})") from e
    if not halves:
        raise _bad(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    shapes = module_shapes(model_config)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in sorted(halves.items()):
        if layer >= model_config.num_layers:
            raise _bad(path, f"layer {layer} is beyond the model's {model_config.num_layers} layers")
        if set(pair) != {"A", "B"}:
            raise _bad(path, f"layer {layer} {module} lacks lora_{'A' if 'A' not in pair else 'B'}")
        a, b = pair["A"], pair["B"]
        in_f, out_f = shapes[module]
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise _bad(
                path,
                f"layer {layer} {module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit "
                f"r={rank} and the model's [{out_f}, {in_f}] projection",
            )
        weights[(layer, module)] = (a.to(dtype), (b.float() * scaling).to(dtype))
    modules = tuple(sorted({m for _, m in weights}))
    return LoRAAdapter(request, rank, scaling, modules, weights)
