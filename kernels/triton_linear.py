"""A Triton GEMV for the linears of small-batch decode on CUDA: ``x @ w.T + bias`` for
at most ``MAX_ROWS`` rows of ``x``.

With one to eight rows a projection is a read of its weight and little else, and the
tile shapes a BLAS picks for matrices leave the small ones short of the memory's
bandwidth, as a lent H200 showed for a 1B model's qkv, o_proj and down_proj
(benchmarks/NOTES.md). Here each program owns ``BLOCK_N`` whole weight
rows and walks them ``BLOCK_K`` columns at a time; the grid has several programs per SM
so that enough loads are in flight. Every output is one program's float32 sum in a fixed
order: deterministic, no split-K atomics, and each row of ``x`` independent of the others.

Opt-in (``EngineConfig.triton_gemv``, ``--triton-gemv``) until a GPU run shows it
beating cuBLAS; ``benchmarks.gpu_decode --triton-gemv`` times it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_launch import (
    _FLOAT_DTYPES,
    _PLANS,
    KernelLaunch,
    _pow2,
    _require,
    _require_dim,
    _require_dtype,
    _require_launchable,
    _require_unit_last_stride,
    layout,
)

MAX_ROWS = 8  # rows of x this kernel takes; more go to F.linear (a matrix product)
_PROGRAMS_PER_SM = 4  # grid size target: enough rows in flight per SM to cover latency
_DEFAULT_SMS = 132  # H100/H200; what the interpreter plans for
_TILE_ELEMS = 8192  # ROWS x BLOCK_N x BLOCK_K products a program holds at once


@triton.jit
def gemv_kernel(
    out_ptr,  # [M, N]
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N] (unread without HAS_BIAS)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,  # weight rows per program
    BLOCK_K: tl.constexpr,  # columns per step
):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns of this program
    n_valid = n < N
    m = tl.arange(0, ROWS)  # [ROWS]
    m_valid = m < M
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm  # [ROWS, 1]
    # Products accumulate elementwise, [ROWS, BLOCK_N, BLOCK_K], and are summed over k
    # once after the loop: no cross-lane reduction per step of a bandwidth-bound loop.
    partial = tl.zeros([ROWS, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        k_valid = k < K
        w = tl.load(w_rows + k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        partial += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    acc = tl.sum(partial, axis=2)  # [ROWS, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


def gemv_tiles(rows: int, n: int, k: int, num_sms: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): the widest BLOCK_N in [1, 32] that still gives about
    ``_PROGRAMS_PER_SM`` programs per SM, then as many columns a step as the tile allows
    (16 to 512)."""
    block_n = 32
    while block_n > 1 and triton.cdiv(n, block_n) < _PROGRAMS_PER_SM * num_sms:
        block_n //= 2
    block_k = max(16, min(512, _pow2(k), _TILE_ELEMS // (_pow2(rows) * block_n)))
    return block_n, block_k


def plan_gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    out: torch.Tensor,  # [M, N], written
    num_sms: int = _DEFAULT_SMS,
) -> KernelLaunch:
    _require_dim(x, 2, "x")
    _require_dim(weight, 2, "weight")
    _require_dtype(x, _FLOAT_DTYPES, "x")
    rows, k = x.shape
    n = weight.shape[0]
    _require(1 <= rows <= MAX_ROWS, f"x has {rows} rows; the GEMV takes 1 to {MAX_ROWS}")
    _require(weight.shape[1] == k, f"weight {tuple(weight.shape)} does not take {k} input features")
    _require(weight.dtype == x.dtype, f"weight dtype {weight.dtype} != x dtype {x.dtype}")
    _require(
        out.shape == (rows, n) and out.dtype == x.dtype,
        f"out must have shape ({rows}, {n}) and dtype {x.dtype}, got {tuple(out.shape)} {out.dtype}",
    )
    for t, name in ((x, "x"), (weight, "weight"), (out, "out")):
        _require_unit_last_stride(t, name)
    if bias is not None:
        _require(bias.shape == (n,) and bias.dtype == x.dtype, f"bias must be ({n},) {x.dtype}")
        _require_unit_last_stride(bias, "bias")
    block_n, block_k = gemv_tiles(rows, n, k, num_sms)
    args = {
        "out_ptr": out,
        "x_ptr": x,
        "w_ptr": weight,
        "bias_ptr": bias if bias is not None else weight,  # a valid pointer, never read
        "M": rows,
        "N": n,
        "K": k,
        "stride_xm": x.stride(0),
        "stride_wn": weight.stride(0),
        "stride_om": out.stride(0),
    }
    constexprs = {"HAS_BIAS": bias is not None, "ROWS": _pow2(rows), "BLOCK_N": block_n, "BLOCK_K": block_k}
    return KernelLaunch(gemv_kernel, (triton.cdiv(n, block_n),), args, constexprs, num_warps=4)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` ([M, K] x [N, K] -> [M, N], M <= MAX_ROWS) in x's dtype,
    accumulated in float32."""
    _require_dim(x, 2, "x")
    out = x.new_empty(x.shape[0], weight.shape[0])
    tensors = {"out_ptr": out, "x_ptr": x, "w_ptr": weight, "bias_ptr": bias if bias is not None else weight}

    def plan() -> KernelLaunch:
        launch = plan_gemv(x, weight, bias, out, _num_sms(x.device))
        _require_launchable(x, weight, out, *([bias] if bias is not None else []))
        return launch

    _PLANS.launch(("gemv", bias is not None, *map(layout, (x, weight, bias))), tensors, plan)
    return out
