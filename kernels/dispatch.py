"""One op layer for the model code: picks the PyTorch or the Triton implementation.

The model calls ``ops.paged_attention(...)`` etc. on the ``KernelOps`` it was given and
never knows which backend runs. Triton is imported only when the Triton backend is
asked for, so the CPU path never imports it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelOps:
    """The kernels one model forward uses; see ``kernels.reference`` for signatures."""

    name: str
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., Any]
    rms_norm: Callable[..., Any]
    rotary_embedding: Callable[..., None]
    # rotary_embedding then reshape_and_cache of the rotated key (one kernel on Triton)
    rotary_and_cache: Callable[..., None]
    silu_and_mul: Callable[..., Any]
    gelu_tanh_and_mul: Callable[..., Any]
    # paged_attention with ``sliding_window=`` and ``softcap=`` (sliding-window and
    # Gemma 2 layers); the PyTorch reference on every backend today.
    windowed_attention: Callable[..., Any]
    apply_token_bitmask: Callable[..., None]
    # ``x @ w.T + b`` for the few rows of small-batch decode ([M, K] x [N, K] -> [M, N],
    # M <= rows_max) on the backend's own kernel; None: every linear is F.linear.
    small_rows_linear: Callable[..., Any] | None = None
    small_rows_max: int = 0


def get_ops(backend: str, gemv: bool = False, split_kv: bool = False) -> KernelOps:
    """Return the ops of ``backend``: "torch" (PyTorch reference), "cpu" (reference plus
    the native in-place decode attention, built on first use) or "triton" (``gemv``: with
    the GEMV for linears of a few rows; ``split_kv``: small decode batches' attention
    split over the context)."""
    mod: Any
    if backend == "torch":
        from kernels import reference as mod
    elif backend == "cpu":
        from kernels import cpu_ops as mod

        if not mod.native_available():
            raise RuntimeError("the cpu attention backend's native kernel could not be built; see the log")
    elif backend == "triton":
        from kernels import triton_ops as mod  # imports triton
    else:
        raise ValueError(f"unknown attention backend {backend!r}; expected 'torch', 'cpu' or 'triton'")
    return KernelOps(
        name=backend,
        reshape_and_cache=mod.reshape_and_cache,
        paged_attention=(
            functools.partial(mod.paged_attention, split_kv=True)
            if split_kv and backend == "triton" else mod.paged_attention
        ),
        rms_norm=mod.rms_norm,
        rotary_embedding=mod.rotary_embedding,
        # Fused on Triton; elsewhere the backend's own two ops, one after the other.
        rotary_and_cache=getattr(mod, "rotary_and_cache", None)
        or _composed_rotary_and_cache(mod.rotary_embedding, mod.reshape_and_cache),
        # Native on CPU, fused on Triton; elsewhere the reference's two elementwise ops.
        silu_and_mul=getattr(mod, "silu_and_mul", _reference_silu_and_mul),
        gelu_tanh_and_mul=_reference("gelu_tanh_and_mul"),
        windowed_attention=_reference("windowed_paged_attention"),
        # A structured-output mask: native on CPU, the (device-agnostic) reference elsewhere.
        apply_token_bitmask=getattr(mod, "apply_token_bitmask", _reference_apply_token_bitmask),
        **(_triton_gemv() if gemv and backend == "triton" else {}),
    )


def _reference(name: str) -> Callable[..., Any]:
    from kernels import reference

    return getattr(reference, name)


def _triton_gemv() -> dict[str, Any]:
    from kernels import triton_linear

    return {"small_rows_linear": triton_linear.gemv, "small_rows_max": triton_linear.MAX_ROWS}


def _composed_rotary_and_cache(
    rotary_embedding: Callable[..., None], reshape_and_cache: Callable[..., None]
) -> Callable[..., None]:
    """``rotary_and_cache`` (see ``kernels.reference``) made of a backend's two ops."""

    def rotary_and_cache(
        positions: Any,  # [num_tokens] int64
        query: Any,  # [num_tokens, num_heads, head_dim]
        key: Any,  # [num_tokens, num_kv_heads, head_dim]
        value: Any,  # [num_tokens, num_kv_heads, head_dim]
        cos_sin_cache: Any,  # [max_position, head_dim]
        key_cache: Any,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: Any,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: Any,  # [num_tokens] int64; -1 marks a padding token
    ) -> None:
        rotary_embedding(positions, query, key, cos_sin_cache)  # in place
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    return rotary_and_cache


def _reference_silu_and_mul(gate_up: Any) -> Any:
    from kernels.reference import silu_and_mul

    return silu_and_mul(gate_up)


def _reference_apply_token_bitmask(*args: Any) -> None:
    from kernels.reference import apply_token_bitmask

    apply_token_bitmask(*args)
