"""The panel linear kernel (float32 and int8 weights) against F.linear, and int8
weight-only quantization in the engine: the quantized model computes what a float32
model holding the dequantized weights computes, close to the float32 original."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine_service.config import ConfigError, EngineConfig
from engine_service.core import EngineCore
from engine_service.models import decoder
from kernels.cpu_ops import native_available
from kernels.panel_linear import (
    GEMM_MIN_K,
    LANES,
    X_BLOCK,
    PanelArena,
    PanelWeight,
    gemm_min_rows,
    group_scale_shape,
    onto_huge_pages,
    pack_panels,
    pack_panels_grouped,
    panel_linear,
    panel_linear_argmax,
    panel_linear_reference,
    panels_shape,
    quantize_int8,
    round_x_16bit,
    unpack_panels,
)
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams
from tests.test_models import PagedBatchBuilder  # the paged-forward harness of the model tests

pytestmark = pytest.mark.skipif(not native_available(), reason="native CPU kernels need a C++ compiler")


def _random_case(gen: torch.Generator) -> tuple[int, int, int]:
    m = int(torch.randint(1, 40, (), generator=gen))
    n = int(torch.randint(1, 200, (), generator=gen))
    k = int(torch.randint(1, 300, (), generator=gen))
    return m, n, k


@pytest.mark.parametrize("quantize", [False, True])
def test_panel_linear_matches_f_linear_on_random_shapes(quantize: bool) -> None:
    """Shapes with every tail (rows not a multiple of the register block, columns not a
    multiple of 16 or 32, odd K), with and without bias, strided rows of x."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(25):
        m, n, k = _random_case(gen)
        w = torch.randn(n, k, generator=gen)
        x_full = torch.randn(m, k + 3, generator=gen)
        x = x_full[:, :k]  # row stride k + 3
        bias = torch.randn(n, generator=gen) if bool(torch.randint(0, 2, (), generator=gen)) else None
        packed = pack_panels(w, quantize)
        got = panel_linear(x, packed, bias)
        expected = panel_linear_reference(x, packed, bias)
        torch.testing.assert_close(got, expected, atol=1e-4 * k**0.5, rtol=1e-4, msg=f"m={m} n={n} k={k}")
        if not quantize:
            torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-4 * k**0.5, rtol=1e-4)
        else:  # the 16-bit rounding of x costs far less than the int8 weights themselves
            exact_x = F.linear(x, unpack_panels(packed), bias)
            weight_err = (F.linear(x, w, bias) - exact_x).abs().max()
            assert float((got - exact_x).abs().max()) <= 0.05 * float(weight_err) + 1e-5


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("k_base", [300, GEMM_MIN_K + 1])
def test_prefill_sized_products_match_f_linear(quantize: bool, k_base: int) -> None:
    """Hundreds of rows: through torch.mm on the unpacked (for int8: dequantized) weight
    where this build has a ``gemm_min_rows`` for K, else through the kernel in several row
    chunks (K = 300: ~216 rows a chunk); columns not a multiple of 16, bias, strided x."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    m, n, k = 512 + int(torch.randint(0, 40, (), generator=gen)), 75, k_base + int(torch.randint(0, 4, (), generator=gen))
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k + 5, generator=gen)[:, :k]
    bias = torch.randn(n, generator=gen)
    packed = pack_panels(w, quantize)
    got = panel_linear(x, packed, bias)
    assert got.shape == (m, n) and got.is_contiguous()
    if quantize:  # the dequantized weight, built without the panels
        q, scale = quantize_int8(w)
        w = q.float() * scale[:, None]
    torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-4 * k**0.5, rtol=1e-4)
    # Quarters of x (below any threshold: the kernel; int8 with few rows rounds x to 16 bits).
    parts = torch.cat([panel_linear(part, packed, bias) for part in x.chunk(4)])
    torch.testing.assert_close(parts, got, atol=(2e-3 if quantize else 1e-4) * k**0.5, rtol=1e-4)


@pytest.mark.parametrize("quantize", [False, True])
def test_panel_linear_argmax_is_the_first_column_of_the_products_max(quantize: bool) -> None:
    """The fused argmax equals argmax over ``panel_linear``'s own output (bitwise the same
    values), also where the maximum is tied between columns in different tiles and
    threads' shares: the smaller column wins, as torch.argmax does."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for m in (1, 3, 7, 16, 37):  # int8: the integer loop below 16 rows, dequantized tiles from 16
        n, k = 300 + int(torch.randint(0, 40, (), generator=gen)), 64 + int(torch.randint(0, 80, (), generator=gen))
        w = torch.randn(n, k, generator=gen)
        # Output columns c0 < c1 < c2 get one weight row: equal products wherever x is.
        c0, c1, c2 = sorted(torch.randperm(n, generator=gen)[:3].tolist())
        w[c1] = w[c0]
        w[c2] = w[c0]
        x = torch.randn(m, k, generator=gen)
        x[: m // 2 + 1] = w[c0] * 4  # these rows' maximum is the tied column triple
        bias = torch.randn(n, generator=gen) * 0.01 if quantize else None
        if bias is not None:
            bias[c1] = bias[c2] = bias[c0]
        packed = pack_panels(w, quantize)
        want = panel_linear(x, packed, bias).argmax(dim=-1)
        got = panel_linear_argmax(x, packed, bias)
        assert got.dtype == torch.int64 and torch.equal(got, want), (m, n, k)
        assert (got[: m // 2 + 1] == c0).all()


@pytest.mark.parametrize("quantize", [False, True])
def test_every_tile_is_written_when_threads_steal_each_others_tiles(quantize: bool) -> None:
    """More threads than cores: threads lose their core mid-call and the others take the
    back halves of their shares. Every output column must still be written (the output
    starts as NaN) with the reference's values, and the fused argmax keep the smaller of
    tied columns whichever thread computed them, in whatever order."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(6, 3 * threads))
    try:
        for m in (1, 2, 7, 20):
            n, k = 4000 + int(torch.randint(0, 100, (), generator=gen)), 96
            w = torch.randn(n, k, generator=gen)
            c0, c1 = sorted(torch.randperm(n, generator=gen)[:2].tolist())
            w[c1] = w[c0]
            x = torch.randn(m, k, generator=gen)
            x[0] = w[c0] * 4  # row 0's maximum: the tie between c0 and c1
            packed = pack_panels(w, quantize)
            want = panel_linear_reference(x, packed, None)
            for _ in range(20):
                out = torch.full((m, n), float("nan"))
                torch.ops.tandem_cpu.panel_linear(out, x, packed.panels, packed.scale, torch.empty(0))
                torch.testing.assert_close(out, want, atol=1e-4 * k**0.5, rtol=1e-4)
                tokens = panel_linear_argmax(x, packed, None)
                assert int(tokens[0]) == c0 and torch.equal(tokens, out.argmax(dim=-1)), (m, n)
    finally:
        torch.set_num_threads(threads)


def test_panels_hold_the_weight_and_zero_padding() -> None:
    w = torch.randn(37, 70)
    packed = pack_panels(w, quantize=False)
    assert packed.panels.shape == (3, 70, LANES) and packed.scale.numel() == 0
    torch.testing.assert_close(unpack_panels(packed), w, atol=0, rtol=0)
    assert packed.panels[2, :, 37 - 32 :].abs().sum() == 0  # columns 37..47 are padding


def test_int8_quantization_error_is_within_half_a_step_per_channel() -> None:
    w = torch.randn(64, 96) * torch.rand(64, 1) * 4  # rows of very different ranges
    w[5] = 0.0  # an all-zero row gets scale 1, values 0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    assert float(scale[5]) == 1.0 and int(q[5].abs().sum()) == 0
    packed = pack_panels(w, quantize=True)
    assert packed.panels.dtype == torch.int8
    torch.testing.assert_close(unpack_panels(packed), q.float() * scale[:, None], atol=0, rtol=0)


def test_bad_inputs_raise() -> None:
    packed = pack_panels(torch.randn(16, 8), quantize=True)
    with pytest.raises(RuntimeError, match="columns"):
        panel_linear(torch.randn(2, 9), packed, None)
    with pytest.raises(ValueError, match="2-D"):
        pack_panels(torch.randn(2, 3, 4), quantize=False)


def _greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), prompt, params))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step().all_outputs():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def _logits(core: EngineCore, prompt: list[int]) -> torch.Tensor:  # [len, vocab]
    builder = PagedBatchBuilder(core.model_config, torch.Generator().manual_seed(0))
    ids, positions, meta = builder.step([(0, 0, prompt)])
    with torch.inference_mode():
        return core.model.compute_logits(core.model(ids, positions, builder.kv_caches, meta))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_int8_engine_equals_float32_on_the_dequantized_weights(fixture: str, request: pytest.FixtureRequest) -> None:
    """The int8 engine's greedy tokens equal those of a float32 engine whose weights are
    the dequantized int8 weights (same kernel family, so any packing, scale or tail bug
    shows as a different token), and every projection reads a quarter of the bytes."""
    model_dir: str = request.getfixturevalue(fixture)
    common = dict(model=model_dir, device="cpu", max_model_len=128, num_gpu_blocks_override=64)
    int8 = EngineCore(EngineConfig(quantization="int8", **common))
    linears = [m for m in int8.model.modules() if isinstance(m, decoder.FusedLinear)]
    assert linears and all(m.packed_weight.panels.dtype == torch.int8 for m in linears)
    assert int8.model.lm_head_packed.panels.dtype == torch.int8

    ref = EngineCore(EngineConfig(linear_backend="panel", **common))
    ref_linears = [m for m in ref.model.modules() if isinstance(m, decoder.FusedLinear)]
    for q, f in zip(linears, ref_linears, strict=True):
        f.packed_weight = pack_panels(unpack_panels(q.packed_weight), quantize=False)
    ref.model.lm_head_packed = pack_panels(unpack_panels(int8.model.lm_head_packed), quantize=False)

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    vocab = int8.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in (1, 7, 19, 33)]
    assert _greedy(int8, prompts, 12) == _greedy(ref, prompts, 12)


def test_int8_logits_stay_close_to_float32(tiny_llama_dir: str) -> None:
    """Quantization error, end to end: int8 logits within a few percent of the float32
    logits' spread on a random model (whose logits are all alike, the hard case)."""
    common = dict(model=tiny_llama_dir, device="cpu", max_model_len=128, num_gpu_blocks_override=64)
    int8 = EngineCore(EngineConfig(quantization="int8", **common))
    fp32 = EngineCore(EngineConfig(**common))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    prompt = torch.randint(3, fp32.model_config.vocab_size, (24,), generator=gen).tolist()
    a, b = _logits(int8, prompt), _logits(fp32, prompt)
    spread = float(b.std())
    assert spread > 0
    print(f"int8 logit error: max {float((a - b).abs().max()) / spread:.4f}, "
          f"mean {float((a - b).abs().mean()) / spread:.4f} of the logits' std")
    assert float((a - b).abs().max()) < 0.25 * spread
    assert float((a - b).abs().mean()) < 0.05 * spread


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(dtype="bfloat16"), "float32"),
        (dict(linear_backend="onednn"), "panel linear backend"),
        (dict(linear_backend="torch"), "panel linear backend"),
    ],
)
def test_int8_refuses_what_it_cannot_run(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _ = EngineConfig(device="cpu", quantization="int8", **overrides).linear_layout


def test_quantization_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    monkeypatch.setenv("TANDEM_QUANTIZATION", "int8")
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert parser.parse_args([]).quantization == "int8"
    assert parser.parse_args(["--quantization", "none"]).quantization == "none"
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(quantization="int4")


def assert_same_greedy_runs(cores: list[EngineCore], prompts: list[list[int]], params: SamplingParams) -> None:
    """Both engines give every prompt the same tokens, and logprobs within 1e-4."""
    results = []
    for core in cores:
        for i, prompt in enumerate(prompts):
            core.add_request(EngineCoreRequest(str(i), prompt, params))
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}
        while core.has_unfinished_requests():
            for out in core.step().all_outputs():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.new_logprobs is not None:
                    for row in out.new_logprobs.logprobs:
                        logprobs.setdefault(out.request_id, []).extend(row)
        results.append((tokens, logprobs))
    assert results[0][0] == results[1][0]
    for rid in results[0][1]:
        torch.testing.assert_close(torch.tensor(results[0][1][rid]), torch.tensor(results[1][1][rid]),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_native_decode_step_equals_the_layer_by_layer_forward(
    fixture: str, quantization: str, request: pytest.FixtureRequest
) -> None:
    """Decode-only steps through ``tandem_cpu::decode_layers`` give the tokens and
    logprobs of the Python layer loop (same kernels in the same order); prefill and
    mixed steps still take the Python loop."""
    model_dir: str = request.getfixturevalue(fixture)
    common = dict(model=model_dir, device="cpu", max_model_len=128, num_gpu_blocks_override=64,
                  quantization=quantization, max_num_batched_tokens=64)
    native = EngineCore(EngineConfig(native_decode=True, **common))
    python = EngineCore(EngineConfig(native_decode=False, **common))
    calls = {"native": 0}
    real = native.model._decode_natively

    def counted(*args: object) -> torch.Tensor:
        calls["native"] += 1
        return real(*args)

    native.model._decode_natively = counted  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    vocab = native.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in (1, 5, 17, 40)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0, logprobs=3)
    assert_same_greedy_runs([native, python], prompts, params)
    assert calls["native"] > 0


@pytest.mark.parametrize("quantize", [False, True])
def test_onto_huge_pages_keeps_every_weight_in_one_aligned_buffer(quantize: bool) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    shapes = [(37, 19), (16, 64), (200, 33)]
    weights = [pack_panels(torch.randn(n, k, generator=gen), quantize) for n, k in shapes]
    placed = onto_huge_pages(weights)
    storage = placed[0].panels.untyped_storage().data_ptr()
    for before, after, (_, k) in zip(weights, placed, shapes):
        assert torch.equal(before.panels, after.panels) and after.panels.is_contiguous()
        assert after.panels.untyped_storage().data_ptr() == storage  # one buffer
        assert after.panels.data_ptr() % 64 == 0
        x = torch.randn(5, k, generator=gen)
        torch.testing.assert_close(panel_linear(x, after, None), panel_linear(x, before, None), atol=0, rtol=0)


@pytest.mark.parametrize("quantize", [False, True])
def test_panel_arena_slots_follow_panels_shape_and_refuse_a_misfit(quantize: bool) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    shapes = [tuple(int(torch.randint(1, 90, (), generator=gen)) for _ in range(2)) for _ in range(4)]
    dtype = torch.int8 if quantize else torch.float32
    arena = PanelArena([panels_shape(n, k, quantize) for n, k in shapes], dtype)
    for n, k in shapes:
        weight = pack_panels(torch.randn(n, k, generator=gen), quantize)
        assert tuple(weight.panels.shape) == panels_shape(n, k, quantize)
        assert torch.equal(arena.place(weight).panels, weight.panels)
    with pytest.raises(ValueError, match="all 4 slots"):
        arena.place(weight)
    arena = PanelArena([panels_shape(40, 8, quantize)], dtype)
    with pytest.raises(ValueError, match="slot 0 holds"):
        arena.place(pack_panels(torch.randn(40, 10, generator=gen), quantize))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_untied_dir"])
@pytest.mark.parametrize("layout", ["panel", "panel_int8"])
def test_panel_packing_places_the_whole_model_in_one_buffer(
    fixture: str, layout: str, request: pytest.FixtureRequest
) -> None:
    """``pack_linears``: every linear weight and the LM head in one arena, equal to
    packing each dense weight on its own."""
    from engine_service.models.loader import load_model

    model, _ = load_model(request.getfixturevalue(fixture))
    linears = [m for m in model.modules() if isinstance(m, decoder.FusedLinear)]
    expected = [pack_panels(m.weight, layout == "panel_int8") for m in linears]
    expected.append(pack_panels(model.lm_head_weight, layout == "panel_int8"))
    model.pack_linears(layout)
    placed = [m.packed_weight for m in linears] + [model.lm_head_packed]
    assert all(m.weight is None for m in linears)
    assert len({w.panels.untyped_storage().data_ptr() for w in placed}) == 1
    for got, want in zip(placed, expected, strict=True):
        assert torch.equal(got.panels, want.panels) and torch.equal(got.scale, want.scale)


# ---- grouped int8 (GGUF Q8_0: one scale per 32 k of each output row) --------------------


def _grouped_case(gen: torch.Generator, n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 values [n, k] in [-127, 127] and float32 group scales [n, k // group]
    spread over three orders of magnitude (a wrong group's scale shows at once), each a
    float16 value (as Q8_0's are: the packed weight holds them exactly)."""
    q = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
    d = (torch.exp(torch.randn(n, k // group, generator=gen) * 2.0) * 1e-2).half().float()
    return q, d


def _dense(q: torch.Tensor, d: torch.Tensor, group: int) -> torch.Tensor:  # W[n, k] = d[n, k // group] q[n, k]
    return q.float() * d.repeat_interleave(group, dim=1)


def _float_tolerance(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[M, N]: float32 rounding room for two orders of summing x @ w.T + bias: ~30 ulp
    times sqrt(K) of the sum of the terms' magnitudes (which cancellation does not shrink)."""
    magnitude = F.linear(x.abs(), w.abs(), None if bias is None else bias.abs())
    return 2e-6 * x.shape[1] ** 0.5 * magnitude + 1e-6


def _tie_slack(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N]: one step of x's 16-bit rounding times |w| for each element of x within
    float32 error of a rounding tie (x / step about 32767 at most: an ulp of up to 2^-9),
    which the kernel (x times 1 / step, -ffast-math) may round the other way than
    ``round_x_16bit``."""
    m, k = x.shape
    blocks = -(-k // X_BLOCK)
    padded = F.pad(x.float(), (0, blocks * X_BLOCK - k)).view(m, blocks, X_BLOCK)
    step = padded.abs().amax(dim=2, keepdim=True) / 32767.0
    scaled = padded / torch.where(step > 0, step, torch.ones_like(step))
    near_tie = ((scaled - scaled.floor() - 0.5).abs() < 1e-2).float()
    return F.linear((near_tie * step).view(m, -1)[:, :k], w.abs())


@pytest.mark.parametrize("group", [32, 2, 64, 256])
def test_grouped_int8_matches_the_reference(group: int) -> None:
    """Row counts hitting every register-block tail and (AVX2) the dequantized-tile loop
    from 16 rows, K a multiple of the group but not of 256, N not a multiple of 16 or 32,
    with and without bias, strided x."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for m in (1, 3, 8, 17, 64):
        n = 1 + int(torch.randint(0, 90, (), generator=gen))
        k = group * int(torch.randint(1, 800 // group + 2, (), generator=gen))
        q, d = _grouped_case(gen, n, k, group)
        packed = pack_panels_grouped(q, d, group)
        torch.testing.assert_close(unpack_panels(packed), _dense(q, d, group), atol=0, rtol=0)
        x = torch.randn(m, k + 3, generator=gen)[:, :k]
        bias = torch.randn(n, generator=gen) if m % 2 else None
        got = panel_linear(x, packed, bias)
        want = panel_linear_reference(x, packed, bias)
        tolerance = _float_tolerance(x, _dense(q, d, group), bias) + _tie_slack(x, _dense(q, d, group))
        assert bool(((got - want).abs() <= tolerance).all()), (m, n, k)


@pytest.mark.parametrize("k", [352, GEMM_MIN_K + 32])
def test_grouped_int8_prefill_sized_products(k: int) -> None:
    """600 rows: ``panel_linear`` (torch.mm on the dequantized weight where this build has
    a ``gemm_min_rows`` for K, else the kernel) and the kernel itself at 600 rows (many
    register blocks, and for the large K several row chunks), against F.linear."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    m, n, group = 600, 75, 32
    q, d = _grouped_case(gen, n, k, group)
    packed = pack_panels_grouped(q, d, group)
    x = torch.randn(m, k + 5, generator=gen)[:, :k]
    bias = torch.randn(n, generator=gen)
    tolerance = _float_tolerance(x, _dense(q, d, group), bias)
    threshold = gemm_min_rows(k)
    got = panel_linear(x, packed, bias)
    if threshold is not None and m >= threshold:  # unrounded x through torch.mm
        assert bool(((got - F.linear(x, _dense(q, d, group), bias)).abs() <= tolerance).all())
    out = torch.full((m, n), float("nan"))
    torch.ops.tandem_cpu.panel_linear(out, x.contiguous(), packed.panels, packed.scale, bias)
    assert bool(((out - panel_linear_reference(x, packed, bias)).abs() <= tolerance).all())


def test_grouped_int8_argmax_is_the_first_column_of_the_products_max() -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for m in (1, 3, 7, 16, 37):
        n, k = 300 + int(torch.randint(0, 40, (), generator=gen)), 32 * int(torch.randint(2, 12, (), generator=gen))
        q, d = _grouped_case(gen, n, k, 32)
        c0, c1, c2 = sorted(torch.randperm(n, generator=gen)[:3].tolist())
        d[c0] = d.max(dim=0).values * 2  # row c0 the longest: x = 4 W[c0] scores highest there
        q[c1] = q[c2] = q[c0]  # one weight row in three columns: equal products
        d[c1] = d[c2] = d[c0]
        x = torch.randn(m, k, generator=gen)
        x[: m // 2 + 1] = _dense(q, d, 32)[c0] * 4  # these rows' maximum is the tied triple
        bias = torch.randn(n, generator=gen) * 0.01
        bias[c1] = bias[c2] = bias[c0]
        packed = pack_panels_grouped(q, d, 32)
        want = panel_linear(x, packed, bias).argmax(dim=-1)
        got = panel_linear_argmax(x, packed, bias)
        assert got.dtype == torch.int64 and torch.equal(got, want), (m, n, k)
        assert (got[: m // 2 + 1] == c0).all()


def _q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q8_0 tensor made by gguf's quantizer from ``w`` [N, K] -> (int8 q [N, K],
    float32 d [N, K // 32], gguf's own dequantization [N, K])."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    raw = quantize(w.numpy(), GGMLQuantizationType.Q8_0)  # [N, K / 32 * 34] uint8
    n, k = w.shape
    blocks = raw.reshape(n, k // 32, 34)  # a block: float16 d, then 32 int8
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8)
    dense = dequantize(raw, GGMLQuantizationType.Q8_0)
    return torch.from_numpy(q.reshape(n, k).copy()), torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(dense))


def test_a_gguf_q8_0_tensor_gives_f_linear_on_its_dequantized_weight() -> None:
    """The Q8_0 values and block scales as they are: the panels stand for exactly gguf's
    dequantized weight, and the kernel's product is F.linear with it, up to the 16-bit
    rounding of x (half a step per element: bounded by sum |W| * step / 2 per block)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n, k = 83, 32 * 13
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    q, d, dense = _q8_0(w)
    packed = pack_panels_grouped(q, d, 32)
    torch.testing.assert_close(unpack_panels(packed), dense, atol=0, rtol=0)
    bias = torch.randn(n, generator=gen)
    for m in (1, 5, 24):
        x = torch.randn(m, k, generator=gen)
        got = panel_linear(x, packed, bias)
        want = F.linear(x, dense, bias)
        # |x - round(x)| <= step / 2 per element, step = the block's max |x| / 32767.
        half_step = (x - round_x_16bit(x)).abs().amax(dim=1, keepdim=True)
        bound = half_step * dense.abs().sum(dim=1)[None, :] + 1e-5 * (want.abs() + 1.0)
        assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() - bound).max())


def test_pack_panels_grouped_refuses_what_the_kernel_cannot_run() -> None:
    q = torch.randint(-127, 128, (20, 96)).to(torch.int8)
    with pytest.raises(ValueError, match="multiple of the group"):
        pack_panels_grouped(q[:, :80], torch.ones(20, 2), 32)
    with pytest.raises(ValueError, match="even divisor of 256"):
        pack_panels_grouped(q, torch.ones(20, 2), 48)
    with pytest.raises(ValueError, match="even divisor of 256"):
        pack_panels_grouped(q[:, :93], torch.ones(20, 31), 3)
    with pytest.raises(ValueError, match=r"scales must be \[20, 3\]"):
        pack_panels_grouped(q, torch.ones(20, 4), 32)
    with pytest.raises(ValueError, match="int8"):
        pack_panels_grouped(q.float(), torch.ones(20, 3), 32)
    packed = pack_panels_grouped(q, torch.ones(20, 3), 32)
    assert packed.group == 32 and packed.scale.shape == group_scale_shape(20, 96, 32) == (2, 3, LANES)
    assert tuple(packed.panels.shape) == panels_shape(20, 96, quantize=True)
    assert bool((packed.scale[1, :, 20 - 16 :] == 1.0).all())  # padded columns
    with pytest.raises(RuntimeError, match="group scales"):  # the kernel checks K against G
        torch.ops.tandem_cpu.panel_linear(
            torch.empty(1, 20), torch.randn(1, 96), packed.panels, packed.scale[:, :2].contiguous(), torch.empty(0)
        )
    with pytest.raises(RuntimeError, match="int8"):  # group scales on float32 panels
        floats = pack_panels(torch.randn(20, 96), quantize=False)
        torch.ops.tandem_cpu.panel_linear(torch.empty(1, 20), torch.randn(1, 96), floats.panels, packed.scale,
                                          torch.empty(0))


def test_group_scales_are_stored_as_float16_rounded_to_nearest() -> None:
    """The packed scale is float16: a float16 value kept exactly (subnormals too), others
    rounded to nearest (ties to even), and the kernel and the reference both use the
    rounded scale; beyond float16's range the packing refuses."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n, k = 21, 96
    q = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
    d = torch.exp(torch.randn(n, k // 32, generator=gen))
    d[0] = torch.tensor([1.0 + 2.0**-12, 1.0 + 3 * 2.0**-11, 0.1])  # not float16 values
    d[1] = torch.tensor([2.0**-20, 2.0**-25, 65504.0])  # a float16 subnormal, one that rounds to 0, the largest
    packed = pack_panels_grouped(q, d, 32)
    assert packed.scale.dtype == torch.float16 and packed.scale.is_contiguous()
    rounded = d.half().float()
    assert rounded[0].tolist() == [1.0, 1.0 + 2.0**-9, 0.0999755859375]  # nearest, ties to even
    assert rounded[1].tolist() == [2.0**-20, 0.0, 65504.0]
    torch.testing.assert_close(unpack_panels(packed), _dense(q, rounded, 32), atol=0, rtol=0)
    for m in (1, 3, 20):
        x = torch.randn(m, k, generator=gen)
        got = panel_linear(x, packed, None)
        want = panel_linear_reference(x, packed, None)
        assert bool(((got - want).abs() <= _float_tolerance(x, _dense(q, rounded, 32), None)).all()), m
    assert torch.equal(pack_panels_grouped(q, d.double(), 32).scale, packed.scale)  # any float dtype
    assert torch.equal(pack_panels_grouped(q, d.half(), 32).scale, packed.scale)
    d[2, 1] = 65520.0  # rounds to inf in float16
    with pytest.raises(ValueError, match="float16's range"):
        pack_panels_grouped(q, d, 32)
    with pytest.raises(RuntimeError, match="float16"):  # the kernel takes float16 group scales only
        torch.ops.tandem_cpu.panel_linear(torch.empty(1, n), torch.randn(1, k), packed.panels, packed.scale.float(),
                                          torch.empty(0))


def test_grouped_weights_onto_huge_pages_and_into_an_arena() -> None:
    """Grouped weights among per-channel ones: panels in one buffer, the group scales in a
    second one, both aligned; the products unchanged bit for bit."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    shapes = [(37, 64), (16, 96), (200, 32)]
    weights: list[PanelWeight] = [pack_panels_grouped(*_grouped_case(gen, n, k, 32), 32) for n, k in shapes]
    weights.insert(1, pack_panels(torch.randn(20, 50, generator=gen), quantize=True))
    placed = onto_huge_pages(weights)
    assert len({w.panels.untyped_storage().data_ptr() for w in placed}) == 1
    grouped = [w for w in placed if w.group > 0]
    assert len({w.scale.untyped_storage().data_ptr() for w in grouped}) == 1
    for before, after in zip(weights, placed, strict=True):
        assert after.group == before.group and torch.equal(before.scale, after.scale)
        assert after.panels.data_ptr() % 64 == 0 and after.scale.data_ptr() % 64 == 0 and after.scale.is_contiguous()
        assert after.scale.dtype == before.scale.dtype
        x = torch.randn(5, before.in_k, generator=gen)
        torch.testing.assert_close(panel_linear(x, after, None), panel_linear(x, before, None), atol=0, rtol=0)

    arena = PanelArena([panels_shape(n, k, True) for n, k in shapes], torch.int8,
                       [group_scale_shape(n, k, 32) for n, k in shapes])
    for weight in [w for w in weights if w.group > 0]:
        got = arena.place(weight)
        assert torch.equal(got.panels, weight.panels) and torch.equal(got.scale, weight.scale)
    with pytest.raises(ValueError, match="scale slot 0 holds"):
        PanelArena([panels_shape(37, 64, True)], torch.int8, [group_scale_shape(37, 32, 32)]).place(weights[0])
    with pytest.raises(ValueError, match="scale slot 0 holds"):  # float16 slots: a float32 scale does not fit
        PanelArena([panels_shape(37, 64, True)], torch.int8, [group_scale_shape(37, 64, 32)]).place(
            replace(weights[0], scale=weights[0].scale.float()))


def _as_q8_0(weight: PanelWeight) -> PanelWeight:
    """A per-channel int8 weight re-made as GGUF Q8_0 would store its dequantized values."""
    q, d, _ = _q8_0(unpack_panels(weight))
    return pack_panels_grouped(q, d, 32)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_native_decode_takes_grouped_int8_weights(fixture: str, request: pytest.FixtureRequest) -> None:
    """Every projection and the LM head as Q8_0: the native decode loop (which passes the
    group scales to the kernel) gives the Python layer loop's tokens and logprobs."""
    model_dir: str = request.getfixturevalue(fixture)
    common = dict(model=model_dir, device="cpu", max_model_len=128, num_gpu_blocks_override=64,
                  quantization="int8", max_num_batched_tokens=64)
    cores = [EngineCore(EngineConfig(native_decode=native, **common)) for native in (True, False)]
    for core in cores:
        for module in core.model.modules():
            if isinstance(module, decoder.FusedLinear):
                module.packed_weight = _as_q8_0(module.packed_weight)
        core.model.lm_head_packed = _as_q8_0(core.model.lm_head_packed)
    assert cores[0].model.native_decode_weights() is not None
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    vocab = cores[0].model_config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in (1, 5, 17)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=3)
    assert_same_greedy_runs(cores, prompts, params)
