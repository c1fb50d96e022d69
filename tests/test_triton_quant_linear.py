"""The quantized linears of kernels/triton_quant_linear.py and their use on CUDA
(engine_service/models/gpu_quant.py).

- ``int4_linear`` against ``Int4Rows.dequantize()`` and ``fp8_linear`` against the
  dequantized FP8 weight, in the Triton interpreter (and compiled on the GPU where there is
  one): groups 32 / 96 / 128, act-order, bias, decode-sized and larger M (split-K and not),
  N and K off the tiles, float32 (tight) and bfloat16; every FP8 code decoded exactly, by
  the GPU's float8 conversion and by the bit decoding of GPUs without one.
- Packing round trips (``pack_int4``, ``pack_fp8``), and the kernels compiled for sm_90
  (sm_80 for the byte-decoded FP8 path) without register spills.
- A model: tiny GPTQ / AWQ / FP8 checkpoints (tests/quant_checkpoints.py) loaded, packed
  by ``pack_quantized_cuda`` (on CPU, under the interpreter), each packed layer and the
  logits against the dense model. Which layers get packed (parts merged per parameter) is
  also checked here, without triton, as are ``merge_parts`` and ``keep_fp8`` loading.

The Triton cases run in worker processes as tests/test_kernels.py explains (whether Triton
interprets is fixed at import). Inputs are fresh random values every run; the seed is in
every failure message.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine_service.models.gpu_quant import merge_parts, plan_quantized
from engine_service.models.loader import load_model
from engine_service.models.quantized import Fp8Rows, Int4Rows
from tests import quant_checkpoints as qc
from tests.quant_checkpoints import Spec
from tests.test_kernels import _NUMERICS_MODES, KernelWorker, _device, _worker_env, compile_sm90
from tests.test_kernels import serve as _serve

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (atol, rtol): float32 sums in another order; bfloat16 outputs rounded (truncated by the
# interpreter) to bfloat16, inputs exact in both.
_TOL = {"float32": (3e-5, 3e-5), "bfloat16": (2e-2, 2e-2), "float16": (3e-3, 3e-3)}


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _int4_rows(gen: torch.Generator, n: int, k: int, group: int, perm: bool) -> Int4Rows:
    """Random codes, positive scales and GPTQ-like mins (-scale * zero, plus a little)."""
    groups = k // group
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 0.004
    zeros = torch.randint(0, 16, (n, groups), generator=gen).float()
    mins = -scales * zeros + torch.randn(n, groups, generator=gen) * 0.01
    return Int4Rows(codes, scales, mins, group, torch.randperm(k, generator=gen) if perm else None)


def _fp8_values(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    """float8_e4m3fn [n, k]: random finite codes (subnormals and both signs included)."""
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int64).to(torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no NaN
    return codes.view(torch.float8_e4m3fn)


def _fp8_native_ok(native: bool) -> bool:
    """Whether this worker's device runs the float8-converting path."""
    dev = _device()
    return not native or dev.type == "cpu" or torch.cuda.get_device_capability(dev) >= (8, 9)


# ------------------------------------------------------------------ cases (in the workers)


def case_int4_linear(
    seed: int, dtype: str, m: int, n: int, k: int, group: int, perm: bool, bias: bool,
    tiles: list[int] | None = None, lead: list[int] | None = None,
) -> dict[str, Any]:
    """``int4_linear`` vs ``x @ rows.dequantize().T + bias`` (float32 reference on CPU).
    ``tiles``: [block_m, block_n, block_k, split_k] instead of the default plan; ``lead``:
    x's leading dims (their product is m)."""
    from kernels import triton_quant_linear as tq

    gen = torch.Generator().manual_seed(seed)
    dt, dev = _DTYPES[dtype], _device()
    rows = _int4_rows(gen, n, k, group, perm)
    x = torch.randn(m, k, generator=gen).to(dt)
    b = torch.randn(n, generator=gen).to(dt) if bias else None
    w = tq.pack_int4(rows, dev)
    plan = None if tiles is None else tq.LinearTiles(*tiles)
    x_in = x.to(dev) if lead is None else x.reshape(*lead, k).to(dev)
    got = tq.int4_linear(x_in, w, None if b is None else b.to(dev), plan).cpu()
    assert got.dtype == dt and got.shape == (*(lead or [m]), n), got.shape
    want = x.float() @ rows.dequantize().T + (0 if b is None else b.float())
    atol, rtol = _TOL[dtype]
    torch.testing.assert_close(got.reshape(m, n).float(), want, atol=atol, rtol=rtol,
                               msg=lambda e: f"int4 seed={seed}: {e}")
    default = tq.linear_tiles(m, n, k, tq._block_k_max(group), float32=dt == torch.float32)
    return {"err": float((got.reshape(m, n).float() - want).abs().max()), "split_k": default.split_k}


def case_fp8_linear(
    seed: int, dtype: str, m: int, n: int, k: int, per_channel: bool, native: bool, bias: bool,
) -> float | None:
    """``fp8_linear`` vs ``x @ (values * scale).T + bias``; None where the device lacks float8."""
    from kernels import triton_quant_linear as tq

    if not _fp8_native_ok(native):
        return None
    gen = torch.Generator().manual_seed(seed)
    dt, dev = _DTYPES[dtype], _device()
    values = _fp8_values(gen, n, k)
    scale = torch.rand(n, 1, generator=gen) * 0.02 + 0.001 if per_channel else torch.rand(1, generator=gen) * 0.02
    x = torch.randn(m, k, generator=gen).to(dt)
    b = torch.randn(n, generator=gen).to(dt) if bias else None
    w = tq.pack_fp8(values, scale, dev, native=native)
    assert w.native == native and w.per_channel == per_channel
    got = tq.fp8_linear(x.to(dev), w, None if b is None else b.to(dev)).cpu()
    want = x.float() @ (values.float() * scale).T + (0 if b is None else b.float())
    atol, rtol = _TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol, msg=lambda e: f"fp8 seed={seed}: {e}")
    return float((got.float() - want).abs().max())


def case_fp8_every_code(native: bool) -> bool | None:
    """Every finite float8_e4m3fn code (subnormals, zeros, both signs) comes out of the
    kernel exactly: one-hot rows of x pick each weight column out."""
    from kernels import triton_quant_linear as tq

    if not _fp8_native_ok(native):
        return None
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254
    k = 32
    values = torch.stack([codes.roll(j) for j in range(k)], dim=1).view(torch.float8_e4m3fn)  # [254, 32]
    scale = torch.tensor([1.0])
    x = torch.eye(k)
    dev = _device()
    got = tq.fp8_linear(x.to(dev), tq.pack_fp8(values, scale, dev, native=native)).cpu()
    assert torch.equal(got, values.float().T), "decoded codes differ"
    return True


def case_pack_round_trips(seed: int) -> bool:
    """``Int4Weight`` holds exactly the rows' codes (in the kernel's column order), scales,
    mins and perm; ``Fp8Weight`` the values and scales, either way of loading them."""
    from kernels import triton_quant_linear as tq

    gen = torch.Generator().manual_seed(seed)
    dev = _device()
    for group, perm in ((32, False), (96, True), (128, True)):
        rows = _int4_rows(gen, 40, 384, group, perm)
        w = tq.pack_int4(rows, dev)
        assert w.qweight.dtype == torch.int32 and w.qweight.shape == (48, 40) and w.shape == (40, 384)
        assert torch.equal(w.unpacked().cpu(), rows.unpacked()), f"seed {seed}: codes"
        assert torch.equal(w.scales.T.cpu(), rows.scales) and torch.equal(w.mins.T.cpu(), rows.mins)
        assert (w.perm is None) == (rows.perm is None)
        assert w.perm is None or torch.equal(w.perm.cpu(), rows.perm)
        assert torch.equal(w.dequantize().cpu(), rows.dequantize()), f"seed {seed}: dequantized"
        assert w.nbytes == 40 * 384 // 2 + 2 * 4 * 40 * 384 // group + (8 * 384 if perm else 0)
    for bad in (16, 48):
        with pytest.raises(ValueError):
            tq.pack_int4(_int4_rows(gen, 8, 96, bad, False), dev)
    values = _fp8_values(gen, 24, 40)
    for scale in (torch.tensor([0.5]), torch.rand(24, 1, generator=gen)):
        for native in (False, True):
            w = tq.pack_fp8(values, scale, dev, native=native)
            assert torch.equal(w.dequantize().cpu(), Fp8Rows(values, scale).dequantize())
    with pytest.raises(ValueError):
        tq.pack_fp8(values, torch.ones(5, 1))
    return True


def _prefill(model: Any, tokens: list[int], dev: torch.device) -> torch.Tensor:
    """Logits of one sequence's prefill (float32 [len, vocab])."""
    from engine_service.attention import AttentionMetadata

    cfg = model.config
    n, block = len(tokens), 16
    caches = [
        (torch.zeros(4, block, cfg.num_kv_heads, cfg.head_dim, device=dev),
         torch.zeros(4, block, cfg.num_kv_heads, cfg.head_dim, device=dev))
        for _ in range(cfg.num_layers)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev),
        block_tables=torch.arange(4, dtype=torch.int32, device=dev)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        max_query_len=n,
        max_seq_len=n,
    )
    with torch.inference_mode():
        ids = torch.tensor(tokens, device=dev)
        return model.compute_logits(model(ids, torch.arange(n, device=dev), caches, meta)).cpu()


def case_model_packed(seed: int, model_dir: str) -> dict[str, Any]:
    """A quantized checkpoint loaded (``keep_fp8``) and packed: each packed layer's output
    and a prefill's logits against the same checkpoint's dense model; the packed weights
    follow ``module.to()``. Returns what was packed and the layers' bytes."""
    from engine_service.models.gpu_quant import QuantizedLinearWeight
    from engine_service.models.layers import FusedLinear

    gen = torch.Generator().manual_seed(seed)
    dev = _device()
    model, config = load_model(model_dir, torch.float32, dev, keep_fp8=True)
    dense, _ = load_model(model_dir, torch.float32, dev)
    plans = model.pack_quantized_cuda()
    assert model.int4_rows == {} and model.fp8_rows == {}
    dense_modules = dict(dense.named_modules())
    packed_bytes = dense_bytes = 0
    for name, module in model.named_modules():
        if type(module) is not FusedLinear or module.weight is not None:
            continue
        assert isinstance(module.packed_weight, QuantizedLinearWeight), name
        ref = dense_modules[name]
        x = torch.randn(7, ref.weight.shape[1], generator=gen).to(dev)
        with torch.inference_mode():
            got, want = module(x).cpu(), F.linear(x, ref.weight, ref.bias).cpu()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda e, n=name: f"seed {seed} {n}: {e}")
        packed_bytes += module.packed_weight.nbytes
        dense_bytes += ref.weight.nbytes
    tokens = torch.randint(0, config.vocab_size, (9,), generator=gen).tolist()
    got, want = _prefill(model, tokens, dev), _prefill(dense, tokens, dev)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda e: f"seed {seed} logits: {e}")
    linear = next(m for m in model.modules() if isinstance(m, QuantizedLinearWeight))
    linear.to("meta")
    moved = [getattr(linear.packed, f) for f in linear._tensor_fields]
    assert all(t.device.type == "meta" for t in moved), "packed tensors did not follow .to()"
    return {
        "packed": sorted(p.param for p in plans if p.packable),
        "dense": sorted(p.param for p in plans if not p.packable),
        "packed_bytes": packed_bytes,
        "dense_bytes": dense_bytes,
    }


def _compile(launch: Any, arch: int) -> dict[str, int]:
    if arch == 90:
        return compile_sm90(launch)
    import triton
    from triton.backends.compiler import GPUTarget

    compiled = triton.compile(launch.ast_source(), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": launch.num_warps})
    assert compiled.asm["cubin"], "no cubin"
    return {"shared": compiled.metadata.shared}


def case_compile(kind: str, dtype: str, m: int, n: int, k: int, group: int = 128, native: bool = True,
                 arch: int = 90) -> list[dict[str, int]]:
    """The launches of one call, compiled for sm_``arch`` (tensors on meta: never touched)."""
    from kernels import triton_quant_linear as tq

    dt = _DTYPES[dtype]
    meta = torch.device("meta")
    if kind == "int4":
        w: Any = tq.Int4Weight(torch.empty(k // 8, n, dtype=torch.int32, device=meta),
                               torch.empty(k // group, n, device=meta), torch.empty(k // group, n, device=meta), group)
        tiles = tq.linear_tiles(m, n, k, tq._block_k_max(group), float32=dt == torch.float32)
        plan = tq.plan_int4_linear
    else:
        w = tq.Fp8Weight(torch.empty(n, k, dtype=torch.float8_e4m3fn if native else torch.uint8, device=meta),
                         torch.empty(n, device=meta))
        tiles = tq.linear_tiles(m, n, k, 128, float32=dt == torch.float32)
        plan = tq.plan_fp8_linear
    x, bias = torch.empty(m, k, dtype=dt, device=meta), torch.empty(n, dtype=dt, device=meta)
    out = torch.empty(m, n, dtype=dt, device=meta)
    target = out if tiles.split_k == 1 else torch.empty(tiles.split_k, m, n, device=meta)
    reports = [_compile(plan(target, x, w, bias, tiles), arch)]
    if tiles.split_k > 1:
        reports.append(_compile(tq.plan_split_k_sum(out, target, bias), arch))
    return reports


def case_group_rule_agrees() -> bool:
    """gpu_quant repeats the kernel's group rule so that planning needs no triton."""
    from engine_service.models import gpu_quant
    from kernels import triton_quant_linear as tq

    return gpu_quant.INT4_GROUP_MULTIPLE == tq.INT4_GROUP_MULTIPLE


_CASES = {name[len("case_") :]: fn for name, fn in list(globals().items()) if name.startswith("case_")}


def serve() -> None:
    _serve(_CASES)


# ------------------------------------------------------------------ workers


def _worker(tmp_path_factory: pytest.TempPathFactory, interpret: bool, device: str = "cpu") -> KernelWorker:
    tmp = tmp_path_factory.mktemp("triton-quant")
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


# ------------------------------------------------------------------ kernels


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("group", "perm", "n", "k"), [(32, False, 100, 160), (128, True, 72, 384), (32, True, 40, 96)])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_int4_linear_matches_the_dequantized_rows(
    numerics: KernelWorker, dtype: str, group: int, perm: bool, n: int, k: int, m: int
) -> None:
    result = numerics.call("int4_linear", seed=_seed(), dtype=dtype, m=m, n=n, k=k, group=group, perm=perm,
                           bias=m != 5)
    assert (result["split_k"] > 1) == (m <= 16)  # decode-sized calls split K on a small grid


@pytest.mark.parametrize(
    ("dtype", "m", "n", "k", "group", "tiles", "lead"),
    [
        ("float32", 40, 100, 288, 96, None, None),  # group 96 (K steps of 32), M off the tile
        ("bfloat16", 3, 130, 256, 64, [16, 64, 64, 1], None),  # decode without split-K
        ("bfloat16", 6, 64, 640, 128, [16, 32, 128, 3], [2, 3]),  # uneven split (5 steps: 2, 2, 1), 3-D x
        ("float16", 20, 96, 256, 128, None, None),
    ],
)
def test_int4_linear_other_shapes(
    numerics: KernelWorker, dtype: str, m: int, n: int, k: int, group: int, tiles: list[int] | None,
    lead: list[int] | None,
) -> None:
    numerics.call("int4_linear", seed=_seed(), dtype=dtype, m=m, n=n, k=k, group=group, perm=False, bias=True,
                  tiles=tiles, lead=lead)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("m", [1, 64])
def test_fp8_linear_matches_the_dequantized_weight(
    numerics: KernelWorker, dtype: str, per_channel: bool, native: bool, m: int
) -> None:
    numerics.call("fp8_linear", seed=_seed(), dtype=dtype, m=m, n=70, k=200, per_channel=per_channel,
                  native=native, bias=per_channel)


@pytest.mark.parametrize("native", [False, True])
def test_fp8_every_code_decodes_exactly(numerics: KernelWorker, native: bool) -> None:
    assert numerics.call("fp8_every_code", native=native) in (True, None)


def test_packing_round_trips(numerics: KernelWorker) -> None:
    assert numerics.call("pack_round_trips", seed=_seed()) is True
    assert numerics.call("group_rule_agrees") is True


@pytest.mark.parametrize(
    ("kind", "dtype", "m", "n", "k", "group", "native", "arch"),
    [
        ("int4", "bfloat16", 1, 4096, 4096, 128, True, 90),  # decode: split-K and its sum
        ("int4", "bfloat16", 512, 4096, 4096, 128, True, 90),  # prefill tiles
        ("int4", "float32", 64, 1024, 1024, 32, True, 90),  # IEEE float32 dots
        ("fp8", "bfloat16", 256, 4096, 4096, 0, True, 90),  # float8 converted natively
        ("fp8", "bfloat16", 1, 4096, 4096, 0, False, 80),  # bytes decoded: A100
    ],
)
def test_kernels_compile(
    compiler: KernelWorker, kind: str, dtype: str, m: int, n: int, k: int, group: int, native: bool, arch: int
) -> None:
    reports = compiler.call("compile", kind=kind, dtype=dtype, m=m, n=n, k=k, group=group or 128, native=native,
                            arch=arch)
    assert all(r.get("registers", 0) <= 255 for r in reports)


# ------------------------------------------------------------------ the model


# case -> (base checkpoint fixture, spec, parameters expected to stay dense, and why)
_LAYERS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
MODEL_CASES: dict[str, tuple[str, Spec, dict[str, str]]] = {
    "gptq-g32": ("tiny_llama_dir", Spec("gptq", 32), {}),
    # AutoGPTQ's act-order: each layer its own random perm here, so q/k/v and gate/up differ
    "gptq-g32-act-order": (
        "tiny_qwen3_dir", Spec("gptq", 32, act_order=True, sym=False),
        {f"layers.{i}.{name}.weight": "act-order" for i in range(2) for name in _LAYERS[::2]},
    ),
    "awq-g32-one-layer-float": (
        "tiny_llama_dir", Spec("awq", 32, not_converted=("model.layers.1.mlp.down_proj",)), {},
    ),
    "fp8-channel": ("tiny_qwen3_dir", Spec("fp8", strategy="channel"), {}),
    "fp8-tensor": ("tiny_llama_dir", Spec("fp8", strategy="tensor"), {}),
}


@pytest.fixture(scope="module")
def checkpoints(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """case -> quantized checkpoint dir, written on first use."""
    made: dict[str, str] = {}

    def get(case: str) -> str:
        if case not in made:
            base, spec, _ = MODEL_CASES[case]
            root = tmp_path_factory.mktemp(case)
            made[case] = qc.write_quantized(request.getfixturevalue(base), str(root / "q"), str(root / "r"), spec)[0]
        return made[case]

    return get


def _linears(model: Any) -> set[str]:
    return {f"layers.{i}.{name}.weight" for i in range(model.config.num_layers) for name in _LAYERS}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_which_layers_get_packed(case: str, checkpoints: Any) -> None:
    """Every projection whose rows all came quantized is planned for packing, fused ones
    merged from their parts in row order; the rest stay dense, with the reason."""
    _, spec, dense = MODEL_CASES[case]
    model, _ = load_model(checkpoints(case), keep_fp8=True)
    plans = {p.param: p for p in plan_quantized(model)}
    float_layers = {"layers.1.mlp.down_proj.weight"} if spec.not_converted else set()
    assert set(plans) == _linears(model) - float_layers
    for name, plan in plans.items():
        if name in dense:
            assert not plan.packable and dense[name] in plan.reason, (name, plan.reason)
            continue
        assert plan.packable, (name, plan.reason)
        params = dict(model.named_parameters())
        # the merged rows are the parameter's own (the dense copy is their dequantized values)
        assert torch.equal(plan.merged().dequantize(), params[name].float()), name
        assert plan.kind == ("fp8" if spec.method == "fp8" else "int4")


def test_fp8_rows_only_when_asked(checkpoints: Any) -> None:
    """The default (CPU) load keeps FP8 dequantized only; ``keep_fp8`` also hands every FP8
    matrix over as stored, the parameters unchanged."""
    path = checkpoints("fp8-channel")
    plain, _ = load_model(path)
    kept, _ = load_model(path, keep_fp8=True)
    assert plain.fp8_rows == {} and plan_quantized(plain) == []
    assert set(kept.fp8_rows) == _linears(kept)
    assert len(kept.fp8_rows["layers.0.self_attn.qkv_proj.weight"]) == 3  # q, k, v at their rows
    for name, param in plain.named_parameters():
        assert torch.equal(param, dict(kept.named_parameters())[name]), name
    for parts in kept.fp8_rows.values():
        for _, rows in parts:
            assert isinstance(rows, Fp8Rows) and rows.values.dtype == torch.float8_e4m3fn and rows.per_channel


@pytest.mark.parametrize("case", ["gptq-g32", "gptq-g32-act-order", "fp8-tensor"])
def test_packed_model_matches_the_dense_model(numerics: KernelWorker, case: str, checkpoints: Any) -> None:
    result = numerics.call("model_packed", seed=_seed(), model_dir=checkpoints(case))
    dense = MODEL_CASES[case][2]
    assert result["dense"] == sorted(dense) and len(result["packed"]) == 8 - len(dense)
    # 4-bit: codes 1/8 of float32, plus float32 scale and min per 32 (and act-order's perm); FP8: 1/4
    assert result["packed_bytes"] < result["dense_bytes"] * (0.25 if case.startswith("gptq") else 0.3)


# ------------------------------------------------------------------ merging parts


def test_merge_parts() -> None:
    gen = torch.Generator().manual_seed(_seed())
    a, b = _int4_rows(gen, 8, 64, 32, False), _int4_rows(gen, 4, 64, 32, False)
    merged = merge_parts([(8, b), (0, a)], 12)  # in row order whatever the order they came in
    assert isinstance(merged, Int4Rows)
    assert torch.equal(merged.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert "not quantized" in merge_parts([(0, a)], 12)  # type: ignore[operator]
    assert "not quantized" in merge_parts([(0, a), (9, b)], 13)  # type: ignore[operator]
    assert "overlap" in merge_parts([(0, a), (4, b)], 12)  # type: ignore[operator]
    other_group = _int4_rows(gen, 4, 64, 64, False)
    assert "group" in merge_parts([(0, a), (8, other_group)], 12)  # type: ignore[operator]
    assert isinstance(merge_parts([(0, other_group)], 4), Int4Rows)  # 64: a multiple of 32
    assert "multiple of 32" in merge_parts([(0, _int4_rows(gen, 4, 64, 16, False))], 4)  # type: ignore[operator]
    p = torch.randperm(64, generator=gen)
    with_perm = [Int4Rows(r.codes, r.scales, r.mins, 32, p) for r in (a, b)]
    assert isinstance(merge_parts([(0, with_perm[0]), (8, with_perm[1])], 12), Int4Rows)
    assert "act-order" in merge_parts([(0, with_perm[0]), (8, b)], 12)  # type: ignore[operator]
    other_perm = Int4Rows(b.codes, b.scales, b.mins, 32, torch.randperm(64, generator=gen))
    assert "act-order" in merge_parts([(0, with_perm[0]), (8, other_perm)], 12)  # type: ignore[operator]
    f1, f2 = _fp8_values(gen, 8, 16), _fp8_values(gen, 4, 16)
    fa = merge_parts([(0, Fp8Rows(f1, torch.tensor([0.5]))), (8, Fp8Rows(f2, torch.tensor([0.5])))], 12)
    assert isinstance(fa, Fp8Rows) and not fa.per_channel  # one per-tensor scale stays one
    fb = merge_parts([(0, Fp8Rows(f1, torch.tensor([0.5]))), (8, Fp8Rows(f2, torch.tensor([0.25])))], 12)
    assert isinstance(fb, Fp8Rows) and fb.per_channel and fb.scales.shape == (12, 1)
    assert torch.equal(fb.dequantize(), torch.cat([f1.float() * 0.5, f2.float() * 0.25]))
    assert "formats" in merge_parts([(0, a), (8, Fp8Rows(f2, torch.tensor([1.0])))], 12)  # type: ignore[operator]
    e5m2 = Fp8Rows(torch.zeros(4, 16, dtype=torch.float8_e5m2), torch.tensor([1.0]))
    assert "float8_e5m2" in merge_parts([(0, e5m2)], 4)  # type: ignore[operator]
