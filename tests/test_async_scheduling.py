"""Async scheduling (engine_service/engine_step.py, async_scheduler.py): the same tokens as
stepping in turn.

Each test drives two engines over the same workload, one with ``async_scheduling``, and
compares every request's tokens and finish reason; the KV cache ends empty. Inputs are
fresh random prompts each run (the seed is printed on failure).
"""

from __future__ import annotations

import random

import pytest

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from tandem.protocol.outputs import EngineCoreRequest, FinishReason
from tandem.protocol.sampling_params import SamplingParams
from tandem.protocol.structured_output import StructuredOutputsParams
from tests.factories import make_request, make_scheduler


def _core(model_dir: str, async_scheduling: bool, **overrides: object) -> EngineCore:
    settings: dict = dict(model=model_dir, device="cpu", max_model_len=256, max_num_seqs=8,
                          num_gpu_blocks_override=48, async_scheduling=async_scheduling)
    return EngineCore(EngineConfig(**{**settings, **overrides}))


def _drive(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]],
           abort_at: dict[int, list[str]] | None = None) -> tuple[dict, dict, int]:
    """Add every request, step to the end (aborting ``abort_at[step]``'s ids before that
    step); returns tokens and finish reasons per request, and the steps taken."""
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    reasons: dict[str, object] = {}
    for rid, prompt, params in requests:
        core.add_request(EngineCoreRequest(rid, prompt, params, eos_token_id=2))
    steps = 0
    while core.has_unfinished_requests():
        for rid in (abort_at or {}).get(steps, []):
            core.abort_requests([rid])
        for o in core.step().all_outputs():
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason
        steps += 1
    core.kv_manager.pool.check_all_free()
    return tokens, reasons, steps


def _workload(vocab: int, seed: int, n: int = 20) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy and seeded random rows, stop tokens, eos, one-token budgets, shared prefixes."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))]
        if i % 4 == 0:
            prompt = shared + prompt
        params = SamplingParams(
            temperature=0.0 if i % 3 else 0.9, seed=1000 + i, top_p=0.95 if i % 5 == 1 else 1.0,
            max_tokens=rng.choice([1, 2, 17, 40]), ignore_eos=i % 2 == 0, stop_token_ids=[5, 9],
        )
        out.append((f"r{i}", prompt, params))
    return out


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_async_matches_stepping_in_turn(tiny_llama_dir: str, prefix_caching: bool) -> None:
    seed = random.randrange(2**31)
    sync = _core(tiny_llama_dir, False, enable_prefix_caching=prefix_caching)
    work = _workload(sync.model_config.vocab_size, seed)
    want = _drive(sync, work)
    got = _drive(_core(tiny_llama_dir, True, enable_prefix_caching=prefix_caching), work)
    assert got[0] == want[0], f"seed={seed}"
    assert got[1] == want[1], f"seed={seed}"
    assert any(len(t) > 1 for t in want[0].values())


def test_preemption_while_a_step_is_in_flight(tiny_llama_dir: str) -> None:
    """So few KV blocks that requests holding an in-flight token get preempted."""
    seed = random.randrange(2**31)
    work = _workload(256, seed, n=16)
    work = [(rid, p, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)) for rid, p, _ in work]
    settings = dict(num_gpu_blocks_override=24, max_num_batched_tokens=256, enable_prefix_caching=False)
    sync, asyn = _core(tiny_llama_dir, False, **settings), _core(tiny_llama_dir, True, **settings)
    preempted = []

    def count(core: EngineCore) -> None:
        step = core.step

        def counted():  # type: ignore[no-untyped-def]
            out = step()
            preempted.append(out.scheduler_stats.num_preemptions if out.scheduler_stats else 0)
            return out

        core.step = counted  # type: ignore[method-assign]

    count(asyn)
    want = _drive(sync, work)
    got = _drive(asyn, work)
    assert sum(preempted) > 0, "the workload did not preempt"
    assert got[0] == want[0], f"seed={seed}"


def test_steps_that_need_host_tokens_run_in_turn_between_async_ones(tiny_llama_dir: str) -> None:
    """Penalties, logprobs and structured output join a pipelined batch mid-run: the
    pipeline waits for the step in flight, runs them in turn, and picks up again."""
    seed = random.randrange(2**31)
    base = _workload(256, seed, n=10)
    rng = random.Random(seed)
    special = [
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(temperature=0.0, max_tokens=12,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
    ]
    work = base + [(f"s{i}", [rng.randrange(3, 256) for _ in range(9)], p) for i, p in enumerate(special)]
    want = _drive(_core(tiny_llama_dir, False), work)
    asyn = _core(tiny_llama_dir, True)
    got = _drive(asyn, work)
    assert got[0] == want[0], f"seed={seed}"
    assert got[1] == want[1], f"seed={seed}"


def test_abort_while_its_token_is_in_flight(tiny_llama_dir: str) -> None:
    """An aborted request's in-flight token is dropped; the others are unaffected."""
    seed = random.randrange(2**31)
    work = [(rid, p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
            for rid, p, _ in _workload(256, seed, n=6)]
    aborts = {4: ["r1"], 9: ["r3", "r4"]}
    want = _drive(_core(tiny_llama_dir, False), work, aborts)
    got = _drive(_core(tiny_llama_dir, True), work, aborts)
    # Outputs come one step later with async scheduling, so an abort lands one token
    # earlier in what was reported; the requests left alone are identical.
    for rid in ("r0", "r2", "r5"):
        assert got[0][rid] == want[0][rid], f"seed={seed}"
    for rid in ("r1", "r3", "r4"):
        assert got[1][rid] == FinishReason.ABORT
        assert got[0][rid] == want[0][rid][: len(got[0][rid])]


def test_outputs_come_one_step_later(tiny_llama_dir: str) -> None:
    core = _core(tiny_llama_dir, True)
    core.add_request(EngineCoreRequest("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3,
                                                                           ignore_eos=True)))
    first = core.step()  # the prefill is launched; its token is still on the device
    assert first.all_outputs() == []
    request = core.scheduler.requests["a"]  # the token is counted, not written into the lists
    assert request.num_output_placeholders == 1 and request.all_token_ids == [5, 6, 7, 8]
    assert request.num_computed_tokens == 4
    second = core.step()
    assert [o.new_token_ids for o in second.all_outputs()] and core.has_unfinished_requests()
    tokens = [t for out in (first, second) for o in out.all_outputs() for t in o.new_token_ids]
    while core.has_unfinished_requests():
        tokens += [t for o in core.step().all_outputs() for t in o.new_token_ids]
    assert len(tokens) == 3 and min(tokens) >= 0 and request.num_output_placeholders == 0
    core.kv_manager.pool.check_all_free()


def test_a_placeholder_is_never_hashed_into_the_prefix_cache() -> None:
    """A placeholder that completes a block is left out of the block hashes until its
    token is known; then the block hashes as if the token had been there all along."""
    sched = make_scheduler(block_size=4, async_scheduling=True)
    request = make_request([11, 12, 13], max_tokens=4)  # the first output token completes block 0
    twin = make_request([11, 12, 13], max_tokens=4)
    sched.add_request(request)
    out = sched.schedule()  # counts the prefill computed and one placeholder
    assert request.all_token_ids == [11, 12, 13] and request.num_output_placeholders == 1
    assert request.num_computed_tokens == 3
    sched.kv._update_block_hashes(request)
    assert request.block_hashes == []
    sched.update_after_step(out, {request.request_id: 14})
    assert request.num_output_placeholders == 0 and request.all_token_ids[-1] == 14
    sched.kv._update_block_hashes(request)
    twin.all_token_ids = [11, 12, 13, 14]
    sched.kv._update_block_hashes(twin)
    assert request.block_hashes == twin.block_hashes and len(twin.block_hashes) == 1
