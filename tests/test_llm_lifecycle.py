"""The in-process LLM's lifecycle: closed by ``with``, ``shutdown()`` or a plain ``del``,
a tensor-parallel engine leaves no worker and no process group behind, so the next
one starts in the same process."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch.distributed as dist

from frontend_service.llm import LLM
from tandem.protocol.model_config import ModelConfig
from tandem.protocol.sampling_params import SamplingParams
from tests.e2e_helpers import live_children
from tests.factories import hf_greedy

MAX_TOKENS = 6


def _children() -> list[int]:
    return live_children(os.getpid(), skip_resource_tracker=True)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc (Linux)")
def test_three_tensor_parallel_llms_in_turn_close_cleanly(tiny_llama_dir: str) -> None:
    vocab = ModelConfig.from_pretrained(tiny_llama_dir).vocab_size
    rng = random.Random()
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 11, 20)]
    expected = hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
    args = dict(tensor_parallel_size=2, max_model_len=128, num_gpu_blocks_override=32, num_threads=1)
    before = set(_children())

    def closed(how: str) -> None:
        assert not dist.is_initialized(), f"a process group is still initialized after {how}"
        left = set(_children()) - before
        assert not left, f"child processes {sorted(left)} outlived {how}"

    with LLM(tiny_llama_dir, **args) as llm:
        assert dist.is_initialized() and len(set(_children()) - before) == 1  # rank 1
        assert _greedy(llm, prompts) == expected
    closed("leaving `with`")
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("a")

    llm = LLM(tiny_llama_dir, **args)
    assert _greedy(llm, prompts) == expected
    llm.shutdown()
    closed("shutdown()")
    llm.shutdown()  # idempotent

    llm = LLM(tiny_llama_dir, **args)
    assert _greedy(llm, prompts) == expected
    del llm
    closed("del")
