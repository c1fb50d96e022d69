"""The linear backend follows what the CPU supports: the native panel kernel for float32,
oneDNN where it runs the dtype, else F.linear, so every dtype runs on any x86-64 CPU. A CPU without AVX-512 is simulated by
making torch's bf16 capability probe say no and making packing fail the way torch does
there, so a wrong choice shows up as an error, not as a silently different path."""

from __future__ import annotations

import os
import platform
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine_service.config import ConfigError, EngineConfig
from engine_service.core import EngineCore
from engine_service.models import decoder, layers
from kernels import onednn_linear
from tandem import cli
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams

_TORCH_MESSAGE = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, "
    "avx512vl and avx512dq"
)


@pytest.fixture
def cpu_without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU: no oneDNN bf16, and packing a bf16 weight fails as torch does."""
    real_supports = onednn_linear.cpu_supports
    real_pack = layers.pack_weight

    def supports(dtype: torch.dtype) -> bool:
        return dtype != torch.bfloat16 and real_supports(dtype)

    def pack(weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype == torch.bfloat16:
            raise RuntimeError(_TORCH_MESSAGE)
        return real_pack(weight)

    monkeypatch.setattr(onednn_linear, "cpu_supports", supports)
    monkeypatch.setattr(layers, "pack_weight", pack)


def _auto_fp32() -> str:
    from kernels.cpu_ops import native_available

    if native_available():
        return "panel"
    return "onednn" if onednn_linear.onednn_linear_available(torch.device("cpu"), torch.float32) else "torch"


def test_probe_asks_torch_the_question_its_reorder_asks() -> None:
    assert onednn_linear.cpu_supports(torch.float32)
    assert not onednn_linear.cpu_supports(torch.float16)
    assert onednn_linear.cpu_supports(torch.bfloat16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_auto_picks_onednn_only_where_the_cpu_runs_it(dtype: str) -> None:
    config = EngineConfig(dtype=dtype, device="cpu")
    expected = onednn_linear.onednn_linear_available(torch.device("cpu"), getattr(torch, dtype))
    if dtype == "float32":
        assert config.resolved_linear_backend == _auto_fp32()
    else:
        assert config.resolved_linear_backend == ("onednn" if expected else "torch")


def test_without_bf16_isa_auto_falls_back_and_forcing_onednn_is_refused(cpu_without_bf16: None) -> None:
    assert EngineConfig(dtype="bfloat16", device="cpu").resolved_linear_backend == "torch"
    assert EngineConfig(dtype="float32", device="cpu").resolved_linear_backend == _auto_fp32()
    with pytest.raises(ConfigError, match="AVX-512"):
        _ = EngineConfig(dtype="bfloat16", device="cpu", linear_backend="onednn").resolved_linear_backend


def test_bf16_engine_runs_on_f_linear_without_the_isa(cpu_without_bf16: None, tiny_llama_dir: str) -> None:
    """No layer is packed, a layer computes what F.linear computes, and requests finish."""
    core = EngineCore(EngineConfig(model=tiny_llama_dir, dtype="bfloat16", device="cpu",
                                   max_model_len=128, num_gpu_blocks_override=32))
    linears = [m for m in core.model.modules() if isinstance(m, decoder.FusedLinear)]
    assert linears and all(m.packed_weight is None and m.weight is not None for m in linears)
    assert core.model.lm_head_packed is None
    assert all(m.weight.dtype == torch.bfloat16 for m in linears)
    x = torch.randn(5, linears[0].weight.shape[1], dtype=torch.bfloat16)
    torch.testing.assert_close(linears[0](x), F.linear(x, linears[0].weight, linears[0].bias))

    rng = random.Random()
    vocab = core.model_config.vocab_size
    for i in range(3):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 20))]
        core.add_request(EngineCoreRequest(str(i), prompt, SamplingParams(max_tokens=6, ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step().all_outputs():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert sorted(tokens) == ["0", "1", "2"]
    assert all(len(t) == 6 and all(0 <= v < vocab for v in t) for t in tokens.values())


def test_tandem_run_bfloat16_without_the_isa(
    cpu_without_bf16: None, tiny_llama_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``tandem run --dtype bfloat16`` does on an AVX2-only CPU, in-process."""
    rc = cli.main(["run", "--model", tiny_llama_dir, "--dtype", "bfloat16", "--max-tokens", "5",
                   "--max-model-len", "128", "--num-gpu-blocks-override", "32", "hello there"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- 'hello there'" in out and "tokens in" in out


def test_tandem_run_bfloat16_with_onednn_limited_to_avx2(tiny_llama_dir: str) -> None:
    """The real thing, not a monkeypatch: oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA``)
    refuses bf16 packing with torch's own error on any CPU, as on an AVX2-only one, and
    ATen runs its AVX2 kernels (``ATEN_CPU_CAPABILITY``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"ONEDNN_MAX_CPU_ISA=AVX2 caps x86-64 CPUs only; this one is {platform.machine()}")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.ops.mkldnn._is_mkldnn_bf16_supported())"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )
    assert probe.stdout.strip() == "False"
    run = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "run", "--model", tiny_llama_dir, "--dtype", "bfloat16",
         "--max-tokens", "5", "--max-model-len", "128", "--num-gpu-blocks-override", "32", "hello there"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--- 'hello there'" in run.stdout and "tokens in" in run.stdout
    assert "Traceback" not in run.stderr
