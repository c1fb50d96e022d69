"""Weight-only quantized linears in Triton (CUDA; the interpreter on CPU in tests):
``y = x @ W.T + bias`` with W stored in 4 bits (GPTQ, AWQ: ``Int4Rows``) or in FP8
(compressed-tensors ``float8_e4m3fn``), dequantized in registers, accumulated in float32.

4-bit (``pack_int4`` -> ``Int4Weight``, ``int4_linear``):

- ``qweight`` int32 ``[K/8, N]``: word ``(j, n)`` holds inputs ``8j..8j+7`` of output n,
  input ``8j + i`` in bits ``4i..4i+3`` (GPTQ's packing; consecutive outputs are consecutive
  words, so a tile's loads coalesce along N). ``scales``, ``mins`` float32 ``[K/group, N]``;
  ``W[n, k] = code * scales[k // group, n] + mins[k // group, n]``. ``group`` is a multiple
  of 32 dividing K.
- A program owns a ``BLOCK_M x BLOCK_N`` tile of y and walks K ``BLOCK_K`` inputs a step,
  ``BLOCK_K`` dividing the group, so one scale and one min per output hold for the whole
  step: the codes (0..15, exact in any float type) go into ``tl.dot`` as they are and the
  group is applied to the step's product, ``acc += s * (x @ q) + m * sum_k(x)``: no rounding
  of dequantized weights to bfloat16, and no per-weight multiply-add.
- GPTQ act-order (``perm``): ``x[:, perm]`` is gathered first (a torch op).

FP8 (``pack_fp8`` -> ``Fp8Weight``, ``fp8_linear``): W ``[N, K]`` as stored, times a per-tensor
(``[1]``) or per-output-channel (``[N]``) scale in the epilogue. Where the GPU converts
float8 natively (sm_89 and later) the kernel loads ``float8_e4m3fn``; elsewhere (older GPUs,
by default the interpreter) it loads the bytes and decodes them exactly: the 7 bits below
the sign, shifted into float16's exponent and mantissa fields, are the value / 256
(subnormals included), and the 256 goes into the scale. (The one NaN code then reads as
480: checkpoints hold none.)

Both: float32 x takes IEEE float32 dots (not TF32); bfloat16 is upcast to float32 under the
interpreter, whose bfloat16 arithmetic is wrong. Decode-sized calls (M <= ``SMALL_M``) that
would leave the GPU with few programs split K over up to ``MAX_SPLIT_K`` programs per tile,
each storing float32 partials that a second kernel sums in a fixed order, adding the bias
(deterministic, no atomics). Launches are planned by ``plan_*`` functions returning a
``KernelLaunch`` (``kernels.triton_launch``), which the tests also compile for sm_90.

Importing this module imports triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels.triton_launch import (
    _FLOAT_DTYPES,
    _PLANS,
    KernelLaunch,
    _pow2,
    _require,
    _require_launchable,
    _require_unit_last_stride,
    interpreting,
    layout,
)

if TYPE_CHECKING:
    from engine_service.models.quantized import Int4Rows

__all__ = [
    "INT4_GROUP_MULTIPLE",
    "Fp8Weight",
    "Int4Weight",
    "LinearTiles",
    "fp8_linear",
    "int4_linear",
    "linear_tiles",
    "pack_fp8",
    "pack_int4",
    "plan_fp8_linear",
    "plan_int4_linear",
    "plan_split_k_sum",
]

INT4_GROUP_MULTIPLE = 32  # int4 groups must be a multiple of this (and divide K)
SMALL_M = 16  # rows of x up to which a call is decode-sized (split-K when the grid is small)
MAX_SPLIT_K = 16
_PROGRAMS_PER_SM = 2  # split-K aims at this many programs per SM
_DEFAULT_SMS = 132  # H100/H200; what the interpreter plans for


# ---------------------------------------------------------------- kernels


@triton.jit
def int4_linear_kernel(
    out_ptr,  # [M, N] (x's dtype), or float32 partials [SPLIT_K, M, N] when SPLIT_K > 1
    x_ptr,  # [M, K]
    qweight_ptr,  # int32 [K/8, N]
    scales_ptr,  # float32 [K/GROUP, N]
    mins_ptr,  # float32 [K/GROUP, N]
    bias_ptr,  # [N] (unread without HAS_BIAS)
    M,
    N,
    K,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_om,
    stride_os,  # between split partials
    tiles_per_split,  # K steps of one split
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP
    COMPUTE_F32: tl.constexpr,  # float32 dots (IEEE): float32 x, bfloat16 interpreted
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = m < M
    n_valid = n < N
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    words = tl.arange(0, BLOCK_K // 8)
    shifts = (tl.arange(0, 8) * 4)[None, :, None]  # [1, 8, 1]: input 8j + i in bits 4i..4i+3
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, K // BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for t in range(first, last):
        k0 = t * BLOCK_K
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + k[None, :], mask=m_valid[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_rows = (k0 // 8 + words).to(tl.int64)[:, None] * stride_qk  # [BLOCK_K / 8, 1]
        packed = tl.load(qweight_ptr + w_rows + n[None, :], mask=n_valid[None, :], other=0)
        q = (packed[:, None, :] >> shifts) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))  # row 8j + i: input k0 + 8j + i
        g = k0 // GROUP
        s = tl.load(scales_ptr + g * stride_sg + n, mask=n_valid, other=0.0)
        mn = tl.load(mins_ptr + g * stride_sg + n, mask=n_valid, other=0.0)
        a32 = a.to(tl.float32)
        if COMPUTE_F32:
            prod = tl.dot(a32, q.to(tl.float32), input_precision="ieee")
        else:
            prod = tl.dot(a, q.to(a.dtype))  # codes 0..15: exact in bfloat16 / float16
        x_sum = tl.sum(a32, axis=1)  # [BLOCK_M]
        acc += prod * s[None, :] + x_sum[:, None] * mn[None, :]
    _store_tile(out_ptr, bias_ptr, acc, m, n, m_valid, n_valid, stride_om, stride_os, pid_k, HAS_BIAS, SPLIT_K)


@triton.jit
def fp8_linear_kernel(
    out_ptr,  # [M, N] (x's dtype), or float32 partials [SPLIT_K, M, N] when SPLIT_K > 1
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] float8_e4m3fn (NATIVE) or its bytes (uint8)
    scale_ptr,  # float32 [N] (PER_CHANNEL) or [1]
    bias_ptr,  # [N] (unread without HAS_BIAS)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    tiles_per_split,
    PER_CHANNEL: tl.constexpr,
    NATIVE: tl.constexpr,  # load float8 and convert; else decode the bytes
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = m < M
    n_valid = n < N
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for t in range(first, last):
        k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_valid = k < K
        a = tl.load(x_rows + k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & n_valid[None, :]
        if NATIVE:  # (no float8 ``other``: masked lanes are zeroed after the conversion)
            b = tl.load(w_cols + k[:, None], mask=w_mask)  # [BLOCK_K, BLOCK_N]
            w = b.to(tl.float32) if COMPUTE_F32 else b.to(a.dtype)
            w = tl.where(w_mask, w, 0.0)
        else:
            bits = tl.load(w_cols + k[:, None], mask=w_mask, other=0).to(tl.int32)
            half = ((bits & 0x7F) << 7) | ((bits & 0x80) << 8)  # float16 bits of value / 256
            w = half.to(tl.uint16).to(tl.float16, bitcast=True)
            w = w.to(tl.float32) if COMPUTE_F32 else w.to(a.dtype)
        if COMPUTE_F32:
            acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if PER_CHANNEL:
        scale = tl.load(scale_ptr + n, mask=n_valid, other=0.0)[None, :]
    else:
        scale = tl.load(scale_ptr)
    if not NATIVE:
        scale = scale * 256.0
    acc = acc * scale
    _store_tile(out_ptr, bias_ptr, acc, m, n, m_valid, n_valid, stride_om, stride_os, pid_k, HAS_BIAS, SPLIT_K)


@triton.jit
def _store_tile(out_ptr, bias_ptr, acc, m, n, m_valid, n_valid, stride_om, stride_os, pid_k,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """The tile into ``out`` (bias added, cast), or its float32 partial into split ``pid_k``."""
    mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        out = out_ptr + pid_k.to(tl.int64) * stride_os + m.to(tl.int64)[:, None] * stride_om + n[None, :]
        tl.store(out, acc, mask=mask)


@triton.jit
def split_k_sum_kernel(
    out_ptr,  # [M, N]
    partial_ptr,  # float32 [SPLIT_K, M, N], contiguous
    bias_ptr,  # [N] (unread without HAS_BIAS)
    N,
    stride_om,
    stride_ps,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (M, cdiv(N, BLOCK)): ``out[m] = sum_j partial[j, m] (+ bias)``, splits in order."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + j * stride_ps + row * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- packed weights


@dataclass(frozen=True)
class Int4Weight:
    """A 4-bit matrix laid out for ``int4_linear`` (see the module docstring)."""

    qweight: torch.Tensor  # int32 [K/8, N]
    scales: torch.Tensor  # float32 [K/group, N]
    mins: torch.Tensor  # float32 [K/group, N]
    group: int
    perm: torch.Tensor | None = None  # int64 [K]: y = x[:, perm] @ W.T

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the float weight."""
        return self.qweight.shape[1], self.qweight.shape[0] * 8

    @property
    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales, self.mins, self.perm)
        return sum(t.nbytes for t in tensors if t is not None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int4_linear(x, self, bias)

    def unpacked(self) -> torch.Tensor:
        """uint8 ``[N, K]`` codes, one a byte, in the kernel's (permuted) column order."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=self.qweight.device)
        codes = (self.qweight.unsqueeze(-1) >> shifts) & 0xF  # [K/8, N, 8]
        return codes.permute(1, 0, 2).reshape(self.shape).to(torch.uint8)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]`` in the checkpoint's column order (``Int4Rows.dequantize``)."""
        weight = self.unpacked().float() * self.scales.T.repeat_interleave(self.group, dim=1)
        weight += self.mins.T.repeat_interleave(self.group, dim=1)
        if self.perm is None:
            return weight
        out = torch.empty_like(weight)
        out[:, self.perm] = weight
        return out


def int4_packable(rows: Int4Rows) -> str | None:
    """None when ``pack_int4`` takes ``rows``, else why not."""
    k = rows.shape[1]
    if rows.group % INT4_GROUP_MULTIPLE or k % rows.group:
        return f"group {rows.group} is not a multiple of {INT4_GROUP_MULTIPLE} dividing K = {k}"
    return None


def pack_int4(rows: Int4Rows, device: torch.device | str | None = None) -> Int4Weight:
    """``Int4Rows`` (quantized.py) -> ``Int4Weight`` on ``device`` (default: where the codes are)."""
    why = int4_packable(rows)
    _require(why is None, f"cannot pack these 4-bit rows: {why}")
    n, k = rows.shape
    device = rows.codes.device if device is None else torch.device(device)
    codes = rows.codes.to(device).contiguous().view(n, k // 8, 4).to(torch.int64)  # 4 bytes a word, low first
    words = codes[..., 0] | (codes[..., 1] << 8) | (codes[..., 2] << 16) | (codes[..., 3] << 24)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # [N, K/8]
    perm = None if rows.perm is None else rows.perm.to(device=device, dtype=torch.int64)
    return Int4Weight(
        qweight=words.T.contiguous(),
        scales=rows.scales.to(device=device, dtype=torch.float32).T.contiguous(),
        mins=rows.mins.to(device=device, dtype=torch.float32).T.contiguous(),
        group=rows.group,
        perm=perm,
    )


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 matrix laid out for ``fp8_linear``: ``weight [N, K]`` float8_e4m3fn (``native``)
    or its bytes as uint8; ``scale`` float32 ``[N]`` (per channel) or ``[1]`` (per tensor)."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]

    @property
    def native(self) -> bool:
        return self.weight.dtype == torch.float8_e4m3fn

    @property
    def per_channel(self) -> bool:
        return self.scale.numel() > 1

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, self, bias)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: ``weight.float() * scale``."""
        values = self.weight if self.native else self.weight.view(torch.float8_e4m3fn)
        return values.float() * self.scale.reshape(-1, 1)


def native_fp8(device: torch.device) -> bool:
    """Whether compiled kernels on ``device`` convert float8_e4m3fn natively (sm_89+)."""
    return (
        device.type == "cuda"
        and not interpreting()
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


def pack_fp8(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [1] / [] (per tensor) or [N, 1] / [N] (per channel)
    device: torch.device | str | None = None,
    native: bool | None = None,
) -> Fp8Weight:
    """An FP8 weight and its scale -> ``Fp8Weight`` on ``device`` (default: the weight's).
    ``native``: keep float8 for the kernel to convert (default: where the GPU can)."""
    _require(weight.dim() == 2, f"weight must be [N, K], got shape {tuple(weight.shape)}")
    _require(weight.dtype == torch.float8_e4m3fn, f"weight must be float8_e4m3fn, got {weight.dtype}")
    n = weight.shape[0]
    device = weight.device if device is None else torch.device(device)
    per_channel = scale.numel() == n and n > 1 and scale.dim() > 0
    _require(
        per_channel or scale.numel() == 1,
        f"scale must be [1] (per tensor) or [{n}, 1] (per channel), got {tuple(scale.shape)}",
    )
    scale = scale.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    weight = weight.to(device).contiguous()
    if native is None:
        native = native_fp8(device)
    return Fp8Weight(weight if native else weight.view(torch.uint8), scale)


# ---------------------------------------------------------------- planning


@dataclass(frozen=True)
class LinearTiles:
    """Tile sizes and the K split of one quantized linear call."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def linear_tiles(
    m: int, n: int, k: int, block_k_max: int, num_sms: int = _DEFAULT_SMS, float32: bool = False
) -> LinearTiles:
    """Decode-sized M (<= SMALL_M): 16 x 64 tiles walking K up to 128 at a time, K split
    until the grid has about ``_PROGRAMS_PER_SM`` programs per SM; larger M: 32 or 64 rows
    by 64 (128 from 64 rows up) outputs, K 64 at a time. ``block_k_max``: the largest K step
    the weight allows (for int4 the group's largest power-of-two divisor up to 128).
    ``float32`` x (IEEE dots, on CUDA cores): at most 32 x 64 tiles, K 32 a step,
    which sm_90 holds in registers without spilling."""
    if m <= SMALL_M:
        block_m, block_n, block_k = 16, 64, min(32 if float32 else 128, block_k_max)
    elif float32:
        block_m, block_n, block_k = 32, 64, min(32, block_k_max)
    else:
        block_m = 32 if m <= 32 else 64
        block_n = 128 if m > 64 and n >= 128 else 64
        block_k = min(64, block_k_max)
    block_n = min(block_n, max(32, _pow2(n)))
    k_tiles = triton.cdiv(k, block_k)
    split = 1
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if m <= SMALL_M and tiles < _PROGRAMS_PER_SM * num_sms:
        split = min(MAX_SPLIT_K, k_tiles, triton.cdiv(_PROGRAMS_PER_SM * num_sms, tiles))
        split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, max(split, 1)))  # no empty split
    num_warps = 8 if block_m * block_n >= 64 * 128 else 4
    return LinearTiles(block_m, block_n, block_k, split, num_warps)


def _block_k_max(group: int) -> int:
    block = INT4_GROUP_MULTIPLE
    while block < 128 and group % (2 * block) == 0:
        block *= 2
    return block


def _compute_f32(dtype: torch.dtype, interpret: bool) -> bool:
    return dtype == torch.float32 or (interpret and dtype == torch.bfloat16)


def _check_x(x: torch.Tensor, k: int, out: torch.Tensor, bias: torch.Tensor | None, n: int) -> None:
    _require(x.dim() == 2 and x.shape[1] == k, f"x must be [M, {k}], got {tuple(x.shape)}")
    _require(x.dtype in _FLOAT_DTYPES, f"x has dtype {x.dtype}; expected one of {_FLOAT_DTYPES}")
    _require_unit_last_stride(x, "x")
    _require(out.dim() in (2, 3) and out.stride(-1) == 1, "out must be contiguous in its last dim")
    if bias is not None:
        _require(bias.shape == (n,) and bias.dtype in _FLOAT_DTYPES, f"bias must be ({n},) float")
        _require_unit_last_stride(bias, "bias")


def _out_args(out: torch.Tensor, tiles: LinearTiles, x: torch.Tensor) -> tuple[int, int]:
    """(stride_om, stride_os) of ``out``: [M, N] in x's dtype, or [SPLIT_K, M, N] float32."""
    m = x.shape[0]
    if tiles.split_k == 1:
        _require(out.dim() == 2 and out.shape[0] == m and out.dtype == x.dtype, "out must be [M, N] in x's dtype")
        return out.stride(0), 0
    _require(
        out.dim() == 3 and out.shape[:2] == (tiles.split_k, m) and out.dtype == torch.float32 and out.is_contiguous(),
        f"partials must be a contiguous float32 [{tiles.split_k}, {m}, N]",
    )
    return out.stride(1), out.stride(0)


def plan_int4_linear(
    out: torch.Tensor,  # [M, N] in x's dtype, or float32 [split_k, M, N] partials
    x: torch.Tensor,  # [M, K], already permuted
    w: Int4Weight,
    bias: torch.Tensor | None,
    tiles: LinearTiles,
    interpret: bool = False,
) -> KernelLaunch:
    n, k = w.shape
    _check_x(x, k, out, bias, n)
    _require(
        w.group % tiles.block_k == 0 and tiles.block_k % 8 == 0,
        f"BLOCK_K {tiles.block_k} must divide group {w.group}",
    )
    stride_om, stride_os = _out_args(out, tiles, x)
    k_tiles = k // tiles.block_k
    args = {
        "out_ptr": out,
        "x_ptr": x,
        "qweight_ptr": w.qweight,
        "scales_ptr": w.scales,
        "mins_ptr": w.mins,
        "bias_ptr": bias if bias is not None and tiles.split_k == 1 else w.scales,  # never read
        "M": x.shape[0],
        "N": n,
        "K": k,
        "stride_xm": x.stride(0),
        "stride_qk": w.qweight.stride(0),
        "stride_sg": w.scales.stride(0),
        "stride_om": stride_om,
        "stride_os": stride_os,
        "tiles_per_split": triton.cdiv(k_tiles, tiles.split_k),
    }
    constexprs = {
        "GROUP": w.group,
        "HAS_BIAS": bias is not None and tiles.split_k == 1,
        "SPLIT_K": tiles.split_k,
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "COMPUTE_F32": _compute_f32(x.dtype, interpret),
    }
    grid = (triton.cdiv(x.shape[0], tiles.block_m), triton.cdiv(n, tiles.block_n), tiles.split_k)
    return KernelLaunch(int4_linear_kernel, grid, args, constexprs, num_warps=tiles.num_warps)


def plan_fp8_linear(
    out: torch.Tensor,
    x: torch.Tensor,  # [M, K]
    w: Fp8Weight,
    bias: torch.Tensor | None,
    tiles: LinearTiles,
    interpret: bool = False,
) -> KernelLaunch:
    n, k = w.shape
    _check_x(x, k, out, bias, n)
    _require(w.weight.dtype in (torch.float8_e4m3fn, torch.uint8), f"weight dtype {w.weight.dtype}")
    _require_unit_last_stride(w.weight, "weight")
    _require(w.scale.dtype == torch.float32 and w.scale.numel() in (1, n), "scale must be float32 [1] or [N]")
    stride_om, stride_os = _out_args(out, tiles, x)
    k_tiles = triton.cdiv(k, tiles.block_k)
    args = {
        "out_ptr": out,
        "x_ptr": x,
        "w_ptr": w.weight,
        "scale_ptr": w.scale,
        "bias_ptr": bias if bias is not None and tiles.split_k == 1 else w.scale,  # never read
        "M": x.shape[0],
        "N": n,
        "K": k,
        "stride_xm": x.stride(0),
        "stride_wn": w.weight.stride(0),
        "stride_om": stride_om,
        "stride_os": stride_os,
        "tiles_per_split": triton.cdiv(k_tiles, tiles.split_k),
    }
    constexprs = {
        "PER_CHANNEL": w.per_channel,
        "NATIVE": w.native,
        "HAS_BIAS": bias is not None and tiles.split_k == 1,
        "SPLIT_K": tiles.split_k,
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "COMPUTE_F32": _compute_f32(x.dtype, interpret),
    }
    grid = (triton.cdiv(x.shape[0], tiles.block_m), triton.cdiv(n, tiles.block_n), tiles.split_k)
    return KernelLaunch(fp8_linear_kernel, grid, args, constexprs, num_warps=tiles.num_warps)


def plan_split_k_sum(out: torch.Tensor, partials: torch.Tensor, bias: torch.Tensor | None) -> KernelLaunch:
    split, m, n = partials.shape
    _require(partials.is_contiguous() and partials.dtype == torch.float32, "partials must be contiguous float32")
    _require(out.shape == (m, n) and out.stride(1) == 1, f"out must be [{m}, {n}]")
    block = min(1024, _pow2(n))
    args = {
        "out_ptr": out,
        "partial_ptr": partials,
        "bias_ptr": bias if bias is not None else partials,
        "N": n,
        "stride_om": out.stride(0),
        "stride_ps": partials.stride(0),
    }
    constexprs = {"HAS_BIAS": bias is not None, "SPLIT_K": split, "BLOCK": block}
    grid = (m, triton.cdiv(n, block))
    return KernelLaunch(split_k_sum_kernel, grid, args, constexprs, num_warps=max(1, min(4, block // 256)))


# ---------------------------------------------------------------- entry points


def _flat(x: torch.Tensor, k: int) -> torch.Tensor:
    _require(x.shape[-1] == k, f"x has {x.shape[-1]} input features; the weight takes {k}")
    x = x.reshape(-1, k)
    return x if x.stride(-1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _run(
    x: torch.Tensor,  # [M, K]
    w: Int4Weight | Fp8Weight,
    bias: torch.Tensor | None,
    tiles: LinearTiles | None,
) -> torch.Tensor:
    n, k = w.shape
    m = x.shape[0]
    out = x.new_empty(m, n)
    if m == 0:
        return out
    int4 = isinstance(w, Int4Weight)
    if tiles is None:
        block_k_max = _block_k_max(w.group) if int4 else 128
        tiles = linear_tiles(m, n, k, block_k_max, _num_sms(x.device), x.dtype == torch.float32)
    interpret = interpreting()
    split = tiles.split_k > 1
    target = torch.empty(tiles.split_k, m, n, dtype=torch.float32, device=x.device) if split else out
    if isinstance(w, Int4Weight):
        weights = {"qweight_ptr": w.qweight, "scales_ptr": w.scales, "mins_ptr": w.mins}
    else:
        weights = {"w_ptr": w.weight, "scale_ptr": w.scale}
    unread = next(iter(weights.values()))  # a valid pointer for an absent bias
    tensors = {"out_ptr": target, "x_ptr": x, **weights, "bias_ptr": unread if bias is None or split else bias}

    def plan() -> KernelLaunch:
        _require_launchable(x, *weights.values(), *([bias] if bias is not None else []))
        if isinstance(w, Int4Weight):
            return plan_int4_linear(target, x, w, bias, tiles, interpret)
        return plan_fp8_linear(target, x, w, bias, tiles, interpret)

    key = ("int4" if int4 else "fp8", tiles, bias is not None, *map(layout, (x, *weights.values(), bias)))
    _PLANS.launch(key, tensors, plan)
    if split:
        sums = {"out_ptr": out, "partial_ptr": target, "bias_ptr": target if bias is None else bias}
        key = ("split_k_sum", *map(layout, (out, target, bias)))
        _PLANS.launch(key, sums, lambda: plan_split_k_sum(out, target, bias))
    return out


def int4_linear(
    x: torch.Tensor,  # [..., K]
    w: Int4Weight,
    bias: torch.Tensor | None = None,  # [N]
    tiles: LinearTiles | None = None,
) -> torch.Tensor:  # [..., N] in x's dtype
    """``x @ W.T + bias`` for a 4-bit ``W`` (``pack_int4``), accumulated in float32."""
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = _flat(x, k)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    out = _run(x2, w, bias, tiles)
    return out.reshape(*lead, n)


def fp8_linear(
    x: torch.Tensor,  # [..., K]
    w: Fp8Weight,
    bias: torch.Tensor | None = None,  # [N]
    tiles: LinearTiles | None = None,
) -> torch.Tensor:  # [..., N] in x's dtype
    """``x @ (W * scale).T + bias`` for an FP8 ``W`` (``pack_fp8``), accumulated in float32."""
    n, k = w.shape
    lead = x.shape[:-1]
    out = _run(_flat(x, k), w, bias, tiles)
    return out.reshape(*lead, n)
