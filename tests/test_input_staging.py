"""Eager steps' inputs through persistent buffers (engine_service/input_staging.py).

CUDA engines stage every eager step this way; here the same buffers run on CPU (no
pinning, synchronous copies), installed by hand, so the packing, the views and the
double buffering are checked against the engine's usual tensors on fresh random
workloads (chunked prefill, preemption, prefix caching, async scheduling)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.input_staging import InputStaging
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams


def test_views_hold_the_lists_aligned_and_a_step_too_big_is_refused() -> None:
    rng = random.Random()
    staging = InputStaging(torch.device("cpu"), max_tokens=40, max_seqs=5, max_blocks=6)
    for _ in range(4):  # both buffer sets, twice
        s = rng.randint(1, 5)
        width = rng.randint(1, 6)
        n = rng.randint(s, 40)
        lists = [[rng.randrange(-1, 10_000) for _ in range(n)] for _ in range(3)]
        table = [rng.randrange(0, 100) for _ in range(s * width)]
        qsl = sorted(rng.randrange(0, n + 1) for _ in range(s + 1))
        lens = [rng.randrange(1, 500) for _ in range(s)]
        out = staging.put(*lists, table, width, qsl, lens)
        assert out is not None
        ids, pos, slots, tables, qsl_t, lens_t = out
        assert ids.tolist() == lists[0] and pos.tolist() == lists[1] and slots.tolist() == lists[2]
        assert tables.shape == (s, width) and tables.flatten().tolist() == table
        assert qsl_t.tolist() == qsl and lens_t.tolist() == lens
        assert (ids.dtype, tables.dtype) == (torch.int64, torch.int32)
        for t in out:  # as a fresh allocation would be, for Triton's pointer specialisation
            assert t.data_ptr() % 64 == 0
    assert staging.put([1] * 41, [0] * 41, [0] * 41, [0], 1, [0, 41], [41]) is None
    assert staging.put([1], [0], [0], [0] * 7, 7, [0, 1], [1]) is None


def _core(model_dir: str, staged: bool, **overrides: object) -> EngineCore:
    settings: dict = dict(model=model_dir, device="cpu", max_model_len=256, max_num_seqs=6,
                          max_num_batched_tokens=64, num_gpu_blocks_override=40)
    core = EngineCore(EngineConfig(**{**settings, **overrides}))
    if staged:
        cfg = core.config
        core.runner.staging = InputStaging(
            cfg.torch_device, cfg.max_num_batched_tokens, cfg.max_num_seqs, -(-core.max_model_len // cfg.block_size)
        )
    return core


def _run(core: EngineCore, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    vocab = core.model_config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(32)]
    got: dict[str, list[int]] = {}
    for i in range(14):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 90))]
        if i % 3 == 0:
            prompt = shared + prompt
        params = SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=rng.randint(1, 50),
                                ignore_eos=True)
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
        got[f"r{i}"] = []
    while core.has_unfinished_requests():
        for o in core.step().all_outputs():
            got[o.request_id] += o.new_token_ids
    core.kv_manager.pool.check_all_free()
    return got


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_staged_steps_give_the_same_tokens(tiny_llama_dir: str, async_scheduling: bool) -> None:
    seed = random.randrange(2**31)
    want = _run(_core(tiny_llama_dir, False, async_scheduling=async_scheduling), seed)
    staged = _core(tiny_llama_dir, True, async_scheduling=async_scheduling)
    calls = []
    put = staged.runner.staging.put
    staged.runner.staging.put = lambda *a: calls.append(1) or put(*a)  # type: ignore[method-assign]
    assert _run(staged, seed) == want, f"seed={seed}"
    assert len(calls) > 10
