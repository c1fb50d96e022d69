"""The Triton GEMV (kernels/triton_linear.py) against a float64 product, in the Triton
interpreter (and compiled on the GPU where there is one), and compiled for sm_90.

The cases run in worker processes, as tests/test_kernels.py explains: whether Triton
interprets is fixed when the kernels are imported. Inputs are fresh random values every
run; the seed is in every failure message.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from tests.test_kernels import (
    _DTYPES,
    _NUMERICS_MODES,
    KernelWorker,
    _device,
    _worker_env,
    compile_sm90,
)
from tests.test_kernels import (
    serve as _serve,
)

# (atol, rtol) of a dot product of K terms in float32 accumulation, per input dtype: the
# output's own rounding dominates.
_TOL = {"float32": (1e-4, 1e-4), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}


# ------------------------------------------------------------------ cases (in the workers)


def _inputs(seed: int, dtype: str, rows: int, n: int, k: int, bias: bool, x_stride_pad: int):
    gen = torch.Generator().manual_seed(seed)
    dt = _DTYPES[dtype]
    # x may be a view with a row stride wider than K (a slice of a larger activation).
    x_full = torch.randn(rows, k + x_stride_pad, generator=gen).to(dt)
    x = x_full[:, :k]
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dt)
    b = torch.randn(n, generator=gen).to(dt) if bias else None
    return x, w, b


def case_gemv(seed: int, dtype: str, rows: int, n: int, k: int, bias: bool, x_stride_pad: int) -> float:
    from kernels import triton_linear

    x, w, b = _inputs(seed, dtype, rows, n, k, bias, x_stride_pad)
    dev = _device()
    out = triton_linear.gemv(x.to(dev), w.to(dev), None if b is None else b.to(dev)).cpu()
    expected = x.double() @ w.double().T + (0 if b is None else b.double())
    assert out.shape == (rows, n) and out.dtype == x.dtype, (out.shape, out.dtype)
    atol, rtol = _TOL[dtype]
    torch.testing.assert_close(out.double(), expected.to(x.dtype).double(), atol=atol, rtol=rtol,
                               msg=lambda m: f"seed {seed}: {m}")
    return float((out.double() - expected).abs().max())


def case_gemv_rows_are_independent(seed: int, dtype: str, n: int, k: int) -> bool:
    """Each row of a batch equals that row on its own, bit for bit, and a second run
    equals the first (one fixed-order sum per output: no atomics, no batch coupling)."""
    from kernels import triton_linear

    dev = _device()
    x, w, b = (t.to(dev) if t is not None else None for t in _inputs(seed, dtype, 8, n, k, True, 0))
    together = triton_linear.gemv(x, w, b)
    assert torch.equal(together, triton_linear.gemv(x, w, b)), f"seed {seed}: two runs differ"
    for rows in (1, 3, 5):
        alone = triton_linear.gemv(x[:rows].contiguous(), w, b)
        assert torch.equal(alone, together[:rows]), f"seed {seed}: rows 0..{rows} alone differ"
    return True


def case_gemv_rejects(what: str) -> str:
    from kernels import triton_linear

    x = torch.zeros(2, 32)
    w = torch.zeros(16, 32)
    bad = {
        "too_many_rows": lambda: triton_linear.gemv(torch.zeros(triton_linear.MAX_ROWS + 1, 32), w),
        "k_mismatch": lambda: triton_linear.gemv(x, torch.zeros(16, 31)),
        "dtype_mismatch": lambda: triton_linear.gemv(x, w.half()),
        "bias_shape": lambda: triton_linear.gemv(x, w, torch.zeros(15)),
    }[what]
    try:
        bad()
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"{what} was accepted")


def case_gemv_tiles(rows: int, n: int, k: int, num_sms: int) -> list[int]:
    from kernels import triton_linear

    return list(triton_linear.gemv_tiles(rows, n, k, num_sms))


def case_compile_gemv(dtype: str, rows: int, n: int, k: int, bias: bool) -> dict[str, int]:
    from kernels import triton_linear

    dt = _DTYPES[dtype]
    x, w = torch.empty(rows, k, dtype=dt), torch.empty(n, k, dtype=dt)
    b = torch.empty(n, dtype=dt) if bias else None
    return compile_sm90(triton_linear.plan_gemv(x, w, b, torch.empty(rows, n, dtype=dt)))


def case_model_linears_take_the_gemv(seed: int) -> list[int]:
    """``get_ops("triton", gemv=True)`` carries the GEMV, and a model's FusedLinear uses it
    for a few rows and F.linear beyond; both agree with F.linear."""
    from engine_service.models.decoder import FusedLinear
    from kernels.dispatch import get_ops

    ops = get_ops("triton", gemv=True)
    assert ops.small_rows_linear is not None and ops.small_rows_max == 8
    assert get_ops("triton").small_rows_linear is None and get_ops("torch", gemv=True).small_rows_linear is None
    gen = torch.Generator().manual_seed(seed)
    dev = _device()
    linear = FusedLinear(48, 40, True, torch.float32, dev, ops)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 48, generator=gen))
        linear.bias.copy_(torch.randn(40, generator=gen))
    calls = []
    inner = linear._small_rows
    linear._small_rows = lambda *a: calls.append(a[0].shape[0]) or inner(*a)  # type: ignore[misc]
    for rows in (1, 8, 9, 33):
        x = torch.randn(rows, 48, generator=gen).to(dev)
        expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
        torch.testing.assert_close(linear(x), expected, atol=1e-4, rtol=1e-4)
    return calls


_CASES = {name[len("case_") :]: fn for name, fn in list(globals().items()) if name.startswith("case_")}


def serve() -> None:
    _serve(_CASES)


# ------------------------------------------------------------------ fixtures and tests


def _worker(tmp_path_factory: pytest.TempPathFactory, interpret: bool, device: str = "cpu") -> KernelWorker:
    tmp = tmp_path_factory.mktemp("triton-gemv")
    return KernelWorker(_worker_env(interpret, tmp / "cache", device), tmp / "worker.log", module=__name__)


@pytest.fixture(scope="module", params=_NUMERICS_MODES)
def numerics(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelWorker]:
    interpreter = request.param == "interpreter"
    worker = _worker(tmp_path_factory, interpreter, "cpu" if interpreter else "cuda")
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelWorker]:
    worker = _worker(tmp_path_factory, interpret=False)
    yield worker
    worker.close()


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


@pytest.mark.parametrize(
    ("dtype", "rows", "n", "k", "bias", "pad"),
    [
        ("float32", 1, 96, 64, False, 0),
        ("float32", 3, 50, 200, True, 7),  # N and K off every tile, a strided x
        ("float16", 8, 130, 96, True, 0),
        ("bfloat16", 1, 64, 1000, False, 0),
        ("bfloat16", 5, 33, 48, True, 16),
        ("float16", 2, 300, 520, False, 0),  # K past one 512-column step
    ],
)
def test_gemv_matches_a_float64_product(
    numerics: KernelWorker, dtype: str, rows: int, n: int, k: int, bias: bool, pad: int
) -> None:
    numerics.call("gemv", seed=_seed(), dtype=dtype, rows=rows, n=n, k=k, bias=bias, x_stride_pad=pad)


def test_gemv_rows_are_independent_and_runs_repeat(numerics: KernelWorker) -> None:
    assert numerics.call("gemv_rows_are_independent", seed=_seed(), dtype="float16", n=70, k=130) is True


@pytest.mark.parametrize("what", ["too_many_rows", "k_mismatch", "dtype_mismatch", "bias_shape"])
def test_gemv_rejects_bad_input(numerics: KernelWorker, what: str) -> None:
    assert numerics.call("gemv_rejects", what=what)


def test_gemv_grid_covers_the_sms(numerics: KernelWorker) -> None:
    # Llama-3.2-1B at batch 1 on 132 SMs: o_proj (2048 rows) and qkv (3072) in narrow
    # row blocks for >= 4 programs an SM; gate_up (16384) in wide ones.
    assert numerics.call("gemv_tiles", rows=1, n=2048, k=2048, num_sms=132) == [2, 512]
    assert numerics.call("gemv_tiles", rows=1, n=3072, k=2048, num_sms=132) == [4, 512]
    assert numerics.call("gemv_tiles", rows=1, n=16384, k=2048, num_sms=132) == [16, 512]
    assert numerics.call("gemv_tiles", rows=8, n=2048, k=8192, num_sms=132) == [2, 512]
    assert numerics.call("gemv_tiles", rows=8, n=49152, k=2048, num_sms=132) == [32, 32]


def test_model_linears_use_the_gemv_for_few_rows(numerics: KernelWorker) -> None:
    assert numerics.call("model_linears_take_the_gemv", seed=_seed()) == [1, 8]


@pytest.mark.parametrize(
    ("dtype", "rows", "n", "k", "bias"),
    [
        ("bfloat16", 1, 3072, 2048, False),  # Llama-3.2-1B qkv
        ("bfloat16", 8, 2048, 8192, False),  # its down_proj at 8 rows
        ("float16", 4, 1536, 1536, True),  # Qwen2 qkv has a bias
        ("float32", 1, 2048, 2048, False),
    ],
)
def test_gemv_compiles_for_sm90(compiler: KernelWorker, dtype: str, rows: int, n: int, k: int, bias: bool) -> None:
    report = compiler.call("compile_gemv", dtype=dtype, rows=rows, n=n, k=k, bias=bias)
    assert report["registers"] <= 255
