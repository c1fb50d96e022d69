"""The CPU backend: the PyTorch reference ops plus a native decode-attention kernel.

``kernels/csrc/paged_attention_cpu.cpp`` reads the paged KV cache in place for
sequences with one query token (decode), where the PyTorch path has to gather every
sequence's blocks into a padded copy first, once per layer per step. Prefill chunks,
cache writes, RMSNorm and rotary are the reference implementations.

The C++ source is compiled on first use with ``torch.utils.cpp_extension`` (about half
a minute on 2 cores; needs a C++ compiler and ``ninja``) into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and loaded from there
afterwards. ``native_available()`` says whether that worked; the engine falls back to
the ``torch`` backend when it did not.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from typing import Any

import torch

from kernels.reference import (
    plan_attention,
    prefill_attention,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
)

__all__ = ["native_available", "paged_attention", "reshape_and_cache", "rms_norm", "rotary_embedding"]

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "paged_attention_cpu.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def _cpu_fingerprint() -> str:
    """Short hash of the CPU's model and flags: ``-march=native`` builds differ per CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:10]


@functools.cache
def native_available() -> bool:
    """Build (first time) and load the native kernels; False, logged, when that fails."""
    if hasattr(torch.ops, "tandem_cpu") and hasattr(torch.ops.tandem_cpu, "paged_attention_decode"):
        return True
    try:
        from torch.utils.cpp_extension import load

        load(
            name=f"tandem_cpu_kernels_{_cpu_fingerprint()}",
            sources=[_SOURCE],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja: the PyTorch path still works
        logger.warning("native CPU kernels unavailable, using the PyTorch reference: %s", exc)
        return False
    return True


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    workspace: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.paged_attention``; decode rows in place."""
    if out is None:
        out = torch.empty_like(query)
    plan = plan_attention(
        query_start_loc, seq_lens, block_tables, key_cache.shape[1], query.device, workspace, False
    )
    prefill_attention(query, key_cache, value_cache, plan, scale, out)
    if plan.decode is not None:
        torch.ops.tandem_cpu.paged_attention_decode(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            plan.decode.tokens,
            plan.decode.seqs,
            scale,
            out,
        )
    return out
