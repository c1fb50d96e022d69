"""The CPU backend: native kernels where they pay, the PyTorch reference elsewhere.

``kernels/csrc/paged_attention_cpu.cpp`` reads the paged KV cache in place for
sequences with one query token (decode), where the PyTorch path has to gather every
sequence's blocks into a padded copy first, once per layer per step. RMSNorm (with the
residual add), rotary embedding and the cache write are single-pass native loops: the
reference spends 5-20 small ops on each, per layer, and at decode batch sizes their
dispatch cost is most of their time. ``argmax`` is the sampler's greedy pick (torch's
CPU argmax is not vectorized). Prefill attention (float32, 16-token blocks) is a native
flash-style loop over the paged cache in place; other dtypes take the reference (SDPA).
Inputs outside a native kernel's layout or dtype contract take the reference.

The C++ source is compiled on first use with ``torch.utils.cpp_extension`` (a slow
first start; needs a C++ compiler and ``ninja``) into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and loaded from there
afterwards. ``native_available()`` says whether that worked; the engine falls back to
the ``torch`` backend when it did not. Concurrent first uses (test workers, engines
started together) build once: builders take an ``flock`` on the build directory, which
the kernel releases when a builder dies, so a build killed half-way never blocks the
next one (torch's own lock file would: it outlives its process and is waited on forever).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kernels import reference
from kernels.reference import plan_attention, prefill_attention

__all__ = [
    "apply_token_bitmask",
    "argmax",
    "native_available",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
]

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = [
    os.path.join(_CSRC, name)
    for name in (
        "paged_attention_cpu.cpp",
        "prefill_attention_cpu.cpp",
        "panel_linear_cpu.cpp",
        "int4_linear_cpu.cpp",
        "decode_layers_cpu.cpp",
        "huge_pages_cpu.cpp",
        "moe_cpu.cpp",
    )
]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
# TANDEM_CPU_ISA: which of the kernels' ISA paths to build. "native" (default): the best
# the CPU reports (AVX-512 where present, else AVX2 + FMA, else portable loops); "avx2":
# the AVX2 + FMA path on any CPU that has it (an AVX-512 machine runs what an AVX2-only
# one does: -mno-avx512f turns off every AVX-512 subset); "avx512_novnni": AVX-512
# without VNNI (Skylake-X's int8 path, vpmaddwd for vpdpwssd), on a VNNI CPU;
# "portable": no intrinsics.
_ISA_FLAGS = {
    "native": [],
    "avx2": ["-mno-avx512f"],
    "avx512_novnni": ["-mno-avx512vnni"],
    "portable": ["-mno-avx512f", "-mno-avx2", "-mno-fma"],
}


def cpu_isa() -> str:
    """The ISA path asked for by TANDEM_CPU_ISA (default native)."""
    isa = os.environ.get("TANDEM_CPU_ISA", "native").strip().lower() or "native"
    if isa not in _ISA_FLAGS:
        raise ValueError(f"TANDEM_CPU_ISA must be one of {', '.join(_ISA_FLAGS)}, got {isa!r}")
    return isa
# How long a process waits for another's build of the same extension before giving up
# (and running the PyTorch reference): far longer than a cold build takes, so that only a
# stuck builder runs it out.
_BUILD_WAIT_S = 900.0


def _cpu_fingerprint() -> str:
    """Short hash of the CPU's model and flags: ``-march=native`` builds differ per CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:10]


def _extension_name() -> str:
    """One build per CPU model/flags, torch version, source text and source directory:
    trees with different kernels (git worktrees) or at different paths (a clone beside
    the checkout) do not rebuild each other's extension, as torch's loader would for
    the same name with other source paths."""
    torch_tag = hashlib.sha256(torch.__version__.encode()).hexdigest()[:6]
    sources = hashlib.sha256(os.path.abspath(_CSRC).encode())
    headers = [os.path.join(_CSRC, name) for name in os.listdir(_CSRC) if name.endswith(".h")]
    for path in sorted([*_SOURCES, *headers]):
        with open(path, "rb") as f:
            sources.update(f.read())
    isa = "" if cpu_isa() == "native" else f"_{cpu_isa()}"
    return f"tandem_cpu_kernels_{_cpu_fingerprint()}_{torch_tag}_{sources.hexdigest()[:8]}{isa}"


def _build_directory(name: str) -> str:
    """``$TORCH_EXTENSIONS_DIR/<name>``, else ``~/.cache/torch_extensions/py3XY_cpu/<name>``."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    )
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _exclusive(path: str, wait_s: float) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path``; yields False if not had within ``wait_s``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.2)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@functools.cache
def native_available() -> bool:
    """Build (first time) and load the native kernels; False, logged, when that fails."""
    if hasattr(torch.ops, "tandem_cpu") and hasattr(torch.ops.tandem_cpu, "decode_layers"):
        return True
    name = _extension_name()
    try:
        from torch.utils.cpp_extension import load

        build_dir = _build_directory(name)
        with _exclusive(os.path.join(build_dir, "tandem-build.flock"), _BUILD_WAIT_S) as held:
            if not held:
                raise TimeoutError(f"another process held the build lock in {build_dir} for {_BUILD_WAIT_S:.0f} s")
            # Holding the flock, no other builder is alive: a torch lock file here is stale.
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(build_dir, "lock"))
            load(
                name=name,
                sources=_SOURCES,
                extra_cflags=_CFLAGS + _ISA_FLAGS[cpu_isa()],
                extra_ldflags=["-fopenmp"],
                build_directory=build_dir,
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
    if plan.prefill_seqs is not None:
        if query.dtype == torch.float32 and key_cache.dtype == torch.float32 and key_cache.shape[1] == 16:
            torch.ops.tandem_cpu.prefill_attention(
                query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, plan.prefill_seqs, scale, out
            )
        else:
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


def rms_norm(
    x: torch.Tensor,  # [..., d]
    weight: torch.Tensor,  # [d]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., d]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``kernels.reference.rms_norm``."""
    d = x.shape[-1]
    if x.device.type != "cpu" or weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return reference.rms_norm(x, weight, eps, residual)
    rows = _rows(x, d)
    out = torch.empty(rows.shape, dtype=x.dtype)
    if residual is None:
        torch.ops.tandem_cpu.rms_norm(out, rows, weight.contiguous(), eps)
        return out.view(x.shape), None
    new_residual = torch.empty(rows.shape, dtype=x.dtype)
    torch.ops.tandem_cpu.fused_add_rms_norm(out, new_residual, rows, _rows(residual, d), weight.contiguous(), eps)
    return out.view(x.shape), new_residual.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """Same contract as ``kernels.reference.silu_and_mul``; one pass over float32 rows."""
    if gate_up.device.type != "cpu" or gate_up.dtype != torch.float32 or gate_up.dim() != 2:
        return reference.silu_and_mul(gate_up)
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=torch.float32)
    torch.ops.tandem_cpu.silu_and_mul(out, gate_up)
    return out


def zeros_on_huge_pages(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on transparent huge pages where the kernel offers them (see
    ``kernels/csrc/huge_pages_cpu.cpp``); plain ``torch.zeros`` without the extension."""
    return empty_on_huge_pages(shape, dtype).zero_()


def empty_on_huge_pages(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor on transparent huge pages where the kernel offers them;
    plain ``torch.empty`` without the extension."""
    if not native_available():
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.ops.tandem_cpu.empty_huge(list(shape), dtype)


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:  # [..., d] -> [rows, d], rows contiguous
    rows = t.reshape(-1, d)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos | sin
) -> None:
    """Same contract as ``kernels.reference.rotary_embedding`` (in place)."""
    if (
        query.device.type != "cpu"
        or cos_sin_cache.dtype != torch.float32
        or query.dtype != key.dtype
        or query.stride(-1) != 1
        or key.stride(-1) != 1
    ):
        reference.rotary_embedding(positions, query, key, cos_sin_cache)
        return
    torch.ops.tandem_cpu.rotary_embedding(positions.contiguous(), query, key, cos_sin_cache)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padding token
) -> None:
    """Same contract as ``kernels.reference.reshape_and_cache``."""
    d = key.shape[-1]
    if (
        key.device.type != "cpu"
        or key.dtype != key_cache.dtype
        or value.dtype != key_cache.dtype
        or key.stride(-1) != 1
        or key.stride(-2) != d
        or value.stride(-1) != 1
        or value.stride(-2) != d
        or slot_mapping.dtype != torch.int64
    ):
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    torch.ops.tandem_cpu.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.contiguous())


def argmax(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
    """``logits.argmax(dim=-1)`` (first index of the maximum), natively for float32."""
    if (
        logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or logits.shape[1] == 0
    ):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    torch.ops.tandem_cpu.argmax_rows(logits, out)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """``reference.apply_token_bitmask``, natively for float32 CPU logits."""
    if (
        logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or bitmask.dtype != torch.int32
        or rows.dtype != torch.int64
    ):
        reference.apply_token_bitmask(logits, bitmask, rows)
        return
    torch.ops.tandem_cpu.apply_token_bitmask(logits, bitmask.contiguous(), rows.contiguous())


def seeded_uniform(seeds: Sequence[int], positions: Sequence[int], vocab_size: int) -> torch.Tensor:
    """``reference.seeded_uniform``, natively: [S, V] float32 CPU uniforms."""
    out = torch.empty(len(seeds), vocab_size, dtype=torch.float32)
    torch.ops.tandem_cpu.seeded_uniform(out, reference.seeded_offsets(seeds, positions, vocab_size))
    return out
