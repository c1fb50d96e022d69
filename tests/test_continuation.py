"""Continuations (request migration, engine side): a request given the tokens it already
generated elsewhere continues exactly where it stopped.

Greedy continues by construction; seeded sampling because its random stream depends on
(seed, output position) only; penalties and min_tokens because the generated tokens
count as output, not prompt. Checked against an undisturbed run of the same request
alone, in a batch, preempted and recomputed, and continued from any position.
"""

from __future__ import annotations

import random

import pytest

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.pooling_params import PoolingParams
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams

MAX_TOKENS = 24


def _params(seed: int) -> list[SamplingParams]:
    """A seeded sampler with penalties and min_tokens, and a greedy one."""
    return [
        SamplingParams(
            temperature=0.8, top_p=0.95, seed=seed, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS // 2,
            presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2,
        ),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.3),
    ]


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for req in requests:
        core.add_request(req)
    while core.has_unfinished_requests():
        for out in core.step().all_outputs():
            tokens[out.request_id].extend(out.new_token_ids)
    core.kv_manager.pool.check_all_free()
    return tokens


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str) -> EngineCore:
    return EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=256, max_num_seqs=16))


def test_seeded_and_greedy_continue_exactly(engine: EngineCore, tiny_llama_dir: str) -> None:
    rng = random.Random()
    vocab = engine.model_config.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))]
    for params in _params(rng.randrange(2**63)):
        alone = _run(engine, [EngineCoreRequest("alone", prompt, params)])["alone"]
        assert len(alone) == MAX_TOKENS

        others = [
            EngineCoreRequest(f"o{i}", [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))],
                              SamplingParams(temperature=1.0, max_tokens=rng.randrange(1, 30)))
            for i in range(6)
        ]
        batched = _run(engine, [*others[:3], EngineCoreRequest("me", prompt, params), *others[3:]])["me"]
        assert batched == alone, "a batch changed the request's tokens"

        for cut in sorted(rng.sample(range(1, MAX_TOKENS), 4)):
            continued = _run(engine, [EngineCoreRequest(f"cut{cut}", prompt, params, generated_token_ids=alone[:cut])])
            assert continued[f"cut{cut}"] == alone[cut:], f"continued from position {cut}"


def test_preempted_and_recomputed_request_keeps_its_tokens(tiny_llama_dir: str) -> None:
    rng = random.Random()
    small = EngineCore(EngineConfig(
        model=tiny_llama_dir, max_model_len=128, max_num_seqs=8, num_gpu_blocks_override=12,
        max_num_batched_tokens=256, enable_prefix_caching=False,
    ))
    vocab = small.model_config.vocab_size
    seed = rng.randrange(2**63)
    params = _params(seed)[0]
    prompt = [rng.randrange(3, vocab) for _ in range(30)]
    alone = _run(small, [EngineCoreRequest("alone", prompt, params)])["alone"]
    crowd = [EngineCoreRequest(f"c{i}", [rng.randrange(3, vocab) for _ in range(30)], _params(seed + i + 1)[0])
             for i in range(5)]
    preemptions = 0
    tokens: dict[str, list[int]] = {}
    for req in [EngineCoreRequest("me", prompt, params), *crowd]:
        small.add_request(req)
        tokens[req.request_id] = []
    while small.has_unfinished_requests():
        outs = small.step()
        preemptions += outs.scheduler_stats.num_preemptions
        for out in outs.all_outputs():
            tokens[out.request_id].extend(out.new_token_ids)
    assert preemptions > 0, "the set-up must preempt"
    assert tokens["me"] == alone


def test_bad_continuations_are_invalid_argument(engine: EngineCore) -> None:
    params = SamplingParams(max_tokens=4)
    bad = [
        EngineCoreRequest("a", [5, 6], params, generated_token_ids=[1, 2, 3, 4]),  # nothing left
        EngineCoreRequest("b", [5, 6], params, generated_token_ids=[10**9]),  # not a token
        EngineCoreRequest("c", [5] * 200, SamplingParams(max_tokens=100), generated_token_ids=[5] * 60),  # too long
        EngineCoreRequest("d", [5, 6], SamplingParams(max_tokens=4, prompt_logprobs=1), generated_token_ids=[1]),
        EngineCoreRequest("e", [5, 6], params, generated_token_ids=[1], pooling_params=PoolingParams()),
    ]
    for req in bad:
        with pytest.raises(InvalidRequestError, match="generated_token_ids"):
            engine.add_request(req)
    assert not engine.has_unfinished_requests()
