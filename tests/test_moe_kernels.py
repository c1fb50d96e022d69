"""Mixture-of-experts kernels (kernels/moe.py, kernels/triton_moe.py, kernels/csrc/moe_cpu.cpp).

- ``route`` and ``fused_moe_reference`` against Hugging Face transformers' own router and
  expert modules (Mixtral, Qwen3-MoE, OLMoE), ties included.
- The Triton kernels against the reference in the Triton interpreter (and on the GPU where
  there is one), and compiled for sm_90; they run in worker processes as
  tests/test_kernels.py explains (whether Triton interprets is fixed at import).
- The native CPU grouped op on float32 panels (tight) and int8 panels (against the
  reference on the same int8 weights, x rounded as the int8 loop rounds it).

Inputs are fresh random values every run; the seed is in every failure message.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from kernels import moe
from tests.test_kernels import _NUMERICS_MODES, KernelWorker, _device, _worker_env, compile_sm90
from tests.test_kernels import serve as _serve

# float32 through the kernels vs the float32 reference: the sums' rounding only.
_TOL32 = (2e-5, 2e-5)


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _experts(gen: torch.Generator, e: int, h: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    return w13, w2


def _routing(gen: torch.Generator, t: int, e: int, k: int, used: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (weights, ids) with k distinct experts a token, drawn from ``used`` (default
    all E): experts outside it get no token."""
    pool = torch.tensor(used if used is not None else list(range(e)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(t)]) if t else \
        torch.empty(0, k, dtype=torch.int64)
    weights = torch.rand(t, k, generator=gen) + 0.05
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


# ------------------------------------------------------------------ cases (in the workers)


def case_triton_moe(seed: int, dtype: str, t: int, h: int, i: int, e: int, k: int, skew: str) -> float:
    """The fused Triton MoE against the reference. ``skew``: "uniform" (every expert may be
    picked), "some_empty" (a third of the experts get no token), "one_expert" (top-1, every
    token on one expert: several blocks of one expert)."""
    from kernels import triton_moe

    gen = torch.Generator().manual_seed(seed)
    dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    w13, w2 = _experts(gen, e, h, i)
    x = torch.randn(t, h, generator=gen)
    used = {"uniform": None, "some_empty": sorted(torch.randperm(e, generator=gen)[: max(k, 2 * e // 3)].tolist()),
            "one_expert": [int(torch.randint(0, e, (), generator=gen))]}[skew]
    weights, ids = _routing(gen, t, e, k, used)
    x, w13, w2 = x.to(dt), w13.to(dt), w2.to(dt)
    dev = _device()
    got = triton_moe.fused_moe(x.to(dev), w13.to(dev), w2.to(dev), weights.to(dev), ids.to(dev)).cpu()
    want = moe.fused_moe_reference(x, w13, w2, weights, ids)
    assert got.shape == (t, h) and got.dtype == dt
    atol, rtol = _TOL32 if dtype == "float32" else (2e-2, 2e-2)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"seed {seed}: {m}")
    return float((got.float() - want.float()).abs().max())


def case_moe_align(seed: int, t: int, e: int, k: int, block_m: int) -> bool:
    """Every slot once, each in a block of its expert, runs padded with T k, block counts
    fixed by (T k, E, block_m), unused blocks -1, slots in order within an expert."""
    from kernels import triton_moe

    gen = torch.Generator().manual_seed(seed)
    used = sorted(torch.randperm(e, generator=gen)[: max(k, e // 2)].tolist())
    _, ids = _routing(gen, t, e, k, used)
    sorted_ids, block_expert = triton_moe.moe_align(ids.to(_device()), e, block_m)
    sorted_ids, block_expert = sorted_ids.cpu(), block_expert.cpu()
    n = t * k
    assert sorted_ids.dtype == torch.int32 and block_expert.dtype == torch.int32
    assert block_expert.shape[0] * block_m == sorted_ids.shape[0] == triton_moe._max_blocks(n, e, block_m) * block_m
    flat = ids.reshape(-1).long()
    real = sorted_ids[sorted_ids < n].long()
    assert torch.equal(torch.sort(real).values, torch.arange(n)), f"seed {seed}: slots lost or doubled"
    assert bool((sorted_ids <= n).all())
    blocks = sorted_ids.view(-1, block_m)
    seen_unused = False
    for b, expert in enumerate(block_expert.tolist()):
        slots = blocks[b][blocks[b] < n].long()
        if expert < 0:
            seen_unused = True
            assert slots.numel() == 0
            continue
        assert not seen_unused, "a used block after an unused one"
        assert slots.numel() > 0 and bool((flat[slots] == expert).all()), f"seed {seed}: block {b}"
        assert torch.equal(slots, torch.sort(slots).values)
    return True


def case_compile_moe(dtype: str, t: int, h: int, i: int, e: int, k: int) -> list[dict[str, int]]:
    from kernels import triton_moe

    dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    n = t * k
    tiles = triton_moe.moe_tiles(n, e, h, i)
    blocks = triton_moe._max_blocks(n, e, tiles.block_m)
    x, act, y = torch.empty(t, h, dtype=dt), torch.empty(n, i, dtype=dt), torch.empty(n, h, dtype=dt)
    w13 = torch.empty(e, 2 * i, h, dtype=dt, device="meta")
    w2 = torch.empty(e, h, i, dtype=dt, device="meta")
    sorted_ids = torch.empty(blocks * tiles.block_m, dtype=torch.int32)
    block_expert = torch.empty(blocks, dtype=torch.int32)
    return [
        compile_sm90(triton_moe.plan_moe_gate_up(act, x, w13, sorted_ids, block_expert, k, tiles)),
        compile_sm90(triton_moe.plan_moe_down(y, act, w2, torch.empty(n), sorted_ids, block_expert, tiles)),
        compile_sm90(triton_moe.plan_moe_sum(x, y, k)),
    ]


_CASES = {name[len("case_") :]: fn for name, fn in list(globals().items()) if name.startswith("case_")}


def serve() -> None:
    _serve(_CASES)


# ------------------------------------------------------------------ Triton tests


def _worker(tmp_path_factory: pytest.TempPathFactory, interpret: bool, device: str = "cpu") -> KernelWorker:
    tmp = tmp_path_factory.mktemp("triton-moe")
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


@pytest.mark.parametrize(
    ("dtype", "t", "h", "i", "e", "k", "skew"),
    [
        ("float32", 1, 64, 48, 8, 2, "uniform"),  # decode: top-2 of 8, I off the tile
        ("float32", 1, 40, 32, 8, 1, "uniform"),  # top-1 (the down kernel writes out itself), H off the tile
        ("float32", 37, 96, 80, 8, 2, "some_empty"),  # a few dozen tokens, experts with none
        ("float32", 24, 64, 40, 16, 8, "uniform"),  # top-8 of 16
        ("float32", 3, 64, 48, 64, 8, "some_empty"),  # more experts than slots
        ("float32", 40, 48, 32, 4, 1, "one_expert"),  # one expert, several blocks of it
        ("bfloat16", 9, 64, 48, 8, 2, "uniform"),
    ],
)
def test_triton_moe_matches_the_reference(
    numerics: KernelWorker, dtype: str, t: int, h: int, i: int, e: int, k: int, skew: str
) -> None:
    numerics.call("triton_moe", seed=_seed(), dtype=dtype, t=t, h=h, i=i, e=e, k=k, skew=skew)


@pytest.mark.parametrize(("t", "e", "k", "block_m"), [(1, 8, 2, 16), (37, 8, 2, 16), (50, 64, 8, 32), (5, 4, 1, 64)])
def test_moe_align_groups_every_slot_by_expert(numerics: KernelWorker, t: int, e: int, k: int, block_m: int) -> None:
    assert numerics.call("moe_align", seed=_seed(), t=t, e=e, k=k, block_m=block_m) is True


@pytest.mark.parametrize(
    ("dtype", "t", "h", "i", "e", "k"),
    [
        ("bfloat16", 1, 4096, 14336, 8, 2),  # Mixtral-8x7B decode
        ("bfloat16", 512, 2048, 768, 128, 8),  # Qwen3-30B-A3B prefill chunk
        ("float32", 4, 2048, 1024, 64, 8),  # OLMoE, float32 (IEEE dots)
    ],
)
def test_triton_moe_compiles_for_sm90(compiler: KernelWorker, dtype: str, t: int, h: int, i: int, e: int, k: int) -> None:
    for report in compiler.call("compile_moe", dtype=dtype, t=t, h=h, i=i, e=e, k=k):
        assert report["registers"] <= 255


# ------------------------------------------------------------------ routing and reference vs transformers


def _hf_routers(h: int, e: int, k: int):  # type: ignore[no-untyped-def]
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    mixtral = MixtralConfig(hidden_size=h, intermediate_size=8, num_local_experts=e, num_experts_per_tok=k)
    yield "mixtral", MixtralTopKRouter(mixtral), True
    for norm in (True, False):
        qwen3 = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=8, num_experts=e, num_experts_per_tok=k,
                               norm_topk_prob=norm)
        yield f"qwen3_moe norm={norm}", Qwen3MoeTopKRouter(qwen3), norm
    olmoe = OlmoeConfig(hidden_size=h, intermediate_size=8, num_experts=e, num_experts_per_tok=k)
    assert olmoe.norm_topk_prob is False
    yield "olmoe", OlmoeTopKRouter(olmoe), False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_equals_transformers_routers(dtype: torch.dtype) -> None:
    """Weights and ids bit for bit as transformers' routers give them, ties included
    (duplicated router rows make equal logits: torch.topk's order decides)."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    h, e, k, t = 32, 16, 4, 23
    x = torch.randn(t, h, generator=gen).to(dtype)
    for name, router, renormalize in _hf_routers(h, e, k):
        router = router.to(dtype)
        with torch.no_grad():
            weight = torch.randn(e, h, generator=gen)
            weight[5] = weight[2]  # experts 2 and 5 tie for every token
            weight[11] = weight[2]
            router.weight.copy_(weight)
            logits, hf_weights, hf_ids = router(x)
        weights, ids = moe.route(logits, k, renormalize, weights_dtype=None if name == "mixtral" else logits.dtype)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert torch.equal(ids.long(), hf_ids), f"seed {seed} {name}: ids differ"
        assert torch.equal(weights, hf_weights.float()), f"seed {seed} {name}: weights differ"
        if renormalize:
            torch.testing.assert_close(weights.sum(-1), torch.ones(t), atol=1e-2 if dtype != torch.float32 else 1e-6,
                                       rtol=0)


def test_route_ties_break_as_torch_topk() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = moe.route(logits, 2, renormalize=False)
    want = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), 2, dim=-1)
    assert torch.equal(ids.long(), want.indices) and torch.equal(weights, want.values)
    with pytest.raises(ValueError):
        moe.route(logits, 6, renormalize=True)


def test_reference_equals_transformers_experts() -> None:
    """``fused_moe_reference`` computes Mixtral's expert loop (transformers' tensors are
    laid out as ours: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    h, i, e, k, t = 48, 40, 8, 2, 19
    experts = MixtralExperts(MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e,
                                           num_experts_per_tok=k))
    w13, w2 = _experts(gen, e, h, i)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        x = torch.randn(t, h, generator=gen)
        weights, ids = moe.route(torch.randn(t, e, generator=gen), k, True)
        want = experts(x, ids.long(), weights)
    got = moe.fused_moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m: f"seed {seed}: {m}")


# ------------------------------------------------------------------ the native CPU op


def _native() -> bool:
    from kernels.cpu_ops import native_available

    return native_available()


native = pytest.mark.skipif(not _native(), reason="native CPU kernels need a C++ compiler")


def _int8_reference(x: torch.Tensor, experts: moe.ExpertWeights, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The int8 op's product: the dequantized weights, and x and the activation rounded to
    16 bits per row and block of 256 (where the build's int8 loop rounds: experts with fewer
    than ``panel_int8_float_rows`` rows)."""
    from kernels.panel_linear import round_x_16bit

    w13, w2 = experts.dense()
    inter = w13.shape[1] // 2
    limit = torch.ops.tandem_cpu.panel_int8_float_rows()
    out = torch.zeros(x.shape)
    for e in range(w13.shape[0]):
        tokens, choice = torch.where(ids.long() == e)
        if tokens.numel() == 0:
            continue
        rounds = tokens.numel() < limit
        xe = round_x_16bit(x[tokens]) if rounds else x[tokens]
        gate_up = xe @ w13[e].T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (round_x_16bit(act) if rounds else act) @ w2[e].T
        out.index_add_(0, tokens, y * weights[tokens, choice, None])
    return out


# (T, H, I, E, k, who gets tokens): decode, I and H off every panel and tile, experts with
# no token, top-1 / top-8, a few dozen tokens, one expert with every token.
_NATIVE_CASES = [
    (1, 64, 48, 8, 2, "all"),
    (1, 100, 70, 8, 1, "all"),
    (37, 96, 80, 8, 2, "some"),
    (24, 64, 40, 16, 8, "all"),
    (3, 72, 24, 64, 8, "some"),
    (45, 48, 33, 4, 1, "one"),
    (64, 300, 200, 8, 2, "all"),  # many rows an expert: several register blocks, K past one x block
]


def _case_inputs(gen: torch.Generator, t: int, h: int, i: int, e: int, k: int, who: str):  # type: ignore[no-untyped-def]
    w13, w2 = _experts(gen, e, h, i)
    x = torch.randn(t, h, generator=gen)
    used = {"all": None, "some": sorted(torch.randperm(e, generator=gen)[: max(k, e // 2)].tolist()),
            "one": [int(torch.randint(0, e, (), generator=gen))]}[who]
    weights, ids = _routing(gen, t, e, k, used)
    return x, w13, w2, weights, ids


@native
@pytest.mark.parametrize(("t", "h", "i", "e", "k", "who"), _NATIVE_CASES)
def test_native_float32_matches_the_reference(t: int, h: int, i: int, e: int, k: int, who: str) -> None:
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, weights, ids = _case_inputs(gen, t, h, i, e, k, who)
    experts = moe.ExpertWeights(w13, w2).pack("panel")
    assert experts.w13 is None and experts.packed is not None
    got = moe.fused_moe(x, experts, weights, ids)
    want = moe.fused_moe_reference(x, w13, w2, weights, ids)
    assert got.shape == (t, h) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=_TOL32[0], rtol=_TOL32[1], msg=lambda m: f"seed {seed}: {m}")
    # int64 ids and a strided x take the same path to the same values.
    wide = torch.randn(t, h + 5, generator=gen)
    wide[:, :h] = x
    again = moe.fused_moe(wide[:, :h], experts, weights, ids.long())
    assert torch.equal(again, got), f"seed {seed}: int64 ids / strided x differ"


@native
@pytest.mark.parametrize(("t", "h", "i", "e", "k", "who"), _NATIVE_CASES)
def test_native_int8_matches_the_reference_on_the_int8_weights(
    t: int, h: int, i: int, e: int, k: int, who: str
) -> None:
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, weights, ids = _case_inputs(gen, t, h, i, e, k, who)
    experts = moe.ExpertWeights(w13, w2).pack("panel_int8")
    assert experts.packed is not None and experts.packed.w13.dtype == torch.int8
    got = moe.fused_moe(x, experts, weights, ids)
    want = _int8_reference(x, experts, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-4 * max(h, i) ** 0.5, rtol=1e-4, msg=lambda m: f"seed {seed}: {m}")
    # Against the float32 original: the int8 weights' own error, which x's rounding hardly adds to.
    exact = moe.fused_moe_reference(x, w13, w2, weights, ids)
    dequantized = moe.fused_moe_reference(x, *experts.dense(), weights, ids)
    weight_err = float((dequantized - exact).abs().max())
    assert float((got - exact).abs().max()) <= 1.1 * weight_err + 1e-4, f"seed {seed}"
    assert float((got - dequantized).abs().max()) <= 0.05 * weight_err + 1e-4, f"seed {seed}"


@native
@pytest.mark.parametrize("layout", ["panel", "panel_int8"])
def test_native_result_does_not_depend_on_the_thread_count(layout: str) -> None:
    """Threads split (expert, tile) items; each output is computed alike whoever runs it,
    and the k choices are summed in order: 1 and 2 threads agree bit for bit."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, weights, ids = _case_inputs(gen, 29, 256, 320, 8, 2, "all")
    experts = moe.ExpertWeights(w13, w2).pack(layout)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = moe.fused_moe(x, experts, weights, ids)
        torch.set_num_threads(2)
        two = moe.fused_moe(x, experts, weights, ids)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two), f"seed {seed}"


@native
def test_packed_experts_unpack_to_their_weights() -> None:
    from kernels.panel_linear import quantize_int8

    gen = torch.Generator().manual_seed(_seed())
    w13, w2 = _experts(gen, 3, 40, 37)
    experts = moe.ExpertWeights(w13, w2).pack("panel", keep_dense=True)
    assert experts.w13 is w13
    assert experts.packed is not None
    d13, d2 = experts.packed.dense()
    assert torch.equal(d13, w13) and torch.equal(d2, w2)
    d13, d2 = moe.ExpertWeights(w13, w2).pack("panel_int8").dense()
    for e in range(3):  # per output channel, as the dense path quantizes
        for dense, w in ((d13[e], w13[e]), (d2[e], w2[e])):
            q, scale = quantize_int8(w)
            assert torch.equal(dense, q.float() * scale[:, None])


@native
def test_fused_moe_dispatch_and_edges() -> None:
    gen = torch.Generator().manual_seed(_seed())
    w13, w2 = _experts(gen, 4, 32, 24)
    x = torch.randn(5, 32, generator=gen)
    weights, ids = _routing(gen, 5, 4, 2)
    want = moe.fused_moe_reference(x, w13, w2, weights, ids)
    # Unpacked experts, or x not float32: the reference.
    assert torch.equal(moe.fused_moe(x, moe.ExpertWeights(w13, w2), weights, ids), want)
    assert moe.fused_moe(x.bfloat16(), moe.ExpertWeights(w13, w2), weights, ids).dtype == torch.bfloat16
    packed = moe.ExpertWeights(w13, w2).pack("panel")
    assert moe.fused_moe(x[:0], packed, weights[:0], ids[:0]).shape == (0, 32)
    bad = ids.clone()
    bad[2, 1] = 4
    with pytest.raises(RuntimeError, match="outside"):
        moe.fused_moe(x, packed, weights, bad)
    with pytest.raises(ValueError):
        moe.ExpertWeights(w13, w2).pack("fp8")
    with pytest.raises(ValueError):
        moe.ExpertWeights(w13, w2[:, :, :-1])
    assert moe.ExpertWeights(w13, w2).pack("torch").packed is None
    assert moe.ExpertWeights(w13, w2).pack("onednn").packed is not None  # float32 panels: no oneDNN grouped op
