"""GPTQ, AWQ and compressed-tensors FP8 checkpoints (issue 45): ``quantization_config``
parsing, each format's unpacking against an independent writer's dequantization
(tests/quant_checkpoints.py), and the engine on a quantized checkpoint giving the same
greedy tokens as on the float checkpoint of its dequantized weights."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.models.loader import load_model
from engine_service.models.quant_formats import (
    awq_weight,
    fp8_weight,
    gptq_weight,
    quantized_entries,
    take_slice,
)
from engine_service.models.quantized import Int4Rows
from tandem.protocol.model_config import ModelConfig, ModelLoadError
from tandem.protocol.quantization import (
    SUPPORTED_METHODS,
    QuantizationConfig,
    parse_quantization_config,
)
from tandem.protocol.sampling_params import SamplingParams
from tests import quant_checkpoints as qc
from tests.quant_checkpoints import Spec
from tests.test_engine_parity import run_engine

DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"

# ---- quantization_config ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (Spec("gptq", 128), QuantizationConfig("gptq", 4, 128, checkpoint_format="gptq")),
        (
            Spec("gptq", 32, sym=False, act_order=True, v2=True),
            QuantizationConfig(
                "gptq", 4, 32, desc_act=True, sym=False, checkpoint_format="gptq_v2"
            ),
        ),
        (Spec("gptq", -1), QuantizationConfig("gptq", 4, -1, checkpoint_format="gptq")),
        (
            Spec("awq", 128, not_converted=("model.layers.0.mlp.down_proj",)),
            QuantizationConfig(
                "awq",
                4,
                128,
                sym=False,
                checkpoint_format="gemm",
                not_converted=("model.layers.0.mlp.down_proj",),
            ),
        ),
        (
            Spec("fp8", strategy="tensor"),
            QuantizationConfig(
                "compressed-tensors",
                8,
                checkpoint_format="float-quantized",
                strategy="tensor",
                input_activations="dynamic",
                not_converted=("lm_head",),
            ),
        ),
        (
            Spec("fp8", strategy="channel", static_input=True),
            QuantizationConfig(
                "compressed-tensors",
                8,
                checkpoint_format="float-quantized",
                strategy="channel",
                input_activations="static",
                not_converted=("lm_head",),
            ),
        ),
    ],
)
def test_quantization_configs_parse(spec: Spec, expected: QuantizationConfig) -> None:
    assert parse_quantization_config(qc.quantization_config(spec)) == expected
    assert parse_quantization_config(None) is None
    assert expected.zero_offset == (1 if expected.checkpoint_format == "gptq" else 0)


def _ct_group(**weights: Any) -> dict[str, Any]:
    config = qc.quantization_config(Spec("fp8"))
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


REFUSED: list[tuple[dict[str, Any], str]] = [
    (
        {**qc.quantization_config(Spec("gptq")), "bits": 8},
        "quantization_config.bits 8 is not supported for gptq",
    ),
    ({**qc.quantization_config(Spec("gptq")), "bits": 3}, "quantization_config.bits 3"),
    (
        {**qc.quantization_config(Spec("awq")), "bits": 8},
        "quantization_config.bits 8 is not supported for awq",
    ),
    (
        {"quant_method": "bitsandbytes", "load_in_4bit": True},
        "quantization_config.quant_method 'bitsandbytes' is not supported",
    ),
    (
        {"quant_method": "fp8", "weight_block_size": [128, 128]},
        "quantization_config.quant_method 'fp8'",
    ),
    ({"bits": 4}, "quantization_config.quant_method is missing"),
    (
        {**qc.quantization_config(Spec("gptq")), "checkpoint_format": "marlin"},
        "quantization_config.checkpoint_format 'marlin'",
    ),
    ({**qc.quantization_config(Spec("gptq")), "group_size": 0}, "quantization_config.group_size"),
    (
        {**qc.quantization_config(Spec("gptq")), "dynamic": {"-:.*down": {}}},
        "quantization_config.dynamic",
    ),
    (
        {**qc.quantization_config(Spec("awq")), "version": "gemv"},
        "quantization_config.version 'gemv'",
    ),
    (
        {**qc.quantization_config(Spec("awq")), "zero_point": False},
        "quantization_config.zero_point",
    ),
    (
        {**qc.quantization_config(Spec("fp8")), "format": "pack-quantized"},
        "quantization_config.format 'pack-quantized'",
    ),
    (
        _ct_group(type="int", num_bits=4),
        "quantization_config.config_groups.group_0.weights 4-bit 'int'",
    ),
    (
        _ct_group(strategy="block"),
        "quantization_config.config_groups.group_0.weights.strategy 'block'",
    ),
    (_ct_group(symmetric=False), "quantization_config.config_groups.group_0.weights.symmetric"),
    (
        {**qc.quantization_config(Spec("fp8")), "kv_cache_scheme": {"num_bits": 8}},
        "quantization_config.kv_cache_scheme",
    ),
    ("gptq", "quantization_config must be an object"),
]


@pytest.mark.parametrize(("raw", "message"), REFUSED)
def test_unsupported_quantization_configs_are_one_line_errors(raw: Any, message: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_quantization_config(raw, "m/config.json")
    text = str(info.value)
    assert text.startswith(f"m/config.json: {message}"), text
    assert "\n" not in text


def test_model_config_reads_quantization_config(tiny_llama_dir: str) -> None:
    with open(os.path.join(tiny_llama_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    assert ModelConfig.from_dict(raw).quantization is None
    quantized = {**raw, "quantization_config": qc.quantization_config(Spec("awq", 32))}
    assert ModelConfig.from_dict(quantized).quantization == QuantizationConfig(
        "awq", 4, 32, sym=False, checkpoint_format="gemm"
    )
    refused = {**raw, "quantization_config": {**qc.quantization_config(Spec("gptq")), "bits": 8}}
    with pytest.raises(
        ModelLoadError, match=r"^config.json: quantization_config.bits 8 is not supported"
    ):
        ModelConfig.from_dict(refused)


# ---- unpacking: each format's tensors against the writer's dequantization --------------------

UNPACK_CASES = {
    "gptq-g32-sym": Spec("gptq", 32),
    "gptq-g32-asym": Spec("gptq", 32, sym=False),
    "gptq-g64-act-order": Spec("gptq", 64, act_order=True, sym=False),
    "gptq-g32-act-order-v2": Spec("gptq", 32, act_order=True, v2=True),
    "gptq-per-row": Spec("gptq", -1),
    "gptq-g48-partial-group": Spec("gptq", 48, sym=False),  # 128 inputs: a last group of 32
    "awq-g32": Spec("awq", 32),
    "awq-g128": Spec("awq", 128),
    "fp8-tensor": Spec("fp8", strategy="tensor"),
    "fp8-channel": Spec("fp8", strategy="channel"),
}


def _convert(
    spec: Spec, parts: dict[str, np.ndarray | torch.Tensor], k: int
) -> Int4Rows | torch.Tensor:
    t = {name: torch.as_tensor(value) for name, value in parts.items()}
    group = k if spec.group == -1 else spec.group
    if spec.method == "gptq":
        g_idx = t["g_idx"] if spec.act_order else None
        return gptq_weight(
            t["qweight"], t["qzeros"], t["scales"], group, g_idx, 0 if spec.v2 else 1
        )
    if spec.method == "awq":
        return awq_weight(t["qweight"], t["qzeros"], t["scales"], group)
    return fp8_weight(t["weight"], t["weight_scale"])


@pytest.mark.parametrize("case", list(UNPACK_CASES))
def test_unpacking_equals_the_writers_dequantization(case: str, rng: random.Random) -> None:
    spec = dataclasses.replace(UNPACK_CASES[case], seed=rng.randrange(2**32))
    gen = torch.Generator().manual_seed(spec.seed)
    n, k = 96, 128
    w = (torch.randn(n, k, generator=gen) * 0.1).numpy()
    writer = np.random.default_rng(spec.seed)
    if spec.method == "fp8":
        parts, reference = qc.fp8_layer(w, spec)
    else:
        parts, reference = qc.int4_layer(w, spec, writer)
    got = _convert(spec, parts, k)
    want = torch.from_numpy(reference)
    if spec.method == "fp8" or case.endswith("partial-group"):
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        assert torch.equal(got, want)
        return
    assert isinstance(got, Int4Rows)
    assert got.shape == (n, k) and got.codes.dtype == torch.uint8
    assert got.group == (k if spec.group == -1 else spec.group)
    assert torch.equal(got.dequantize(), want)
    assert (got.perm is not None) == spec.act_order
    # the codes themselves: the writer's integers, in perm's order
    g_idx = (
        torch.from_numpy(parts["g_idx"]).long()
        if spec.method == "gptq"
        else torch.arange(k) // got.group
    )
    perm = got.perm if got.perm is not None else torch.arange(k)
    assert torch.equal(g_idx[perm], torch.arange(k) // got.group)
    for i in (0, n // 2, n - 1):
        row = got.unpacked()[i].long()
        assert torch.equal(
            row * got.scales[i].repeat_interleave(got.group)
            + got.mins[i].repeat_interleave(got.group),
            want[i, perm],
        )


def test_slices_of_int4_rows(rng: random.Random) -> None:
    """Row slices stay Int4Rows; column slices on group boundaries too, others (or any with
    act-order) become float columns; each equals the same slice of the whole weight."""
    w = (
        torch.randn(64, 128, generator=torch.Generator().manual_seed(rng.randrange(2**32))) * 0.1
    ).numpy()
    for spec in (Spec("gptq", 32), Spec("gptq", 32, act_order=True), Spec("awq", 32)):
        parts, reference = qc.int4_layer(w, spec, np.random.default_rng(1))
        whole = _convert(spec, parts, 128)
        want = torch.from_numpy(reference)
        rows = take_slice(whole, (0, 16, 48))
        assert isinstance(rows, Int4Rows) and torch.equal(rows.dequantize(), want[16:48])
        for start, stop in ((0, 64), (64, 128), (32, 96), (16, 80)):
            cols = take_slice(whole, (1, start, stop))
            aligned = start % 32 == 0 and stop % 32 == 0 and not spec.act_order
            assert isinstance(cols, Int4Rows) == aligned
            dense = cols.dequantize() if isinstance(cols, Int4Rows) else cols
            assert torch.equal(dense, want[:, start:stop])


def test_fp8_decoding_agrees_with_torch() -> None:
    """The writer's own e4m3 decoder (the reference's) and torch's float8_e4m3fn agree on all 256 codes."""
    codes = torch.arange(256, dtype=torch.uint8)
    ours = torch.from_numpy(qc.fp8_e4m3_to_float(codes.numpy()))
    theirs = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])


# ---- checkpoints: loading and greedy parity --------------------------------------------------


@pytest.fixture(scope="module")
def wide_qwen2_dir(tiny_qwen2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen2 (q/k/v biases) with hidden 128 and intermediate 256, so group 128 fits every layer."""
    return qc.widen_checkpoint(tiny_qwen2_dir, str(tmp_path_factory.mktemp("wide_qwen2")), 128, 256)


# case -> (base checkpoint fixture, spec)
CHECKPOINTS: dict[str, tuple[str, Spec]] = {
    "gptq-g128": ("wide_qwen2_dir", Spec("gptq", 128)),
    "gptq-g128-act-order-asym-sharded": (
        "wide_qwen2_dir",
        Spec("gptq", 128, sym=False, act_order=True, split=True),
    ),
    "gptq-g32-zero-biases": ("tiny_llama_dir", Spec("gptq", 32, zero_bias=True)),
    "gptq-g32-act-order-v2": (
        "tiny_qwen3_dir",
        Spec("gptq", 32, act_order=True, v2=True, sym=False),
    ),
    "awq-g128": ("wide_qwen2_dir", Spec("awq", 128)),
    "awq-g32-one-layer-float": (
        "tiny_llama_dir",
        Spec("awq", 32, not_converted=("model.layers.1.mlp.down_proj",)),
    ),
    "fp8-tensor": ("tiny_llama_dir", Spec("fp8", strategy="tensor")),
    "fp8-channel-static-sharded": (
        "tiny_qwen3_dir",
        Spec("fp8", strategy="channel", static_input=True, split=True),
    ),
}
PROMPT_LENGTHS = [3, 17, 40, 75]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """case -> (quantized dir, reference dir), written on first use."""
    made: dict[str, tuple[str, str]] = {}

    def get(case: str) -> tuple[str, str]:
        if case not in made:
            base, spec = CHECKPOINTS[case]
            root = tmp_path_factory.mktemp(case)
            made[case] = qc.write_quantized(
                request.getfixturevalue(base),
                str(root / "quantized"),
                str(root / "reference"),
                spec,
            )
        return made[case]

    return get


def _greedy(model_dir: str, **overrides: Any) -> dict[str, list[int]]:
    config = EngineConfig(
        model=model_dir,
        device="cpu",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        num_gpu_blocks_override=64,
        **overrides,
    )
    core = EngineCore(config)
    try:
        vocab = core.model_config.vocab_size
        rng = random.Random(45)
        prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)] * len(
            prompts
        )
        return run_engine(core, prompts, params)[0]
    finally:
        core.shutdown()


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_quantized_checkpoint_loads_its_dequantized_weights(case: str, checkpoints: Any) -> None:
    """Every parameter equals the float reference's, bit for bit; GPTQ/AWQ layers also
    arrive as Int4Rows (int4_rows) for the 4-bit kernel."""
    quantized, reference = checkpoints(case)
    spec = CHECKPOINTS[case][1]
    model, config = load_model(quantized)
    ref_model, _ = load_model(reference)
    assert config.quantization is not None
    ref_params = dict(ref_model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, ref_params[name]), name
    if spec.method == "fp8":
        assert model.int4_rows == {}
        return
    linears = {n for n, p in model.named_parameters() if n.endswith("proj.weight")}
    float_layers = {"layers.1.mlp.down_proj.weight"} if spec.not_converted else set()
    assert set(model.int4_rows) == linears - float_layers
    assert all(
        isinstance(rows, Int4Rows) for parts in model.int4_rows.values() for _, rows in parts
    )


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_greedy_tokens_equal_the_float_reference(case: str, checkpoints: Any) -> None:
    quantized, reference = checkpoints(case)
    want = _greedy(reference)
    assert _greedy(quantized) == want
    assert len(set(want["r0"])) > 4  # diverse enough for the comparison to bite


@pytest.mark.parametrize("case", ["gptq-g128", "awq-g32-one-layer-float"])
def test_a_4_bit_checkpoint_stays_4_bit_on_cpu(case: str, checkpoints: Any) -> None:
    """On CPU float32 the 4-bit projections run as 4-bit panels (their codes, scales and
    mins: at most a third of their float32 bytes), under ``--quantization auto`` and
    ``int8`` (which quantizes only what came as float); ``none`` runs them dequantized,
    token for token the float reference's."""
    quantized, reference = checkpoints(case)
    for quantization in ("auto", "int8"):
        core = EngineCore(EngineConfig(
            model=quantized, device="cpu", dtype="float32", max_model_len=256, quantization=quantization,
        ))
        try:
            packed, dense = 0, 0
            for name, module in core.runner.model.named_modules():
                weight = getattr(module, "packed_weight", None)
                if not name.endswith("_proj") or weight is None:
                    continue
                if case.startswith("awq") and name == "layers.1.mlp.down_proj":
                    assert weight.panels.dtype != torch.uint8  # left float by the checkpoint
                    continue
                assert weight.panels.dtype == torch.uint8, (quantization, name)
                packed += weight.panels.nbytes + weight.scale.nbytes
                dense += weight.out_features * weight.in_k * 4
            assert 0 < packed <= dense / 3, (quantization, packed, dense)
        finally:
            core.shutdown()
    assert _greedy(quantized, quantization="none") == _greedy(reference, quantization="none")


def test_tensor_parallel_slices(checkpoints: Any) -> None:
    """TP=2: row-parallel layers (o, down) take column slices, here on group boundaries
    (Int4Rows columns), column-parallel ones row slices; tokens equal the reference's at TP=2."""
    quantized, reference = checkpoints("gptq-g32-zero-biases")
    overrides = {"tensor_parallel_size": 2, "num_threads": 1}
    assert _greedy(quantized, **overrides) == _greedy(reference, **overrides)


# ---- broken checkpoints ----------------------------------------------------------------------


def _rewrite(
    model_dir: str, out: Path, drop: str | None = None, quantization: dict | None = None
) -> str:
    """A copy of ``model_dir`` without tensors ending in ``drop``, or with another quantization_config."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for name in os.listdir(model_dir):
        src = os.path.join(model_dir, name)
        if name.endswith(".safetensors"):
            tensors = {
                k: v for k, v in load_file(src).items() if drop is None or not k.endswith(drop)
            }
            save_file(tensors, str(out / name))
        elif name == "config.json" and quantization is not None:
            with open(src, encoding="utf-8") as f:
                config = json.load(f)
            (out / name).write_text(json.dumps({**config, "quantization_config": quantization}))
        else:
            (out / name).write_bytes(Path(src).read_bytes())
    return str(out)


def test_broken_quantized_checkpoints_are_named(checkpoints: Any, tmp_path: Path) -> None:
    gptq, _ = checkpoints("gptq-g32-zero-biases")
    no_scales = _rewrite(gptq, tmp_path / "no_scales", drop=".scales")
    with pytest.raises(
        ModelLoadError, match=r"quantized layer model\.layers\.\d\.\S+ lacks \S+\.scales$"
    ):
        load_model(no_scales)
    fp8, _ = checkpoints("fp8-tensor")
    no_scale = _rewrite(fp8, tmp_path / "no_weight_scale", drop=".weight_scale")
    with pytest.raises(
        ModelLoadError, match=r"\.weight is float8_e4m3fn but there is no model\.\S+\.weight_scale$"
    ):
        load_model(no_scale)
    eight_bit = _rewrite(
        gptq,
        tmp_path / "bits8",
        quantization={**qc.quantization_config(Spec("gptq", 32)), "bits": 8},
    )
    with pytest.raises(
        ModelLoadError, match=r"config\.json: quantization_config\.bits 8 is not supported for gptq"
    ):
        load_model(eight_bit)
    unknown = _rewrite(gptq, tmp_path / "unknown", quantization={"quant_method": "hqq", "nbits": 4})
    with pytest.raises(
        ModelLoadError, match=r"quantization_config\.quant_method 'hqq' is not supported"
    ):
        EngineCore(EngineConfig(model=unknown, device="cpu", max_model_len=64))
    # GPTQ tensors under an AWQ config: the first one met is named
    as_awq = _rewrite(
        gptq, tmp_path / "as_awq", quantization=qc.quantization_config(Spec("awq", 32))
    )
    with pytest.raises(ModelLoadError, match=r"g_idx|qzeros has shape|qweight"):
        load_model(as_awq)


def test_one_stream_of_entries(checkpoints: Any) -> None:
    """``quantized_entries`` over one file's entries: float tensors first, then each layer once."""
    from safetensors import safe_open

    from engine_service.models.loader import safetensors_entries

    quantized, _ = checkpoints("awq-g32-one-layer-float")
    config = ModelConfig.from_pretrained(quantized)
    assert config.quantization is not None
    with safe_open(os.path.join(quantized, "model.safetensors"), framework="pt", device="cpu") as f:
        entries = list(quantized_entries(safetensors_entries(f), config.quantization))
        names = [name for name, _, _ in entries]
        assert len(names) == len(set(names))
        assert not any(name.endswith(("qweight", "qzeros", "scales")) for name in names)
        down = dict((name, (shape, read)) for name, shape, read in entries)[
            "model.layers.0.mlp.down_proj.weight"
        ]
        assert down[0] == (config.hidden_size, config.intermediate_size)
        assert isinstance(down[1](None), Int4Rows)


def test_the_models_page_lists_the_quantization_methods() -> None:
    text = DOCS.read_text(encoding="utf-8").split("## Quantized checkpoints", 1)[1]
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    methods = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        methods.append(line.strip("|").split("|")[0].strip().strip("`"))
    assert methods == list(SUPPORTED_METHODS)
