"""The batched sampler against direct per-row computations on fresh random logits."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from engine_service.logits_processors import (
    apply_min_p,
    apply_penalties_,
    apply_top_k,
    apply_top_k_top_p,
)
from engine_service.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    argmax_suffices,
    compute_logprobs_tensors,
)
from tandem.protocol.sampling_params import SamplingParams

B, V = 8, 1000


def _logits(rows: int = B, vocab: int = V, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab) * scale  # [rows, vocab]


def _metadata(rows: int = B, **overrides: Any) -> SamplingMetadata:
    """Neutral metadata (all rows at temperature 1) with fields overridden."""
    fields: dict[str, Any] = dict(
        temperature=torch.ones(rows),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        min_p=None,
        seeds={},
        max_num_logprobs=None,
        presence_penalties=None,
        frequency_penalties=None,
        repetition_penalties=None,
        prompt_token_ids=[[] for _ in range(rows)],
        output_token_ids=[[] for _ in range(rows)],
        logit_bias=[None] * rows,
        allowed_token_ids=[None] * rows,
        min_tokens_block=[None] * rows,
    )
    fields.update(overrides)
    greedy = fields["temperature"] < 1e-5
    fields["all_greedy"] = bool(greedy.all())
    fields["all_random"] = not bool(greedy.any())
    return SamplingMetadata(**fields)


def _kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


# --- truncation masks ------------------------------------------------------------------


def test_top_k_keeps_exactly_the_top_k_set() -> None:
    logits = _logits()
    top_k = torch.tensor([random.randint(1, 50) for _ in range(B - 2)] + [V, 1])
    out = apply_top_k(logits, top_k)
    for row in range(B):
        k = int(top_k[row])
        expected = set(sorted(range(V), key=lambda t: -float(logits[row, t]))[:k])
        assert _kept(out)[row] == expected
        kept = sorted(expected)
        assert torch.equal(out[row, kept], logits[row, kept])


def _top_k_top_p_case(
    logits: torch.Tensor, knobs: list[tuple[int | None, int | None]]
) -> tuple[torch.Tensor, torch.Tensor, list[set[int]]]:
    """Per row (k, size): top-k k (None: off) and a top-p whose answer has ``size`` tokens
    (None: p = 1). p sits halfway between two cumulative masses, so rounding cannot flip it.
    """
    top_k: list[int] = []
    top_p: list[float] = []
    expected: list[set[int]] = []
    for row, (k, size) in enumerate(knobs):
        order = sorted(range(V), key=lambda t: -float(logits[row, t]))[: k or V]
        probs = logits[row, order].double().softmax(-1)  # renormalised over the top k
        cumulative = torch.cumsum(probs, 0).tolist()
        top_k.append(k or V)
        if size is None:
            top_p.append(1.0)
            expected.append(set(order))
        else:
            top_p.append((cumulative[size - 2] + cumulative[size - 1]) / 2)
            expected.append(set(order[:size]))
    return torch.tensor(top_k), torch.tensor(top_p), expected


@pytest.mark.parametrize("num_candidates", [16, 256, V])
def test_top_p_keeps_the_smallest_set_reaching_p(num_candidates: int) -> None:
    logits = _logits()
    knobs: list[tuple[int | None, int | None]] = [
        (None, random.randint(2, 60)) for _ in range(B - 1)
    ]
    knobs.append((None, None))
    _, top_p, expected = _top_k_top_p_case(logits, knobs)
    out = apply_top_k_top_p(logits, None, top_p, num_candidates=num_candidates)
    assert _kept(out) == expected
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])


@pytest.mark.parametrize("num_candidates", [8, 256, V])
def test_top_k_then_top_p_on_mixed_rows(num_candidates: int) -> None:
    logits = _logits(scale=0.5)  # flat: top-p on the whole vocab keeps hundreds
    knobs: list[tuple[int | None, int | None]] = [
        (40, 10),  # top-p mass measured on the top-40 distribution
        (40, None),  # top-k only
        (None, 30),  # top-p only
        (None, 300),  # top-p only, beyond the candidates
        (None, None),  # neither
        (1, None),
        (random.randint(2, 100), 2),
        (None, 2),
    ]
    top_k, top_p, expected = _top_k_top_p_case(logits, knobs)
    out = apply_top_k_top_p(logits, top_k, top_p, num_candidates=num_candidates)
    assert _kept(out) == expected
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])


def test_top_p_tiny_keeps_only_the_argmax() -> None:
    logits = _logits()
    out = apply_top_k_top_p(logits, None, torch.full((B,), 1e-6))
    assert _kept(out) == [{int(i)} for i in logits.argmax(-1)]


def test_min_p_keeps_tokens_above_fraction_of_max_prob() -> None:
    logits = _logits()
    min_p = torch.rand(B) * 0.3
    min_p[0] = 0.0
    out = apply_min_p(logits, min_p)
    probs = logits.double().softmax(-1)
    for row in range(B):
        bound = float(min_p[row]) * float(probs[row].max())
        # Tokens within float32 rounding of the bound may go either way: leave them out.
        clear = {t for t in range(V) if abs(float(probs[row, t]) - bound) > 1e-5 * bound}
        expected = {t for t in clear if float(probs[row, t]) >= bound}
        assert _kept(out)[row] & clear == expected
    assert _kept(out)[0] == set(range(V))


# --- greedy and top_k = 1 --------------------------------------------------------------


def test_top_k_1_equals_greedy() -> None:
    logits = _logits()
    sampler = Sampler()
    # Direct metadata: random rows at various temperatures with top_k = 1.
    md = _metadata(temperature=torch.rand(B) * 2 + 0.1, top_k=torch.ones(B, dtype=torch.long))
    assert torch.equal(sampler(logits, md).sampled_token_ids, logits.argmax(-1))
    # Built from requests: top_k = 1 rows behave as greedy rows.
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(B)]
    md = SamplingMetadata.from_requests(
        params, [[1]] * B, [[]] * B, list(range(B)), [None] * B, V, "cpu"
    )
    assert md.all_greedy and not md.seeds
    assert torch.equal(sampler(logits, md).sampled_token_ids, logits.argmax(-1))


def test_mixed_batch_greedy_rows_take_argmax_random_rows_stay_in_top_k() -> None:
    logits = _logits()
    temperature = torch.tensor([0.0, 1.0] * (B // 2))
    md = _metadata(temperature=temperature, top_k=torch.full((B,), 3))
    assert not md.all_greedy and not md.all_random
    top3 = logits.topk(3, dim=-1).indices
    for _ in range(5):
        sampled = Sampler()(logits, md).sampled_token_ids
        for row in range(B):
            if row % 2 == 0:
                assert int(sampled[row]) == int(logits[row].argmax())
            else:
                assert int(sampled[row]) in top3[row].tolist()


# --- masks, bias and penalties (applied before greedy) ---------------------------------


def test_logit_bias_moves_greedy_pick() -> None:
    logits = _logits()
    target = [random.randrange(V) for _ in range(B)]
    bias: list[dict[int, float] | None] = [{t: 100.0, (t + 1) % V: -0.5} for t in target]
    bias[0] = None
    md = _metadata(temperature=torch.zeros(B), logit_bias=bias)
    sampled = Sampler()(logits, md).sampled_token_ids.tolist()
    assert sampled[0] == int(logits[0].argmax())
    assert sampled[1:] == target[1:]


def test_allowed_token_ids_restrict_greedy_and_random_rows() -> None:
    logits = _logits()
    allowed: list[list[int] | None] = [random.sample(range(V), 5) for _ in range(B)]
    allowed[3] = None
    temperature = torch.tensor([0.0] * (B // 2) + [1.0] * (B // 2))
    md = _metadata(temperature=temperature, allowed_token_ids=allowed)
    for _ in range(5):
        sampled = Sampler()(logits, md).sampled_token_ids.tolist()
        for row in range(B):
            ids = allowed[row]
            if ids is None:
                assert sampled[row] == int(logits[row].argmax())
            elif row < B // 2:
                assert sampled[row] == max(ids, key=lambda t: float(logits[row, t]))
            else:
                assert sampled[row] in ids


def test_min_tokens_block_masks_eos_and_stop_tokens() -> None:
    logits = _logits()
    argmax = logits.argmax(-1).tolist()
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    block: list[set[int] | None] = [{argmax[r], (argmax[r] + 7) % V} for r in range(B)]
    block[2] = None
    md = _metadata(temperature=torch.zeros(B), min_tokens_block=block)
    sampled = Sampler()(logits, md).sampled_token_ids.tolist()
    for row in range(B):
        assert sampled[row] == (argmax[row] if row == 2 else second[row])


def test_from_requests_min_tokens_block() -> None:
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[5, 6]),
        SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(min_tokens=2),
        SamplingParams(),
    ]
    outputs = [[1, 2], [1], [1, 2], []]
    md = SamplingMetadata.from_requests(params, [[0]] * 4, outputs, [None] * 4, [9] * 4, V, "cpu")
    assert md.min_tokens_block == [{5, 6, 9}, {5}, None, None]


def _penalty_reference(
    logits: torch.Tensor,
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> torch.Tensor:
    expected = logits.clone()
    for row in range(logits.shape[0]):
        for token in set(prompts[row]) | set(outputs[row]):
            value = float(expected[row, token])
            penalty = repetition[row]
            expected[row, token] = value / penalty if value > 0 else value * penalty
        for token in set(outputs[row]):
            count = outputs[row].count(token)
            expected[row, token] -= frequency[row] * count + presence[row]
    return expected


def _random_histories() -> tuple[list[list[int]], list[list[int]]]:
    prompts = [[random.randrange(50) for _ in range(random.randint(1, 30))] for _ in range(B)]
    # Outputs repeat tokens so counts > 1 occur; drawn from a range that overlaps prompts.
    outputs = [[random.randrange(30, 80) for _ in range(random.randint(0, 40))] for _ in range(B)]
    return prompts, outputs


@pytest.mark.parametrize("which", ["presence", "frequency", "repetition", "all"])
def test_penalties_match_hand_computation(which: str) -> None:
    logits = _logits()
    prompts, outputs = _random_histories()
    presence = [0.0] * B
    frequency = [0.0] * B
    repetition = [1.0] * B
    for row in range(1, B):  # row 0 keeps neutral penalties
        if which in ("presence", "all"):
            presence[row] = random.uniform(-2, 2)
        if which in ("frequency", "all"):
            frequency[row] = random.uniform(-2, 2)
        if which in ("repetition", "all"):
            repetition[row] = random.uniform(0.5, 2.0)
    expected = _penalty_reference(logits, presence, frequency, repetition, prompts, outputs)
    out = logits.clone()
    apply_penalties_(
        out,
        torch.tensor(presence) if which in ("presence", "all") else None,
        torch.tensor(frequency) if which in ("frequency", "all") else None,
        torch.tensor(repetition) if which in ("repetition", "all") else None,
        prompts,
        outputs,
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0], logits[0])
    assert not torch.equal(out, logits)


def test_penalties_through_sampler_and_from_requests() -> None:
    logits = _logits()
    prompts, outputs = _random_histories()
    params = [
        SamplingParams(
            temperature=0.0,
            presence_penalty=random.uniform(-2, 2),
            frequency_penalty=random.uniform(-2, 2),
            repetition_penalty=random.uniform(0.5, 2.0),
        )
        for _ in range(B)
    ]
    md = SamplingMetadata.from_requests(params, prompts, outputs, [None] * B, [None] * B, V, "cpu")
    expected = _penalty_reference(
        logits,
        [p.presence_penalty for p in params],
        [p.frequency_penalty for p in params],
        [p.repetition_penalty for p in params],
        prompts,
        outputs,
    )
    sampled = Sampler()(logits, md).sampled_token_ids
    assert torch.equal(sampled, expected.argmax(-1))


def _random_params(rng: random.Random) -> SamplingParams:
    """Greedy-ish params with each knob that could change the pick switched on at random."""
    knobs: dict[str, Any] = {}
    if rng.random() < 0.3:
        knobs["temperature"] = rng.choice([0.7, 1.0])
        knobs["top_k"] = rng.choice([1, 1, 5])
    else:
        knobs["temperature"] = 0.0
    if rng.random() < 0.15:
        knobs["logprobs"] = rng.choice([0, 3])
    if rng.random() < 0.15:
        knobs["presence_penalty"] = 1.5
    if rng.random() < 0.15:
        knobs["repetition_penalty"] = 1.8
    if rng.random() < 0.15:
        knobs["logit_bias"] = {rng.randrange(V): 50.0}
    if rng.random() < 0.15:
        knobs["allowed_token_ids"] = rng.sample(range(V), 3)
    if rng.random() < 0.2:
        knobs["min_tokens"] = 4
        knobs["stop_token_ids"] = [rng.randrange(V)]
    return SamplingParams(**knobs)


def test_argmax_suffices_only_where_the_sampler_picks_the_raw_argmax() -> None:
    rng = random.Random(random.randrange(2**32))
    prompts, outputs = _random_histories()
    for _ in range(40):
        params = [_random_params(rng) for _ in range(B)]
        logits = _logits()
        # Each row's top token is a prompt token just above the runner-up, so a penalty,
        # a bias or a mask would move the pick.
        for row in range(B):
            logits[row, prompts[row][0]] = logits[row].max() + 0.01
        eos = [rng.randrange(V) for _ in range(B)]
        md = SamplingMetadata.from_requests(params, prompts, outputs, [None] * B, eos, V, "cpu")
        sampled = Sampler()(logits, md).sampled_token_ids
        argmax = logits.argmax(-1)
        for row, p in enumerate(params):
            if argmax_suffices(p, len(outputs[row]), eos[row]):
                assert sampled[row] == argmax[row], p
    # Every knob that edits a greedy row's logits, or asks for logprobs, turns it off.
    assert argmax_suffices(SamplingParams(temperature=0.0), 0, 7)
    assert argmax_suffices(SamplingParams(temperature=1.0, top_k=1), 0, 7)
    assert argmax_suffices(SamplingParams(temperature=0.0, min_tokens=2), 2, 7)
    assert argmax_suffices(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), 0, 7)
    for knob in (
        dict(temperature=1.0),
        dict(logprobs=0),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=-0.5),
        dict(repetition_penalty=1.1),
        dict(logit_bias={3: 1.0}),
        dict(allowed_token_ids=[1, 2]),
        dict(min_tokens=2),
    ):
        p = SamplingParams(**{"temperature": 0.0, **knob})
        assert not argmax_suffices(p, 1, 7), knob


# --- seeded rows -----------------------------------------------------------------------


def test_seeded_row_same_tokens_alone_and_in_batch() -> None:
    seed = random.randrange(2**63)
    row, other_row, batch = 5, 9, 16
    row_logits = _logits(1, scale=0.3)  # flat: the sample is far from the argmax
    alone_tokens: list[int] = []
    batch_tokens: list[int] = []
    other_tokens: list[int] = []
    for position in range(6):
        md = _metadata(1, seeds={0: (seed, position)})
        alone_tokens.append(int(Sampler()(row_logits, md).sampled_token_ids[0]))

        logits = _logits(batch, scale=0.3)
        logits[row] = row_logits[0]
        logits[other_row] = row_logits[0]
        temperature = torch.rand(batch) + 0.5
        temperature[row] = temperature[other_row] = 1.0
        temperature[0] = 0.0  # a greedy row in the batch
        md = _metadata(
            batch,
            temperature=temperature,
            seeds={row: (seed, position), other_row: (seed + 1, position), 0: (seed + 2, position)},
        )
        sampled = Sampler()(logits, md).sampled_token_ids
        batch_tokens.append(int(sampled[row]))
        other_tokens.append(int(sampled[other_row]))
    assert alone_tokens == batch_tokens
    # The stream moves on with the position: the same logits give different tokens.
    assert len(set(alone_tokens)) > 1
    assert other_tokens != alone_tokens


def test_seeded_draw_depends_on_seed_and_position_only() -> None:
    """A seeded row's token at output position p is the same whatever came before: the
    draws of positions 0..p-1 (or none of them: a request continued at p) change nothing."""
    seed = random.randrange(2**63)
    logits = _logits(1, scale=0.3)
    sampler = Sampler()
    in_order = [
        int(sampler(logits, _metadata(1, seeds={0: (seed, p)})).sampled_token_ids[0]) for p in range(8)
    ]
    for p in random.sample(range(8), 8):  # any order, each position alone
        assert int(sampler(logits, _metadata(1, seeds={0: (seed, p)})).sampled_token_ids[0]) == in_order[p]


def test_native_seeded_uniform_matches_reference() -> None:
    from kernels import cpu_ops, reference

    if not cpu_ops.native_available():
        pytest.skip("the native CPU kernels could not be built here (see the log)")
    rows = random.randrange(1, 5)
    vocab = random.choice([1, 7, 4096, 4097, 50_000])
    seeds = [random.randrange(-(2**63), 2**64) for _ in range(rows)]
    positions = [random.randrange(0, 10**6) for _ in range(rows)]
    native = cpu_ops.seeded_uniform(seeds, positions, vocab)
    expected = reference.seeded_uniform(seeds, positions, vocab)
    assert torch.equal(native, expected)
    assert float(expected.min()) > 0.0 and float(expected.max()) < 1.0


def test_seeded_uniform_is_splitmix64() -> None:
    """Element v of (seed, p) is SplitMix64's output number p*V + v from ``seed``."""
    from kernels.reference import seeded_uniform

    mask = (1 << 64) - 1

    def splitmix64(seed: int, n: int) -> int:
        z = (seed + (n + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    seed, position, vocab = random.randrange(2**64), random.randrange(1000), 37
    row = seeded_uniform([seed], [position], vocab)[0].tolist()
    assert row == [((splitmix64(seed, position * vocab + v) >> 41) + 0.5) * 2**-23 for v in range(vocab)]


def test_from_requests_keeps_seeds_of_random_rows_only() -> None:
    params = [SamplingParams(seed=1), SamplingParams(), SamplingParams(temperature=0.0, seed=2)]
    outputs = [[4, 5], [], []]
    md = SamplingMetadata.from_requests(params, [[0]] * 3, outputs, [1, None, 2], [None] * 3, V, "cpu")
    assert md.seeds == {0: (1, 2)}  # position: the output tokens so far
    assert not md.all_greedy and not md.all_random
    assert md.top_p is None and md.top_k is None and md.min_p is None
    assert md.presence_penalties is None and md.max_num_logprobs is None
    assert md.temperature.tolist() == [1.0, 1.0, 0.0]


def test_from_requests_truncation_tensors() -> None:
    params = [
        SamplingParams(top_k=20, top_p=0.9, min_p=0.1, logprobs=2),
        SamplingParams(top_k=-1, logprobs=5),
        SamplingParams(top_k=V + 10),
    ]
    md = SamplingMetadata.from_requests(
        params, [[0]] * 3, [[]] * 3, [None] * 3, [None] * 3, V, "cpu"
    )
    assert md.top_k is not None and md.top_k.tolist() == [20, V, V]
    assert md.top_p is not None and md.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert md.min_p is not None and md.min_p.tolist() == pytest.approx([0.1, 0.0, 0.0])
    assert md.max_num_logprobs == 5


# --- logprobs --------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = _logits()
    prompts, outputs = _random_histories()
    k = 5
    md = _metadata(
        max_num_logprobs=k,
        presence_penalties=torch.full((B,), 1.5),
        repetition_penalties=torch.full((B,), 1.3),
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        logit_bias=[{0: 5.0}] * B,
    )
    out = Sampler()(logits, md)
    lp = out.logprobs
    assert lp is not None
    reference = logits.double().log_softmax(-1)  # [B, V], before bias and penalties
    sampled = out.sampled_token_ids
    assert lp.token_ids.shape == (B, k + 1) and lp.logprobs.shape == (B, k + 1)
    assert torch.equal(lp.token_ids[:, 0], sampled)
    for row in range(B):
        order = sorted(range(V), key=lambda t: -float(reference[row, t]))
        assert lp.token_ids[row, 1:].tolist() == order[:k]
        ids = lp.token_ids[row].tolist()
        torch.testing.assert_close(
            lp.logprobs[row].double(), reference[row, ids], rtol=0, atol=1e-4
        )
        assert int(lp.ranks[row]) == order.index(int(sampled[row])) + 1


def test_compute_logprobs_tensors_for_given_tokens_and_slicing() -> None:
    logprobs = _logits(6, 50).log_softmax(-1)
    tokens = torch.randint(0, 50, (6,))
    lt = compute_logprobs_tensors(logprobs, 4, tokens)
    assert isinstance(lt, LogprobsTensors)
    expected_ranks = [1 + int((logprobs[r] > logprobs[r, tokens[r]]).sum()) for r in range(6)]
    assert lt.ranks.tolist() == expected_ranks
    sliced = lt.to_logprobs(rows=[1, 4], num_logprobs=2)
    assert sliced.ranks == [expected_ranks[1], expected_ranks[4]]
    assert [len(ids) for ids in sliced.token_ids] == [3, 3]
    assert sliced.token_ids[1][0] == int(tokens[4])
    assert sliced.logprobs[0] == pytest.approx(lt.logprobs[1, :3].tolist())
    assert len(lt.to_logprobs(rows=slice(2, 5), num_logprobs=0)) == 3
    assert compute_logprobs_tensors(logprobs, 0, tokens).token_ids.shape == (6, 1)


# --- statistics and validation ---------------------------------------------------------


def test_sampled_frequencies_follow_probabilities() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    rows = 20000
    logits = (probs.log() * 0.5).expand(rows, -1).contiguous()  # temperature 0.5 undoes * 0.5
    md = _metadata(rows, temperature=torch.full((rows,), 0.5))
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        sampled = Sampler()(logits, md).sampled_token_ids
    freq = torch.bincount(sampled, minlength=5).double() / rows
    # Binomial sd <= 0.0036; 0.02 is > 5 sd.
    assert torch.allclose(freq, probs.double(), atol=0.02)
    assert math.isclose(float(freq.sum()), 1.0)


def test_sampler_rejects_mismatched_logits() -> None:
    with pytest.raises(ValueError):
        Sampler()(_logits(B + 1), _metadata())
    with pytest.raises(ValueError):
        Sampler()(torch.randn(V), _metadata())
    with pytest.raises(ValueError):
        _metadata(logit_bias=[None])
