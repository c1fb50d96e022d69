"""The engine's HF parity with ``attention_backend="triton"``, the kernels interpreted on CPU.

Runs in a child process: ``TRITON_INTERPRET`` must be set before triton is imported,
and other modules of this pytest process may already have imported it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import json, random, sys
    import torch
    from transformers import AutoModelForCausalLM
    from engine_service.config import EngineConfig
    from engine_service.core import EngineCore
    from tandem.protocol.outputs import EngineCoreRequest
    from tandem.protocol.sampling_params import SamplingParams

    model_dir, extra = sys.argv[1], json.loads(sys.argv[2])
    rng = random.Random(7)
    core = EngineCore(EngineConfig(model=model_dir, attention_backend="triton", max_model_len=256,
                                   num_gpu_blocks_override=64, max_num_batched_tokens=32, **extra))
    assert core.runner.model is core.model
    vocab = core.model_config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (1, 17, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = {}
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, params))
        got[str(i)] = []
    while core.has_unfinished_requests():
        for o in core.step().all_outputs():
            got[o.request_id] += o.new_token_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                              min_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    print("@@" + json.dumps({"got": [got[str(i)] for i in range(len(prompts))], "want": want,
                             "backend": core.config.resolved_attention_backend}))
    """
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "extra",
    [{}, {"triton_gemv": True, "triton_split_kv": True, "linear_backend": "torch"}],
    ids=["default", "gemv-split-kv"],
)
def test_triton_backend_matches_hf(tiny_llama_dir: str, extra: dict[str, bool]) -> None:
    """Greedy parity with HF, with the default kernels and with the opt-in ones: the
    GEMV for the decode steps' linears (over dense weights, as on CUDA: the CPU's
    default packs them) and split-KV decode attention."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, tiny_llama_dir, json.dumps(extra)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=580,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][2:])
    assert result["backend"] == "triton"
    assert result["got"] == result["want"]
