"""Rotary position embedding tables: the ``[max_position, head_dim]`` cos|sin cache.

Row ``p`` holds ``cos(p * inv_freq)`` in ``[:head_dim/2]`` and ``sin(p * inv_freq)`` in
``[head_dim/2:]``, the layout ``kernels.reference.rotary_embedding`` reads. Each rope
type only changes ``inv_freq``; add a type by adding a function to ``_INV_FREQ_BUILDERS``.
LongRoPE (Phi-3) is the exception: two sets of frequencies, by position, and a factor on
cos and sin (``_longrope_cache``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from tandem.protocol.model_config import ModelLoadError


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """``[head_dim / 2]`` float32 inverse frequencies ``theta^(-2i / head_dim)``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _linear_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    # Positions divided by factor == frequencies divided by factor.
    return default_inv_freq(head_dim, theta) / float(_required(scaling, "factor"))


def _llama3_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: slow down low frequencies, keep high ones, blend in between."""
    inv_freq = default_inv_freq(head_dim, theta)  # [head_dim / 2]
    factor = float(_required(scaling, "factor"))
    low_freq_factor = float(_required(scaling, "low_freq_factor"))
    high_freq_factor = float(_required(scaling, "high_freq_factor"))
    original_len = float(_required(scaling, "original_max_position_embeddings"))
    if high_freq_factor <= low_freq_factor:
        raise ModelLoadError(
            f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
            f"{high_freq_factor} <= {low_freq_factor}"
        )
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are stretched by factor; short ones kept.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _longrope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any], key: str) -> torch.Tensor:
    factors = torch.tensor(_required(scaling, key), dtype=torch.float32)
    if factors.shape != (head_dim // 2,):
        raise ModelLoadError(f"longrope {key} must hold {head_dim // 2} numbers, got {tuple(factors.shape)}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (factors * theta**exponents)


def _longrope_cache(head_dim: int, max_position: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Positions below ``original_max_position_embeddings`` rotate by the short factors,
    the rest by the long ones, and cos/sin carry LongRoPE's attention factor. (transformers
    picks one set per forward by its longest position; the two agree for decode and for
    any prefill that does not cross the original context.)"""
    original = int(_required(scaling, "original_max_position_embeddings"))
    factor = float(_required(scaling, "factor"))
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    positions = torch.arange(max_position, dtype=torch.int64).float()[:, None]  # [max_position, 1]
    short = positions * _longrope_inv_freq(head_dim, theta, scaling, "short_factor")
    long = positions * _longrope_inv_freq(head_dim, theta, scaling, "long_factor")
    angles = torch.where(positions < original, short, long)  # [max_position, head_dim / 2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1) * float(attention_factor)


_INV_FREQ_BUILDERS: dict[str, Callable[[int, float, dict[str, Any]], torch.Tensor]] = {
    "default": lambda head_dim, theta, _scaling: default_inv_freq(head_dim, theta),
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
    "longrope": lambda head_dim, theta, scaling: _longrope_inv_freq(head_dim, theta, scaling, "short_factor"),
}


def _required(scaling: dict[str, Any], key: str) -> Any:
    if key not in scaling:
        rope_type = scaling.get("rope_type", "?")
        raise ModelLoadError(f"rope scaling of type {rope_type!r} needs the field {key!r}")
    return scaling[key]


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    theta: float,
    rope_scaling: dict[str, Any] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Return the float32 ``[max_position, head_dim]`` cos|sin table for these settings."""
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    scaling = rope_scaling or {}
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    builder = _INV_FREQ_BUILDERS.get(rope_type)
    if builder is None:
        raise ModelLoadError(
            f"rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(sorted(_INV_FREQ_BUILDERS))}"
        )
    if rope_type == "longrope":
        cache = _longrope_cache(head_dim, max_position, theta, scaling)
        return cache.to(device) if device is not None else cache
    inv_freq = builder(head_dim, theta, scaling)  # [head_dim / 2] float32
    positions = torch.arange(max_position, dtype=torch.int64).float()  # [max_position]
    angles = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [max_position, head_dim]
    return cache.to(device) if device is not None else cache
