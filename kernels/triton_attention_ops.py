"""Planning and launching Triton paged attention (``kernels.triton_attention``'s kernels):
the unified kernel for decode tokens and prefill chunks alike, and the split-KV path for
small decode batches; ``paged_attention`` has ``kernels.reference``'s signature and is
what ``kernels.triton_ops`` exports."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton

from kernels.triton_attention import (
    paged_attention_kernel,
    split_kv_attention_kernel,
    split_kv_reduce_kernel,
)
from kernels.triton_launch import (
    _FLOAT_DTYPES,
    _INDEX_DTYPES,
    _PLANS,
    KernelLaunch,
    _check_cache_pair,
    _pow2,
    _require,
    _require_dim,
    _require_dtype,
    _require_launchable,
    _require_unit_last_stride,
    interpreting,
    layout,
)


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
# programs for an H100/H200's 132 SMs at batch 1 on Llama-3.2-1B, most of the GPU idle
# (its time a layer: benchmarks/NOTES.md). So a batch takes the split path when
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


class _AttentionShapes(NamedTuple):
    num_tokens: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    num_seqs: int
    group: int  # query heads per KV head
    compute_f32: bool  # float32 dots: float32 inputs, or bfloat16 under the interpreter


def _checked_shapes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    interpret: bool,
) -> _AttentionShapes:
    """Both attention plans' input checks, and the sizes they plan with."""
    _check_attention_inputs(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    _check_attention_out(query, out)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    compute_f32 = query.dtype == torch.float32 or (interpret and query.dtype == torch.bfloat16)
    return _AttentionShapes(
        num_tokens, num_heads, head_dim, num_kv_heads, seq_lens.shape[0], num_heads // num_kv_heads, compute_f32
    )


def _kv_strides(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor) -> dict[str, int]:
    """The KV caches' and block table's strides: the last arguments of both kernels."""
    return {
        "stride_k_block": key_cache.stride(0),
        "stride_k_row": key_cache.stride(1),
        "stride_k_head": key_cache.stride(2),
        "stride_v_block": value_cache.stride(0),
        "stride_v_row": value_cache.stride(1),
        "stride_v_head": value_cache.stride(2),
        "stride_bt_seq": block_tables.stride(0),
    }


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
    num_tokens, _, head_dim, num_kv_heads, num_seqs, group, compute_f32 = _checked_shapes(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out, interpret
    )
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
        **_kv_strides(key_cache, value_cache, block_tables),
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
    num_tokens, num_heads, head_dim, num_kv_heads, num_seqs, group, compute_f32 = _checked_shapes(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out, interpret
    )
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
        **_kv_strides(key_cache, value_cache, block_tables),
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
