"""Triton implementations of Tandem's kernels, with the signatures of ``kernels.reference``.

Importing this module imports triton. Each op is split in two:
- ``plan_<op>`` validates the inputs and returns a ``KernelLaunch`` (kernel, grid,
  arguments, compile-time constants). It touches no device, so tests can also hand the
  same launch to ``triton.compile`` for a GPU target on a machine without one.
- ``<op>`` checks that the tensors can be launched on, runs the plan and returns what the
  reference returns.

With ``TRITON_INTERPRET=1`` set before triton is imported, the kernels run on CPU
tensors through Triton's interpreter. The interpreter gets bfloat16 arithmetic wrong, so
there the attention kernel upcasts bfloat16 to float32 right after loading.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from triton.compiler import ASTSource

from kernels.triton_attention import (
    paged_attention_kernel,
    split_kv_attention_kernel,
    split_kv_reduce_kernel,
)
from kernels.triton_cache import reshape_and_cache_kernel
from kernels.triton_layers import (
    rms_norm_kernel,
    rotary_and_cache_kernel,
    rotary_embedding_kernel,
    silu_and_mul_kernel,
)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_TRITON_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass(frozen=True)
class KernelLaunch:
    """Everything needed to launch (or compile) one kernel.

    ``args`` holds the runtime arguments in the kernel's parameter order; ``constexprs``
    the compile-time constants that follow them.
    """

    kernel: Any  # triton JITFunction, or InterpretedFunction under TRITON_INTERPRET=1
    grid: tuple[int, ...]
    args: dict[str, Any]
    constexprs: dict[str, int | bool] = field(default_factory=dict)
    num_warps: int = 4

    def run(self) -> None:
        if any(n == 0 for n in self.grid):
            return
        self.kernel[self.grid](**self.args, **self.constexprs, num_warps=self.num_warps)

    def ast_source(self) -> ASTSource:
        """This launch as ``triton.compile`` input, specialised the way ``@triton.jit``
        specialises a real launch: integer arguments equal to 1 become constants, and
        tensors (device allocations are 16-byte aligned) and integers divisible by 16 are
        marked ``tt.divisibility=16``, which lets Triton vectorise loads."""
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        attrs: dict[tuple[int, ...], list[list[Any]]] = {}
        for index, (name, value) in enumerate(self.args.items()):
            if _is_int(value) and value == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
                continue
            signature[name] = _triton_type(value)
            if isinstance(value, torch.Tensor) or (_is_int(value) and value % 16 == 0):
                attrs[(index,)] = [["tt.divisibility", 16]]
        signature.update({name: "constexpr" for name in self.constexprs})
        constexprs.update(self.constexprs)
        return ASTSource(fn=self.kernel, signature=signature, constexprs=constexprs, attrs=attrs)


class PlanCache:
    """Checked launches by the layout of their tensors (shape, strides, dtype, device)
    and their other arguments.

    The layers of a step call each op on tensors of one layout (their own weights and
    caches), so the checks and the plan of the first call hold for the rest: a hit only
    launches with the new tensors (~40 us of checks per attention call saved, x layers x
    steps). Entries keep no tensor; the cache is emptied at ``max_entries``."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        # key -> (kernel, grid, the non-tensor arguments, constexprs, num_warps)
        self._plans: dict[tuple[Any, ...], tuple[Any, tuple[int, ...], dict[str, Any], dict[str, Any], int]] = {}

    def launch(self, key: tuple[Any, ...], tensors: dict[str, torch.Tensor], plan: Any) -> None:
        """Run the cached plan of ``key`` on ``tensors`` (kernel argument name -> tensor),
        or ``plan()`` (which checks and returns a KernelLaunch over these tensors) first."""
        entry = self._plans.get(key)
        if entry is None:
            launch = plan()
            if len(self._plans) >= self.max_entries:
                self._plans.clear()
            static = {k: v for k, v in launch.args.items() if not isinstance(v, torch.Tensor)}
            entry = (launch.kernel, launch.grid, static, launch.constexprs, launch.num_warps)
            self._plans[key] = entry
        kernel, grid, static, constexprs, num_warps = entry
        if any(n == 0 for n in grid):
            return
        kernel[grid](**static, **tensors, **constexprs, num_warps=num_warps)


def layout(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What a plan depends on of a tensor: shape, strides, dtype, device."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


_PLANS = PlanCache()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _triton_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_DTYPE_NAMES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for kernel argument {value!r}")


def interpreting() -> bool:
    """True when triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _require_dim(t: torch.Tensor, ndim: int, name: str) -> None:
    _require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def _require_dtype(t: torch.Tensor, dtypes: tuple[torch.dtype, ...], name: str) -> None:
    _require(t.dtype in dtypes, f"{name} has dtype {t.dtype}; expected one of {dtypes}")


def _require_unit_last_stride(t: torch.Tensor, name: str) -> None:
    _require(t.shape[-1] <= 1 or t.stride(-1) == 1, f"{name} must be contiguous in its last dim")


def _require_launchable(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and a CUDA one unless the interpreter runs the kernels."""
    devices = {t.device for t in tensors}
    _require(len(devices) == 1, f"tensors are on different devices: {sorted(map(str, devices))}")
    device = next(iter(devices))
    _require(
        interpreting() or device.type == "cuda",
        f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 "
        "before importing triton to run them on CPU",
    )


# ---------------------------------------------------------------- reshape_and_cache


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    _require_dim(key_cache, 4, "key_cache")
    _require(
        key_cache.shape == value_cache.shape,
        f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ",
    )
    _require_dtype(key_cache, _FLOAT_DTYPES, "key_cache")
    _require_dtype(value_cache, _FLOAT_DTYPES, "value_cache")
    _require_unit_last_stride(key_cache, "key_cache")
    _require_unit_last_stride(value_cache, "value_cache")


def _check_cache_write(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 marks a padding token
) -> None:
    """The inputs of a KV-cache write (``reshape_and_cache``, ``rotary_and_cache``)."""
    _require_dim(key, 3, "key")
    _require(
        key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    )
    _check_cache_pair(key_cache, value_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    _require(
        tuple(key_cache.shape[2:]) == (num_kv_heads, head_dim),
        f"cache heads/dim {tuple(key_cache.shape[2:])} != key's {(num_kv_heads, head_dim)}",
    )
    _require_dtype(key, _FLOAT_DTYPES, "key")
    _require_dtype(value, _FLOAT_DTYPES, "value")
    _require_unit_last_stride(key, "key")
    _require_unit_last_stride(value, "value")
    _require(
        slot_mapping.shape == (num_tokens,),
        f"slot_mapping must have shape ({num_tokens},), got {tuple(slot_mapping.shape)}",
    )
    _require_dtype(slot_mapping, _INDEX_DTYPES, "slot_mapping")


def plan_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 marks a padding token
) -> KernelLaunch:
    _check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    args = {
        "key_ptr": key,
        "value_ptr": value,
        "key_cache_ptr": key_cache,
        "value_cache_ptr": value_cache,
        "slot_mapping_ptr": slot_mapping,
        "stride_k_tok": key.stride(0),
        "stride_k_head": key.stride(1),
        "stride_v_tok": value.stride(0),
        "stride_v_head": value.stride(1),
        "stride_kc_block": key_cache.stride(0),
        "stride_kc_row": key_cache.stride(1),
        "stride_kc_head": key_cache.stride(2),
        "stride_vc_block": value_cache.stride(0),
        "stride_vc_row": value_cache.stride(1),
        "stride_vc_head": value_cache.stride(2),
    }
    constexprs = {
        "NUM_KV_HEADS": num_kv_heads,
        "HEADS_P": _pow2(num_kv_heads),
        "HEAD_DIM": head_dim,
        "HEAD_P": _pow2(head_dim),
        "BLOCK_SIZE": key_cache.shape[1],
    }
    return KernelLaunch(reshape_and_cache_kernel, (num_tokens,), args, constexprs, num_warps=4)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padding token
) -> None:
    """Scatter new K/V rows into their cache slots; slots < 0 are skipped."""
    launch = plan_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    _require_launchable(key, value, key_cache, value_cache, slot_mapping)
    launch.run()


# ---------------------------------------------------------------- paged_attention


@dataclass(frozen=True)
class AttentionTiles:
    """Tile sizes of the attention kernel: query rows and keys per step."""

    block_m: int  # query rows per program (tokens x padded group); power of two, >= 16
    tile_n: int  # keys per inner iteration; power of two, >= 16


def default_attention_tiles(
    num_tokens: int, num_seqs: int, group: int, head_dim: int, compute_f32: bool
) -> AttentionTiles:
    """Untuned defaults (no GPU was at hand to tune them): small query tiles for
    decode-only batches, larger ones when prefill chunks are present."""
    decode_only = num_tokens <= num_seqs
    block_m = max(16 if decode_only else 64, _pow2(group))
    tile_n = 32 if (compute_f32 or head_dim > 128) else 64
    return AttentionTiles(block_m=block_m, tile_n=tile_n)


def _attention_num_warps(block_m: int, head_dim: int, compute_f32: bool) -> int:
    """8 warps keep large tiles out of register spills on sm_90 (ptxas -v): the fp32
    path multiplies on CUDA cores and needs them from 2048 accumulator elements on."""
    tile_elems = block_m * _pow2(head_dim)
    return 8 if tile_elems >= (2048 if compute_f32 else 8192) else 4


# The split-KV rule (flash-decoding; kernels/triton_attention.py). On a decode-only batch
# the unified kernel runs num_seqs * num_kv_heads programs, each over a whole context: 8
# programs for an H100/H200's 132 SMs at batch 1 on Llama-3.2-1B (6.8 us a layer on an
# H200, benchmarks/NOTES.md). So a batch takes the split path when
#   - it is decode-only: num_tokens <= num_seqs (one token per sequence; a batch with
#     empty sequences, so that another may hold several tokens, still comes out right), and
#   - the unified grid leaves at least half the SMs idle: 2 * num_seqs * num_kv_heads <= SMs
#     (up to 66 programs on 132 SMs; batch <= 8 for 8 KV heads).
# Its split count depends on the shapes and the SM count only, never on seq_lens (the
# launch is captured in CUDA graphs and replayed at other lengths; the kernel sizes the
# segments on the device): the largest power of two <= cdiv(2 * SMs, num_seqs *
# num_kv_heads), clamped to [2, 32], i.e. one to two programs per SM before the clamp
# (batch 1 x 8 KV heads: 32 splits, 256 programs; batch 8: 4 splits, 256 programs).
# Segments are whole key tiles, so short contexts leave the last splits empty (they exit
# after writing an empty partial). Untuned (no GPU was at hand), so opt-in:
# ``paged_attention(split_kv=True)``, which the engine's ``--triton-split-kv`` binds.
_DEFAULT_NUM_SMS = 132  # H100 SXM / H200; used where the tensors are not on a GPU
_MIN_SPLITS = 2
_MAX_SPLITS = 32


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_NUM_SMS


def split_kv_splits(num_seqs: int, num_kv_heads: int, num_sms: int = _DEFAULT_NUM_SMS) -> int:
    """Key segments per sequence on the split path: the largest power of two <=
    ``cdiv(2 * num_sms, num_seqs * num_kv_heads)``, clamped to [2, 32]."""
    per_program = triton.cdiv(2 * num_sms, max(num_seqs * num_kv_heads, 1))
    splits = 1 << (per_program.bit_length() - 1)
    return min(max(splits, _MIN_SPLITS), _MAX_SPLITS)


def use_split_kv(
    num_tokens: int, num_seqs: int, num_kv_heads: int, num_sms: int = _DEFAULT_NUM_SMS
) -> bool:
    """Whether ``paged_attention`` takes the split-KV path (the rule above)."""
    decode_only = 0 < num_tokens <= num_seqs
    return decode_only and 2 * num_seqs * num_kv_heads <= num_sms


def attention_num_splits(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    seq_lens: torch.Tensor,  # [num_seqs]
    split_kv: bool,
) -> int:
    """The split count ``paged_attention(split_kv=...)`` runs these tensors with; 0: the
    unified kernel. Malformed shapes get 0, so that the unified plan's checks report them."""
    if not split_kv or query.dim() != 3 or key_cache.dim() != 4 or seq_lens.dim() != 1:
        return 0
    num_tokens, num_seqs, num_kv_heads = query.shape[0], seq_lens.shape[0], key_cache.shape[2]
    num_sms = _num_sms(query.device)
    if not use_split_kv(num_tokens, num_seqs, num_kv_heads, num_sms):
        return 0
    return split_kv_splits(num_seqs, num_kv_heads, num_sms)


def _check_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    _require_dim(query, 3, "query")
    _check_cache_pair(key_cache, value_cache)
    _require_dtype(query, _FLOAT_DTYPES, "query")
    _require(
        key_cache.dtype == query.dtype and value_cache.dtype == query.dtype,
        f"query ({query.dtype}) and KV cache ({key_cache.dtype}, {value_cache.dtype}) "
        "dtypes must match",
    )
    _require_unit_last_stride(query, "query")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    _require(key_cache.shape[3] == head_dim, f"cache head_dim {key_cache.shape[3]} != {head_dim}")
    _require(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    _require(head_dim >= 16, f"head_dim {head_dim} < 16 is not supported")
    _require_dim(block_tables, 2, "block_tables")
    _require_dim(seq_lens, 1, "seq_lens")
    num_seqs = seq_lens.shape[0]
    _require(block_tables.shape[0] == num_seqs, "block_tables needs one row per sequence")
    _require(
        query_start_loc.shape == (num_seqs + 1,),
        f"query_start_loc must have shape ({num_seqs + 1},), got {tuple(query_start_loc.shape)}",
    )
    for t, name in ((block_tables, "block_tables"), (query_start_loc, "query_start_loc")):
        _require_dtype(t, _INDEX_DTYPES, name)
    _require_dtype(seq_lens, _INDEX_DTYPES, "seq_lens")
    _require_unit_last_stride(block_tables, "block_tables")


def _check_attention_out(query: torch.Tensor, out: torch.Tensor) -> None:
    _require(
        out.shape == query.shape and out.dtype == query.dtype,
        f"out must match query's shape and dtype, got {tuple(out.shape)} {out.dtype}",
    )
    _require_unit_last_stride(out, "out")


def _check_tiles(tiles: AttentionTiles, group: int) -> None:
    for value, name in ((tiles.block_m, "block_m"), (tiles.tile_n, "tile_n")):
        _require(value >= 16 and value == _pow2(value), f"{name} must be a power of two >= 16")
    _require(tiles.block_m >= _pow2(group), f"block_m {tiles.block_m} < query heads per KV head")


def plan_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    *,
    tiles: AttentionTiles | None = None,
    interpret: bool = False,
) -> KernelLaunch:
    """Plan the unified attention kernel; ``interpret`` selects the interpreter-safe
    float32 path for bfloat16."""
    _check_attention_inputs(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    _check_attention_out(query, out)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    compute_f32 = query.dtype == torch.float32 or (interpret and query.dtype == torch.bfloat16)
    if tiles is None:
        tiles = default_attention_tiles(num_tokens, num_seqs, group, head_dim, compute_f32)
    _check_tiles(tiles, group)
    group_p = _pow2(group)
    block_q = tiles.block_m // group_p
    # Each sequence owns a range of program ids; see kernels/triton_attention.py.
    num_programs = num_tokens // block_q + num_seqs if num_seqs > 0 else 0
    args = {
        "out_ptr": out,
        "query_ptr": query,
        "key_cache_ptr": key_cache,
        "value_cache_ptr": value_cache,
        "block_tables_ptr": block_tables,
        "query_start_loc_ptr": query_start_loc,
        "seq_lens_ptr": seq_lens,
        "scale": float(scale),
        "num_seqs": num_seqs,
        "stride_q_tok": query.stride(0),
        "stride_q_head": query.stride(1),
        "stride_o_tok": out.stride(0),
        "stride_o_head": out.stride(1),
        "stride_k_block": key_cache.stride(0),
        "stride_k_row": key_cache.stride(1),
        "stride_k_head": key_cache.stride(2),
        "stride_v_block": value_cache.stride(0),
        "stride_v_row": value_cache.stride(1),
        "stride_v_head": value_cache.stride(2),
        "stride_bt_seq": block_tables.stride(0),
    }
    constexprs = {
        "GROUP": group,
        "GROUP_P": group_p,
        "BLOCK_M": tiles.block_m,
        "BLOCK_Q": block_q,
        "TILE_N": tiles.tile_n,
        "HEAD_DIM": head_dim,
        "HEAD_P": _pow2(head_dim),
        "BLOCK_SIZE": key_cache.shape[1],
        "COMPUTE_F32": compute_f32,
    }
    grid = (num_programs, num_kv_heads)
    num_warps = _attention_num_warps(tiles.block_m, head_dim, compute_f32)
    return KernelLaunch(paged_attention_kernel, grid, args, constexprs, num_warps=num_warps)


@dataclass(frozen=True)
class SplitKVPartials:
    """Scratch of the split-KV path: one unnormalised partial result per (token, query
    head, split); float32, contiguous, on the query's device. Every entry is written by
    the split kernel before the reduce kernel reads it, so it needs no initialisation."""

    acc: torch.Tensor  # [num_tokens, num_heads, num_splits, head_dim]: sum of exp2(s - max) * v
    row_max: torch.Tensor  # [num_tokens, num_heads, num_splits]: max score, log2 units; -inf: empty
    denom: torch.Tensor  # [num_tokens, num_heads, num_splits]: sum of exp2(s - max) (0: empty)

    @staticmethod
    def empty(
        num_tokens: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
    ) -> SplitKVPartials:
        shape = (num_tokens, num_heads, num_splits)
        return SplitKVPartials(
            acc=torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
            row_max=torch.empty(shape, dtype=torch.float32, device=device),
            denom=torch.empty(shape, dtype=torch.float32, device=device),
        )


@dataclass(frozen=True)
class SplitKVLaunch:
    """The two launches of the split-KV path, to run in this order on one stream."""

    split: KernelLaunch  # grid (num_tokens, num_kv_heads, num_splits): query, KV -> partials
    reduce: KernelLaunch  # grid (num_tokens, num_heads): partials -> out

    def run(self) -> None:
        self.split.run()
        self.reduce.run()


def plan_split_kv_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    *,
    num_splits: int | None = None,
    partials: SplitKVPartials | None = None,
    tile_n: int | None = None,
    interpret: bool = False,
) -> SplitKVLaunch:
    """Plan the split-KV path (kernels/triton_attention.py) whatever the rule says.

    ``num_splits``: a power of two in [1, 64]; None: ``split_kv_splits`` for these shapes
    and this device's SM count. ``partials``: the scratch (allocated here when None).
    ``tile_n``: keys per inner iteration (default: the unified kernel's). Meant for
    decode-only batches (num_tokens == num_seqs: the split grid is then (num_seqs,
    num_kv_heads, num_splits)); any batch comes out right, a prefill chunk only slower."""
    _check_attention_inputs(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    _check_attention_out(query, out)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    compute_f32 = query.dtype == torch.float32 or (interpret and query.dtype == torch.bfloat16)
    if num_splits is None:
        num_splits = split_kv_splits(num_seqs, num_kv_heads, _num_sms(query.device))
    _require(
        1 <= num_splits <= 64 and num_splits == _pow2(num_splits),
        f"num_splits must be a power of two in [1, 64], got {num_splits}",
    )
    if tile_n is None:
        tile_n = default_attention_tiles(num_tokens, num_seqs, group, head_dim, compute_f32).tile_n
    _require(tile_n >= 16 and tile_n == _pow2(tile_n), "tile_n must be a power of two >= 16")
    if partials is None:
        partials = SplitKVPartials.empty(num_tokens, num_heads, num_splits, head_dim, query.device)
    shape = (num_tokens, num_heads, num_splits)
    for t, want, name in (
        (partials.acc, (*shape, head_dim), "acc"),
        (partials.row_max, shape, "row_max"),
        (partials.denom, shape, "denom"),
    ):
        _require(
            tuple(t.shape) == want and t.dtype == torch.float32 and t.is_contiguous(),
            f"partials.{name} must be contiguous float32 of shape {want}, "
            f"got {tuple(t.shape)} {t.dtype}",
        )
    # Rows of a program: the group's heads, padded to the 16 rows tl.dot needs at least.
    block_m = max(16, _pow2(group))
    head_p = _pow2(head_dim)
    split_args = {
        "acc_ptr": partials.acc,
        "max_ptr": partials.row_max,
        "denom_ptr": partials.denom,
        "query_ptr": query,
        "key_cache_ptr": key_cache,
        "value_cache_ptr": value_cache,
        "block_tables_ptr": block_tables,
        "query_start_loc_ptr": query_start_loc,
        "seq_lens_ptr": seq_lens,
        "scale": float(scale),
        "num_seqs": num_seqs,
        "stride_q_tok": query.stride(0),
        "stride_q_head": query.stride(1),
        "stride_k_block": key_cache.stride(0),
        "stride_k_row": key_cache.stride(1),
        "stride_k_head": key_cache.stride(2),
        "stride_v_block": value_cache.stride(0),
        "stride_v_row": value_cache.stride(1),
        "stride_v_head": value_cache.stride(2),
        "stride_bt_seq": block_tables.stride(0),
    }
    split_constexprs = {
        "NUM_HEADS": num_heads,
        "GROUP": group,
        "BLOCK_M": block_m,
        "TILE_N": tile_n,
        "HEAD_DIM": head_dim,
        "HEAD_P": head_p,
        "BLOCK_SIZE": key_cache.shape[1],
        "NUM_SPLITS": num_splits,
        "COMPUTE_F32": compute_f32,
    }
    split = KernelLaunch(
        split_kv_attention_kernel,
        (num_tokens, num_kv_heads, num_splits),
        split_args,
        split_constexprs,
        num_warps=_attention_num_warps(block_m, head_dim, compute_f32),
    )
    reduce_args = {
        "out_ptr": out,
        "acc_ptr": partials.acc,
        "max_ptr": partials.row_max,
        "denom_ptr": partials.denom,
        "stride_o_tok": out.stride(0),
        "stride_o_head": out.stride(1),
    }
    reduce_constexprs = {
        "NUM_HEADS": num_heads,
        "HEAD_DIM": head_dim,
        "HEAD_P": head_p,
        "NUM_SPLITS": num_splits,
    }
    # One program merges num_splits x head_p floats: ~16 a thread, 1 to 4 warps.
    reduce_warps = max(1, min(4, num_splits * head_p // 512))
    reduce = KernelLaunch(
        split_kv_reduce_kernel,
        (num_tokens, num_heads),
        reduce_args,
        reduce_constexprs,
        num_warps=reduce_warps,
    )
    return SplitKVLaunch(split=split, reduce=reduce)


def _split_kv_partials(
    workspace: dict[str, Any] | None,
    num_tokens: int,
    num_heads: int,
    num_splits: int,
    head_dim: int,
    device: torch.device,
) -> SplitKVPartials:
    """The step's partials from ``workspace`` (allocated by its first layer), or new
    ones without a workspace. The layers of a step share them: they run one after the
    other on one stream, so a layer's split kernel writes them only after the previous
    layer's reduce has read them. (Under CUDA-graph capture they come from the graph's
    memory pool, as any allocation there.)"""
    key = (num_tokens, num_heads, num_splits, head_dim, device)
    if workspace is None:
        return SplitKVPartials.empty(*key)
    by_shape: dict[tuple[Any, ...], SplitKVPartials]
    by_shape = workspace.setdefault("triton_split_kv_partials", {})
    partials = by_shape.get(key)
    if partials is None:
        partials = by_shape[key] = SplitKVPartials.empty(*key)
    return partials


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    workspace: dict[str, Any] | None = None,  # per-step scratch: the split path's partials
    split_kv: bool = False,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and itself.

    One kernel launch for decode tokens and prefill chunks; softmax in float32. With
    ``split_kv``, small decode-only batches take the split-KV path instead (two launches;
    the rule is next to ``default_attention_tiles``), its scratch kept in ``workspace``
    for the step's layers.
    """
    if out is None:
        out = torch.empty_like(query)
    tensors = {
        "out_ptr": out, "query_ptr": query, "key_cache_ptr": key_cache, "value_cache_ptr": value_cache,
        "block_tables_ptr": block_tables, "query_start_loc_ptr": query_start_loc, "seq_lens_ptr": seq_lens,
    }
    layouts = tuple(map(layout, tensors.values()))
    num_splits = attention_num_splits(query, key_cache, seq_lens, split_kv)
    if num_splits:
        num_tokens, num_heads, head_dim = query.shape
        partials = _split_kv_partials(
            workspace, num_tokens, num_heads, num_splits, head_dim, query.device
        )
        planned: list[SplitKVLaunch] = []

        def plan_split() -> SplitKVLaunch:  # checks once for both launches
            if not planned:
                planned.append(plan_split_kv_attention(
                    query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                    out, num_splits=num_splits, partials=partials, interpret=interpreting(),
                ))  # fmt: skip
                _require_launchable(*tensors.values())
            return planned[0]

        scratch = {
            "acc_ptr": partials.acc, "max_ptr": partials.row_max, "denom_ptr": partials.denom
        }
        # The partials' layout follows from the query's and num_splits: not in the keys.
        split_tensors = {**scratch, **tensors}
        del split_tensors["out_ptr"]
        _PLANS.launch(
            ("paged_attention_split", scale, num_splits, *layouts), split_tensors,
            lambda: plan_split().split,
        )  # fmt: skip
        _PLANS.launch(
            ("paged_attention_reduce", num_splits, *layouts), {"out_ptr": out, **scratch},
            lambda: plan_split().reduce,
        )  # fmt: skip
        return out

    def plan() -> KernelLaunch:
        launch = plan_paged_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out,
            interpret=interpreting(),
        )
        _require_launchable(*tensors.values())
        return launch

    _PLANS.launch(("paged_attention", scale, *layouts), tensors, plan)
    return out


# ---------------------------------------------------------------- rms_norm


def plan_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None,  # [num_tokens, hidden]
    out: torch.Tensor,  # [num_tokens, hidden], written
    new_residual: torch.Tensor | None,  # [num_tokens, hidden], written iff residual is given
) -> KernelLaunch:
    _require_dim(x, 2, "x")
    _require_dtype(x, _FLOAT_DTYPES, "x")
    num_tokens, hidden = x.shape
    _require(weight.shape == (hidden,), f"weight must have shape ({hidden},)")
    _require_dtype(weight, _FLOAT_DTYPES, "weight")
    _require(out.shape == x.shape, "out must have x's shape")
    has_residual = residual is not None
    _require(
        (new_residual is not None) == has_residual,
        "new_residual must be given exactly when residual is",
    )
    row_tensors = [(x, "x"), (out, "out")]
    if residual is not None and new_residual is not None:
        _require(residual.shape == x.shape, "residual must have x's shape")
        _require(new_residual.shape == x.shape, "new_residual must have x's shape")
        row_tensors += [(residual, "residual"), (new_residual, "new_residual")]
    for t, name in row_tensors:
        _require_dtype(t, _FLOAT_DTYPES, name)
        _require_unit_last_stride(t, name)
    _require(weight.stride(0) == 1 or hidden <= 1, "weight must be contiguous")
    # Without a residual the kernel never touches these two; pass x to keep one signature.
    res = residual if residual is not None else x
    new_res = new_residual if new_residual is not None else out
    args = {
        "out_ptr": out,
        "new_residual_ptr": new_res,
        "x_ptr": x,
        "residual_ptr": res,
        "weight_ptr": weight,
        "hidden": hidden,
        "eps": float(eps),
        "stride_out": out.stride(0),
        "stride_new_residual": new_res.stride(0),
        "stride_x": x.stride(0),
        "stride_residual": res.stride(0),
    }
    block = _pow2(hidden)
    constexprs = {"HAS_RESIDUAL": has_residual, "BLOCK": block}
    num_warps = 1 if block <= 512 else (4 if block <= 4096 else 8)
    return KernelLaunch(rms_norm_kernel, (num_tokens,), args, constexprs, num_warps=num_warps)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm, fused with the residual add when ``residual`` is given.

    Returns ``(normed, new_residual)`` where ``new_residual = x + residual`` (or None
    when no residual was passed). Computed in float32, returned in x's dtype.
    """
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else None

    def plan() -> KernelLaunch:
        launch = plan_rms_norm(x, weight, eps, residual, out, new_residual)
        _require_launchable(*([x, weight, out] + ([residual] if residual is not None else [])))
        return launch

    # out and new_residual are x's layout; without a residual the kernel gets x and out
    # in their places (never read or written)
    tensors = {
        "out_ptr": out, "new_residual_ptr": out if new_residual is None else new_residual, "x_ptr": x,
        "residual_ptr": x if residual is None else residual, "weight_ptr": weight,
    }
    _PLANS.launch(("rms_norm", eps, layout(x), layout(weight), layout(residual)), tensors, plan)
    return out, new_residual


# ---------------------------------------------------------------- silu_and_mul

# Columns per silu_and_mul program. Small batches (decode) take narrow programs so that
# one token's row still spreads over many SMs (I = 8192: 32 programs); larger batches
# have programs enough and take wider ones. Untuned: no GPU was at hand.
_SILU_BLOCK_SMALL_BATCH = 256
_SILU_BLOCK = 1024
_SILU_SMALL_BATCH = 64  # tokens


def plan_silu_and_mul(
    gate_up: torch.Tensor,  # [num_tokens, 2 * inter]: gate in [:inter], up in [inter:]
    out: torch.Tensor,  # [num_tokens, inter], written
) -> KernelLaunch:
    _require_dim(gate_up, 2, "gate_up")
    _require_dtype(gate_up, _FLOAT_DTYPES, "gate_up")
    num_tokens, width = gate_up.shape
    _require(width % 2 == 0, f"gate_up width {width} must be even (gate and up halves)")
    inter = width // 2
    _require(
        out.shape == (num_tokens, inter) and out.dtype == gate_up.dtype,
        f"out must have shape ({num_tokens}, {inter}) and dtype {gate_up.dtype}, "
        f"got {tuple(out.shape)} {out.dtype}",
    )
    _require_unit_last_stride(gate_up, "gate_up")
    _require_unit_last_stride(out, "out")
    wide = _SILU_BLOCK if num_tokens >= _SILU_SMALL_BATCH else _SILU_BLOCK_SMALL_BATCH
    block = min(wide, _pow2(inter))
    args = {
        "out_ptr": out,
        "gate_up_ptr": gate_up,
        "inter": inter,
        "stride_out": out.stride(0),
        "stride_gate_up": gate_up.stride(0),
    }
    grid = (num_tokens, triton.cdiv(inter, block))
    num_warps = max(1, min(4, block // 256))
    return KernelLaunch(silu_and_mul_kernel, grid, args, {"BLOCK": block}, num_warps=num_warps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2I] -> [num_tokens, I]
    """SwiGLU's activation: ``silu(gate_up[:, :I]) * gate_up[:, I:]``, computed in float32
    and returned in gate_up's dtype."""
    _require_dim(gate_up, 2, "gate_up")
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    def plan() -> KernelLaunch:
        launch = plan_silu_and_mul(gate_up, out)
        _require_launchable(gate_up, out)
        return launch

    _PLANS.launch(("silu_and_mul", layout(gate_up)), {"out_ptr": out, "gate_up_ptr": gate_up}, plan)
    return out


# ---------------------------------------------------------------- rotary_embedding


def _check_rotary(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:d/2], sin in [d/2:]
) -> None:
    """The inputs of a rotary embedding (``rotary_embedding``, ``rotary_and_cache``)."""
    _require_dim(query, 3, "query")
    _require_dim(key, 3, "key")
    _require_dim(cos_sin_cache, 2, "cos_sin_cache")
    num_tokens, head_dim = query.shape[0], query.shape[2]
    _require(
        key.shape[0] == num_tokens and key.shape[2] == head_dim,
        f"key {tuple(key.shape)} does not match query {tuple(query.shape)}",
    )
    _require(
        cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0,
        f"cos_sin_cache width {cos_sin_cache.shape[1]} must equal the even head_dim {head_dim}",
    )
    _require(positions.shape == (num_tokens,), f"positions must have shape ({num_tokens},)")
    _require_dtype(positions, _INDEX_DTYPES, "positions")
    for t, name in ((query, "query"), (key, "key"), (cos_sin_cache, "cos_sin_cache")):
        _require_dtype(t, _FLOAT_DTYPES, name)
        _require_unit_last_stride(t, name)


def plan_rotary_embedding(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:d/2], sin in [d/2:]
) -> KernelLaunch:
    _check_rotary(positions, query, key, cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half = head_dim // 2
    args = {
        "query_ptr": query,
        "key_ptr": key,
        "cos_sin_ptr": cos_sin_cache,
        "positions_ptr": positions,
        "stride_q_tok": query.stride(0),
        "stride_q_head": query.stride(1),
        "stride_k_tok": key.stride(0),
        "stride_k_head": key.stride(1),
        "stride_cos_sin": cos_sin_cache.stride(0),
    }
    constexprs = {
        "NUM_HEADS": num_heads,
        "NUM_KV_HEADS": num_kv_heads,
        "HALF": half,
        "HALF_P": _pow2(half),
        "HEADS_P": _pow2(num_heads),
        "KV_HEADS_P": _pow2(num_kv_heads),
    }
    return KernelLaunch(rotary_embedding_kernel, (num_tokens,), args, constexprs, num_warps=4)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:d/2], sin in [d/2:]
) -> None:
    """Neox-style rotary embedding (rotate halves), applied in place to query and key."""
    launch = plan_rotary_embedding(positions, query, key, cos_sin_cache)
    _require_launchable(positions, query, key, cos_sin_cache)
    launch.run()


# ---------------------------------------------------------------- rotary_and_cache


def plan_rotary_and_cache(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:d/2], sin in [d/2:]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 marks a padding token
) -> KernelLaunch:
    _check_rotary(positions, query, key, cos_sin_cache)
    _check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half = head_dim // 2
    args = {
        "query_ptr": query,
        "key_ptr": key,
        "value_ptr": value,
        "cos_sin_ptr": cos_sin_cache,
        "positions_ptr": positions,
        "key_cache_ptr": key_cache,
        "value_cache_ptr": value_cache,
        "slot_mapping_ptr": slot_mapping,
        "stride_q_tok": query.stride(0),
        "stride_q_head": query.stride(1),
        "stride_k_tok": key.stride(0),
        "stride_k_head": key.stride(1),
        "stride_v_tok": value.stride(0),
        "stride_v_head": value.stride(1),
        "stride_cos_sin": cos_sin_cache.stride(0),
        "stride_kc_block": key_cache.stride(0),
        "stride_kc_row": key_cache.stride(1),
        "stride_kc_head": key_cache.stride(2),
        "stride_vc_block": value_cache.stride(0),
        "stride_vc_row": value_cache.stride(1),
        "stride_vc_head": value_cache.stride(2),
    }
    constexprs = {
        "NUM_HEADS": num_heads,
        "NUM_KV_HEADS": num_kv_heads,
        "HALF": half,
        "HALF_P": _pow2(half),
        "HEADS_P": _pow2(num_heads),
        "KV_HEADS_P": _pow2(num_kv_heads),
        "BLOCK_SIZE": key_cache.shape[1],
    }
    return KernelLaunch(rotary_and_cache_kernel, (num_tokens,), args, constexprs, num_warps=4)


def rotary_and_cache(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos in [:d/2], sin in [d/2:]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padding token
) -> None:
    """``rotary_embedding(positions, query, key, cos_sin_cache)`` then
    ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)``, in one launch:
    query and key are rotated in place and the rotated key and the value are written into
    their cache slots (slots < 0 are skipped)."""
    tensors = {
        "query_ptr": query, "key_ptr": key, "value_ptr": value, "cos_sin_ptr": cos_sin_cache,
        "positions_ptr": positions, "key_cache_ptr": key_cache, "value_cache_ptr": value_cache,
        "slot_mapping_ptr": slot_mapping,
    }

    def plan() -> KernelLaunch:
        launch = plan_rotary_and_cache(
            positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping
        )
        _require_launchable(*tensors.values())
        return launch

    _PLANS.launch(("rotary_and_cache", *map(layout, tensors.values())), tensors, plan)
