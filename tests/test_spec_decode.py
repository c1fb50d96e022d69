"""Speculative decoding: ``--speculative-config``, verification, the scheduler's drafts and
their roll-back, and engines with drafts giving what they give without.

Greedy and seeded requests must be token for token the same with speculation on and off
(spec_decode/rejection.py says why seeded ones too); unseeded sampled ones must have the same
distribution (a two-sample test sized to see a 2% shift). An "oracle" proposer that drafts
the spec-off continuation (with every third draft wrong) makes long accepted runs and
rejections happen at will on random-weight models; the real proposers (n-gram, suffix) run
on prompts with repeats.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable

import pytest

from engine_service.config import ConfigError, EngineConfig
from engine_service.core import EngineCore
from engine_service.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from engine_service.spec_decode.rejection import verify
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams

# A draft token costs next to nothing here (draft_token_cost): the correctness tests draft
# whenever a proposer has something, whatever the batch.
NGRAM = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
         '"draft_token_cost": 0.001}')
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 4, "draft_token_cost": 0.001}'


def draft_spec(model_dir: str, quantization: str = "int8", **extra: object) -> str:
    """A draft model: the target's own checkpoint, by default with int8 weights (it mostly
    agrees with the float target, not always: accepted runs and rejections)."""
    import json

    return json.dumps({"model": model_dir, "num_speculative_tokens": 4, "quantization": quantization,
                       "draft_token_cost": 0.001, "draft_model_cost": 0.001, **extra})


ARCHS = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"]
SETUPS: dict[str, dict[str, object]] = {
    "fits": dict(max_num_batched_tokens=2048, enable_prefix_caching=False),
    "chunked": dict(max_num_batched_tokens=48, enable_prefix_caching=False),
    "preempt": dict(max_num_batched_tokens=512, num_gpu_blocks_override=14, max_model_len=128,
                    enable_prefix_caching=False),
    "prefix": dict(max_num_batched_tokens=1024, enable_prefix_caching=True),
    "async": dict(max_num_batched_tokens=64, enable_prefix_caching=True, async_scheduling=True),
}


# ---- config and verification ------------------------------------------------------------


def test_speculative_config_reads_vllm_json() -> None:
    config = SpeculativeConfig.parse(NGRAM)
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        "ngram", 4, 1, 3,
    )
    assert SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 2}).suffix_decoding_max_tree_depth == 24
    for text, message in [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram, suffix"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown or unsupported key"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "method 'draft_model' and its 'model'"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs 'model'"),
        ('{"model": "x", "num_speculative_tokens": 2, "quantization": "fp4"}', "quantization must be"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
         "prompt_lookup_min"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "must be a number"),
    ]:
        with pytest.raises(SpeculativeConfigError, match=message):
            SpeculativeConfig.parse(text)


def test_engine_config_speculative_flag() -> None:
    assert EngineConfig().speculative is None
    assert EngineConfig(speculative_config=SUFFIX).speculative == SpeculativeConfig("suffix", 4, draft_token_cost=0.001)
    with pytest.raises(ConfigError, match="not JSON"):
        EngineConfig(speculative_config="{")
    draft = SpeculativeConfig.parse('{"model": "/m", "num_speculative_tokens": 3}')  # vLLM's shorthand
    assert (draft.method, draft.model, draft.quantization) == ("draft_model", "/m", "auto")
    from engine_service.model_runner import decode_rows  # the decode graphs' batch: verify rows fit

    assert decode_rows(EngineConfig(max_num_seqs=128)) == 128
    assert decode_rows(EngineConfig(max_num_seqs=128, speculative_config=NGRAM)) == 128  # 16 x (1 + 4) < 128
    assert decode_rows(EngineConfig(max_num_seqs=8, speculative_config=NGRAM)) == 40
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(speculative_config='{"model": "/m", "num_speculative_tokens": 3}', tensor_parallel_size=2)


def test_verify_accepts_the_drafts_the_target_sampled() -> None:
    assert verify([5, 6, 7], [5, 6, 7, 8]) == ([5, 6, 7], 8)
    assert verify([5, 6, 7], [5, 9, 7, 8]) == ([5], 9)
    assert verify([5, 6, 7], [1, 6, 7, 8]) == ([], 1)
    assert verify([], [3]) == ([], 3)
    with pytest.raises(ValueError, match="need 3 sampled"):
        verify([1, 2], [1, 2])


def test_draft_length_pays_for_its_rows() -> None:
    """k maximizes expected tokens per step time; rows cost more as the batch grows."""
    from engine_service.spec_decode.speculator import Speculator, best_draft_length

    assert best_draft_length(0.95, 8, 0.0) == 8  # free rows: as many as allowed
    assert best_draft_length(0.9, 8, 0.25) == 6  # 1 + .9 + ... + .9^6 = 5.22 over 2.5 steps
    assert best_draft_length(0.5, 8, 0.25) == 1
    assert best_draft_length(0.2, 8, 0.25) == 0  # 1.2 tokens for 1.25 steps: not worth it
    assert best_draft_length(1.0, 3, 0.25) == 3  # capped by the room
    speculator = Speculator(SpeculativeConfig("ngram", 4, draft_token_cost=0.25))
    shares = [speculator.step_share(b) for b in (1, 2, 4, 16, 64)]
    assert shares[0] == 0.25 and shares == sorted(shares) and shares[-1] < 1.0


# ---- engines: drafts on and off -------------------------------------------------------------


def _run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        tokens[f"r{i}"] = []
        core.add_request(EngineCoreRequest(f"r{i}", prompt, p, eos_token_id=None))
    while core.has_unfinished_requests():
        for out in core.step().all_outputs():
            tokens[out.request_id].extend(out.new_token_ids)
    core.kv_manager.check_all_free()
    return tokens


def _engine(model_dir: str, spec: str = "", **kwargs: object) -> EngineCore:
    kwargs.setdefault("max_model_len", 512)
    kwargs.setdefault("max_num_seqs", 16)
    return EngineCore(EngineConfig(model=model_dir, device="cpu", speculative_config=spec, **kwargs))  # type: ignore[arg-type]


def _repetitive_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short phrase (the proposers find n-grams) and plain random ones."""
    rng = random.Random(seed)
    prompts = []
    for n in (5, 9, 3, 17, 1, 40):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        prompts.append((phrase * (n // len(phrase) + 2))[: n + 8] if n > 1 else phrase[:1])
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in (30, 100)]
    return prompts


def _spec_counts(core: EngineCore) -> Counter[str]:
    """Draft tokens ``drafted`` and ``accepted`` so far, kept up to date (the scheduler's
    speculator records them per request)."""
    speculator = core.scheduler.speculator
    assert speculator is not None
    seen: Counter[str] = Counter()
    real = speculator.record

    def record(request, num_drafted: int, num_accepted: int) -> None:  # type: ignore[no-untyped-def]
        seen.update(drafted=num_drafted, accepted=num_accepted)
        real(request, num_drafted, num_accepted)

    speculator.record = record  # type: ignore[method-assign]
    return seen


def _accepted_counter(core: EngineCore) -> Callable[[], int]:
    """Accepted draft tokens so far."""
    seen = _spec_counts(core)
    return lambda: seen["accepted"]


def _oracle(core: EngineCore, prompts: list[list[int]], want: dict[str, list[int]], wrong_every: int = 3) -> None:
    """The speculator drafts each request's spec-off continuation, every ``wrong_every``-th
    drafted token replaced by another (a rejection there)."""
    speculator = core.scheduler.speculator
    assert speculator is not None
    by_prompt = {tuple(p): want[f"r{i}"] for i, p in enumerate(prompts)}

    def propose(request, room: int, cost: float, rate: float) -> list[int]:  # type: ignore[no-untyped-def]
        full = by_prompt[tuple(request.prompt_token_ids)]
        done = request.num_output_tokens
        drafts = list(full[done : done + room])
        for j in range(len(drafts)):
            if (done + j) % wrong_every == wrong_every - 1:
                drafts[j] = (drafts[j] + 1) % core.model_config.vocab_size
        return drafts

    speculator._propose = propose  # type: ignore[method-assign]


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_with_each_proposer(arch: str, setup: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(arch)
    off = _engine(model_dir, **SETUPS[setup])
    vocab = off.model_config.vocab_size
    prompts = _repetitive_prompts(vocab, seed=ARCHS.index(arch))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 24, 33, 8, 40, 16, 40, 12)]
    want = _run(off, prompts, params)
    off.shutdown()
    for spec in (NGRAM, SUFFIX, draft_spec(model_dir)):
        on = _engine(model_dir, spec, **SETUPS[setup])
        accepted = _accepted_counter(on)
        got = _run(on, prompts, params)
        on.shutdown()
        assert got == want, (setup, spec)
        assert accepted() > 0, (setup, spec)  # drafts were accepted: the comparison bites


@pytest.mark.parametrize("arch", ["tiny_mistral_dir", "tiny_gemma2_dir"])
def test_sliding_window_models(arch: str, request: pytest.FixtureRequest) -> None:
    """Sliding-window layers (Mistral: every layer, window 32; Gemma 2: every other one)
    keep their window's blocks only: drafts and their roll-back stay inside what the window
    keeps (blocks are freed from the step's first query position), with prefix caching
    and preemption too, for n-gram drafts and a draft model."""
    model_dir = request.getfixturevalue(arch)
    kw = dict(max_num_batched_tokens=512, max_model_len=128, num_gpu_blocks_override=24, enable_prefix_caching=True)
    off = _engine(model_dir, **kw)
    prompts = _repetitive_prompts(off.model_config.vocab_size, seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (60, 24, 50, 8, 60, 16, 40, 12)]
    want = _run(off, prompts, params)
    off.shutdown()
    for spec in (NGRAM, draft_spec(model_dir)):
        on = _engine(model_dir, spec, **kw)
        accepted = _accepted_counter(on)
        assert _run(on, prompts, params) == want, spec
        assert accepted() > 0, spec
        on.shutdown()


@pytest.mark.parametrize("setup", ["fits", "preempt", "prefix", "async"])
def test_greedy_with_long_accepted_runs_and_rejections(setup: str, tiny_llama_dir: str) -> None:
    """The oracle's drafts: most accepted, every third rejected; stop tokens and max_tokens
    inside a run of accepted drafts end the request where they would without drafts."""
    off = _engine(tiny_llama_dir, **SETUPS[setup])
    vocab = off.model_config.vocab_size
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (4, 20, 50, 9, 33)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (37, 30, 5, 41, 2)]
    want = _run(off, prompts, params)
    # Stop at a token met mid-way (prompt 1's 13th output token), not at its first occurrence elsewhere.
    stop = want["r1"][12]
    stopped = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True, stop_token_ids=[stop])
               for p in params]
    want_stopped = _run(off, prompts, stopped)
    assert len(want_stopped["r1"]) <= 13
    off.shutdown()
    on = _engine(tiny_llama_dir, NGRAM, **SETUPS[setup])
    accepted = _accepted_counter(on)
    _oracle(on, prompts, want)
    assert _run(on, prompts, params) == want
    assert accepted() > 30
    _oracle(on, prompts, want_stopped)
    assert _run(on, prompts, stopped) == want_stopped
    on.shutdown()


def test_seeded_sampling_is_token_for_token_the_same(tiny_qwen2_dir: str) -> None:
    """Seeded rows draw by (seed, output position): each draft row draws what the same
    position draws without drafts, penalties and min_tokens seeing the drafts before it."""
    off = _engine(tiny_qwen2_dir)
    vocab = off.model_config.vocab_size
    rng = random.Random(11)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (6, 25, 12, 40, 3, 18)]
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=30, ignore_eos=True,
                       presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=1.0, seed=4, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=8, seed=5, max_tokens=30, min_tokens=20, ignore_eos=False,
                       logit_bias={7: 3.0}),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, frequency_penalty=1.0),
    ]
    want = _run(off, prompts, params)
    off.shutdown()
    on = _engine(tiny_qwen2_dir, NGRAM)
    accepted = _accepted_counter(on)
    _oracle(on, prompts, want)
    got = _run(on, prompts, params)
    assert got == want
    assert accepted() > 30
    assert _run(on, prompts, params) == want  # and run after run
    on.shutdown()


def test_draft_model_keeps_its_kv_in_step(tiny_llama_dir: str) -> None:
    """The target's own weights as the draft accept every greedy draft: its KV follows each
    request's accepted tokens (a stale or misplaced row would make drafts wrong). With a
    draft cache too small for every request, requests give their draft KV back and take
    turns; every block is free at the end. Seeded sampling is unchanged with an int8
    draft; the draft sleeps and wakes with the engine."""
    off = _engine(tiny_llama_dir, max_num_batched_tokens=512)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (7, 60, 21, 90)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 25, 40, 12)]
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=20, ignore_eos=True) for i in range(4)]
    want, want_seeded = _run(off, prompts, greedy), _run(off, prompts, seeded)
    off.shutdown()
    for blocks in (None, 14):  # 14 blocks of 16: not all four requests' draft KV at once
        on = _engine(tiny_llama_dir, draft_spec(tiny_llama_dir, "none"), max_num_batched_tokens=512,
                     num_gpu_blocks_override=blocks, max_model_len=128)
        counts = _spec_counts(on)
        assert _run(on, prompts, greedy) == want
        draft = on.scheduler.speculator.draft_model
        assert draft.num_free_blocks == draft.num_blocks  # every request's draft KV went back
        # Float drafts of the target's own weights: argmax ties aside, all accepted.
        assert counts["drafted"] > 40 and counts["accepted"] >= 0.95 * counts["drafted"], counts
        on.shutdown()
    on = _engine(tiny_llama_dir, draft_spec(tiny_llama_dir), max_num_batched_tokens=512)
    assert _run(on, prompts, seeded) == want_seeded
    on.sleep(level=2)
    on.wake_up()
    assert _run(on, prompts, greedy) == want
    on.shutdown()


@pytest.mark.parametrize("short", [8, 50])
def test_draft_model_catches_up_only_a_short_output(short: int, tiny_llama_dir: str) -> None:
    """Above disable_by_batch_size nothing drafts; once the batch shrinks, a request whose
    output the draft has not seen for more than MAX_OUTPUT_LAG tokens goes on without
    drafts (catching up would cost a draft prefill of its whole output)."""
    from engine_service.spec_decode.draft_model import MAX_OUTPUT_LAG

    on = _engine(tiny_llama_dir, draft_spec(tiny_llama_dir, "none", disable_by_batch_size=2))
    counts = _spec_counts(on)
    lengths = (short, 100, 100)  # the first ends after `short` tokens: the other two may draft
    _run(on, [[5, 6, 7, 8]] * 3, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
    on.shutdown()
    assert (counts["drafted"] > 0) == (short <= MAX_OUTPUT_LAG), counts


def test_structured_output_with_drafts(tiny_llama_dir: str) -> None:
    """Constrained requests draft too: drafts are cut to what the grammar accepts and each
    draft row is masked as if the drafts before it were output, so greedy and seeded
    constrained requests give the spec-off tokens, with the oracle's drafts (every third
    one wrong, often outside the grammar) and with a draft model."""
    from tests.test_structured_output import _constraints

    rng = random.Random(2)
    prompts, params = [], []
    for i, (so, _) in enumerate(_constraints()):
        prompts.append([rng.randrange(5, 1000) for _ in range(rng.randint(3, 30))])
        params.append(SamplingParams(max_tokens=48, temperature=0.0 if i % 2 else 0.8, seed=None if i % 2 else i,
                                     structured_outputs=so))
    off = _engine(tiny_llama_dir, max_logprobs=5)
    want = _run(off, prompts, params)
    off.shutdown()
    for spec in (NGRAM, draft_spec(tiny_llama_dir, "none")):
        on = _engine(tiny_llama_dir, spec, max_logprobs=5)
        counts = _spec_counts(on)
        if spec == NGRAM:
            _oracle(on, prompts, want)
        assert _run(on, prompts, params) == want, spec
        assert counts["accepted"] > 20, (spec, counts)
        on.shutdown()


def test_draft_model_needs_the_target_s_vocabulary(tiny_llama_dir: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from engine_service.make_model import make_model

    other = make_model(tmp_path / "other", preset="hop", seed=1)  # vocabulary 2048, not 1024
    with pytest.raises(ConfigError, match="a draft must share the target's tokenizer"):
        _engine(tiny_llama_dir, draft_spec(other))


def _run_logprobs(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, tuple]:
    """Per request: its tokens, and its logprobs' token ids, ranks and values, position by position."""
    got: dict[str, tuple[list[int], list[list[int]], list[int], list[list[float]]]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        got[f"r{i}"] = ([], [], [], [])
        core.add_request(EngineCoreRequest(f"r{i}", prompt, p, eos_token_id=None))
    while core.has_unfinished_requests():
        for out in core.step().all_outputs():
            tokens, ids, ranks, values = got[out.request_id]
            tokens.extend(out.new_token_ids)
            if out.new_logprobs is not None:
                assert len(out.new_logprobs) == len(out.new_token_ids)
                ids.extend(out.new_logprobs.token_ids)
                ranks.extend(out.new_logprobs.ranks)
                values.extend(out.new_logprobs.logprobs)
    return got


def test_logprobs_are_each_emitted_token_s_own(tiny_llama_dir: str) -> None:
    """A request with logprobs drafts too: each emitted token's logprobs come from its own
    row, the same as without drafts (a stop inside an accepted run cuts them with the tokens)."""
    off = _engine(tiny_llama_dir)
    vocab = off.model_config.vocab_size
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (7, 30, 15)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, top_k=6, seed=9, max_tokens=30, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    plain = _run(off, prompts, params)
    stop = plain["r0"][10]
    params[0] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3, stop_token_ids=[stop])
    want = _run_logprobs(off, prompts, params)
    off.shutdown()
    on = _engine(tiny_llama_dir, NGRAM)
    accepted = _accepted_counter(on)
    _oracle(on, prompts, {rid: tokens for rid, (tokens, *_) in want.items()})
    got = _run_logprobs(on, prompts, params)
    on.shutdown()
    assert accepted() > 20
    for rid in want:
        tokens, ids, ranks, values = got[rid]
        assert (tokens, ids, ranks) == want[rid][:3], rid
        assert len(tokens) == len(ids) or not ids
        for mine, theirs in zip(values, want[rid][3], strict=True):
            assert mine == pytest.approx(theirs, abs=1e-5), rid
    assert len(want["r0"][0]) <= 11 and want["r0"][1]


def test_unseeded_sampling_has_the_same_distribution(tiny_llama_dir: str) -> None:
    """N = 30,000 unseeded requests of one prompt at temperature 1.3 with top-k 5 and top-p
    0.8, with the greedy continuation as their drafts (accepted about half the time) and
    without: the frequency of every token at output positions 1 and 2 (the drafted ones)
    agrees within 4 standard errors of a difference of two frequencies, at most 0.0163 (at
    p = 0.5). A 2% shift of a token's probability is 4.9 of those errors there, more
    elsewhere. Torch's generator is seeded: the draws, and so the test, are the same every run."""
    import torch

    n = 30000
    kw = dict(max_num_seqs=400, max_num_batched_tokens=4096, num_gpu_blocks_override=1200)
    off = _engine(tiny_llama_dir, **kw)
    on = _engine(tiny_llama_dir, NGRAM.replace("}", ', "disable_by_batch_size": 0}'), **kw)
    vocab = off.model_config.vocab_size
    prompt = [random.Random(3).randrange(3, vocab) for _ in range(12)]
    greedy = _run(off, [prompt], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])["r0"]
    params = SamplingParams(temperature=1.3, top_k=5, top_p=0.8, max_tokens=3, ignore_eos=True)
    torch.manual_seed(1234)
    without = _run(off, [prompt] * n, [params] * n)
    off.shutdown()
    accepted = _accepted_counter(on)
    _oracle(on, [prompt], {"r0": greedy}, wrong_every=10**9)  # drafts: the greedy tokens
    with_drafts = _run(on, [prompt] * n, [params] * n)
    on.shutdown()
    assert n // 5 < accepted() < n  # drafts accepted, and rejected
    for pos in (1, 2):
        a = Counter(toks[pos] for toks in without.values())
        b = Counter(toks[pos] for toks in with_drafts.values())
        assert len(a) > 2  # a spread distribution, not one dominant token
        for token in set(a) | set(b):
            pa, pb = a[token] / n, b[token] / n
            p = (pa + pb) / 2
            bound = 4 * math.sqrt(max(p * (1 - p), 1 / n) * 2 / n)
            assert abs(pa - pb) <= bound, (pos, token, pa, pb, bound)


def test_drafts_step_aside_under_load_and_opt_out(tiny_llama_dir: str) -> None:
    """No drafts in a step of more running requests than disable_by_batch_size, none for a
    request that opts out (``speculative=False``)."""
    core = _engine(tiny_llama_dir, NGRAM.replace("}", ', "disable_by_batch_size": 4}'))
    accepted = _accepted_counter(core)
    prompt = [5, 6, 7] * 10
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _run(core, [prompt] * 5, [greedy] * 5)
    assert accepted() == 0  # 5 running > 4
    _run(core, [prompt], [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, speculative=False)])
    assert accepted() == 0
    _run(core, [prompt], [greedy])
    assert accepted() > 0
    core.shutdown()


# ---- what it reports -------------------------------------------------------------------------


def test_metrics_log_line_and_span_attributes(tiny_llama_dir: str) -> None:
    """An engine's verified steps reach the Prometheus counters (vLLM's names under
    ``tandem:``), the stats log line and the finished request's span attributes."""
    from prometheus_client import CollectorRegistry

    from engine_service.metrics import EngineMetrics, StatsLogger
    from engine_service.tracing import request_span_attributes

    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, engine_index=0)
    now = [0.0]
    log = StatsLogger(0, interval=1.0, clock=lambda: now[0])
    core = _engine(tiny_llama_dir, NGRAM)
    off = _engine(tiny_llama_dir)
    prompt = [9, 10, 11, 12] * 6
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _run(off, [prompt], [params])
    off.shutdown()
    _oracle(core, [prompt], want)
    core.add_request(EngineCoreRequest("m", prompt, params, eos_token_id=None))
    drafts = tokens = accepted = 0
    per_pos: Counter[int] = Counter()
    finished = []
    while core.has_unfinished_requests():
        outs = core.step()
        metrics.record(outs)
        log.record(outs)
        spec = outs.iteration_stats.spec_decoding
        if spec is not None:
            drafts += spec.num_drafts
            tokens += spec.num_draft_tokens
            accepted += spec.num_accepted_tokens
            per_pos.update({i: n for i, n in enumerate(spec.accepted_per_pos)})
        finished += outs.iteration_stats.finished
    core.shutdown()
    assert drafts > 0 and 0 < accepted < tokens

    def get(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert get("tandem:spec_decode_num_drafts_total") == drafts
    assert get("tandem:spec_decode_num_draft_tokens_total") == tokens
    assert get("tandem:spec_decode_num_accepted_tokens_total") == accepted
    assert get("tandem:spec_decode_num_accepted_tokens_per_pos_total", position="0") == per_pos[0]
    assert sum(per_pos.values()) == accepted
    now[0] += 2.0
    line = log.maybe_log() or ""
    assert f"spec decode: mean accepted length {1 + accepted / drafts:.2f}, acceptance rate " in line, line
    (request,) = finished
    attrs = request_span_attributes(request, "tiny", 0)
    assert attrs["tandem.spec_decode.num_accepted_tokens"] == accepted
    assert attrs["tandem.spec_decode.mean_accepted_length"] == pytest.approx(1 + accepted / drafts)


def test_engine_info_reports_the_speculative_config(tiny_llama_dir: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    import grpc

    from tandem.v1 import engine_pb2, engine_pb2_grpc
    from tests.e2e_helpers import ENGINE_ARGS, start_engine

    engine = start_engine(tiny_llama_dir, 0, tmp_path, (*ENGINE_ARGS, "--speculative-config", SUFFIX))
    try:
        engine.wait_serving()
        with grpc.insecure_channel(engine.address) as channel:
            info = engine_pb2_grpc.EngineCoreStub(channel).GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=30)
    finally:
        engine.stop(timeout=30)
    assert json.loads(info.speculative_config) == SpeculativeConfig("suffix", 4, draft_token_cost=0.001).to_dict()


def test_spec_decode_benchmark_runs(tiny_llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks.spec_decode, a few tokens on the tiny model (its own weights as the draft):
    a smoke run whose greedy outputs agree across configurations."""
    from benchmarks import spec_decode

    argv = ["--model", tiny_llama_dir, "--draft-model", tiny_llama_dir, "--configs", "off,ngram,draft",
            "--batch-sizes", "3", "--max-tokens", "6", "--repeats", "1"]
    assert spec_decode.main(argv) == 0
    out = capsys.readouterr().out
    for name in ("ngram", "draft"):
        assert f"{name} vs off, copy batch 1: 0/6 greedy outputs differ" in out
        assert f"{name} vs off, chat batch 3: 0/3 greedy outputs differ" in out
