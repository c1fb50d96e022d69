"""Small factories for engine tests, and the Hugging Face greedy oracle."""

from __future__ import annotations

import itertools
import random

from engine_service.async_scheduler import AsyncScheduler
from engine_service.kv_cache.manager import KVCacheManager
from engine_service.request import Request
from engine_service.scheduler import Scheduler, SchedulerOutput
from tandem.protocol.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(
    prompt: list[int] | int,
    max_tokens: int = 8,
    priority: int = 0,
    arrival: float | None = None,
    request_id: str | None = None,
    **params: object,
) -> Request:
    """A request with ``prompt`` tokens (a count gives random ones) and sampling params."""
    if isinstance(prompt, int):
        prompt = [random.randrange(1, 1000) for _ in range(prompt)]
    rid = request_id or f"req-{next(_ids)}"
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    return Request(rid, list(prompt), sp, eos_token_id=0, arrival_time=arrival or next(_ids), priority=priority)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    policy: str = "fcfs",
    enable_caching: bool = True,
    chunked: bool = True,
    async_scheduling: bool = False,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching)
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(kv, max_num_seqs, max_num_batched_tokens, max_model_len, policy, chunked)


def fake_step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    """Schedule, pretend to run, and sample ``token`` for every request that samples."""
    out = scheduler.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    scheduler.update_after_step(out, sampled)
    return out, scheduler.take_ended()


def run_until_done(scheduler: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while scheduler.num_unfinished:
        fake_step(scheduler)
        scheduler.kv.check_invariants()
        steps += 1
        if steps > max_steps:
            raise AssertionError("scheduler made no progress")
    return steps


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
    """Hugging Face ``generate()`` greedy continuations, one prompt at a time, past EOS."""
    import torch
    from transformers import AutoModelForCausalLM

    counts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, counts):
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(gen[0, len(prompt) :].tolist())
    return out
