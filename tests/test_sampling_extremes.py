"""Extreme but finite sampling values (issue 36): each request is either refused with
InvalidRequestError naming the field (INVALID_ARGUMENT) or runs to completion, alone and
with every structured-output kind, seeded and not. Never an ERROR finish.

A fuzz of ``tandem serve`` found repetition_penalty=1e-300 or temperature=1e300 with a
structured-output constraint ending INTERNAL: in float32 the penalty is 0 and the
temperature inf, so a masked (-inf) logit became NaN (-inf * 0, -inf / inf), the whole row
NaN, and the sampler picked token 0, outside the constraint.

One engine for the module, driven in-process through the frontend's InputProcessor (the
validation a gRPC request gets) and the EngineCore; requests of a case run as one batch.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.logits_processors import MAX_LOGIT
from engine_service.sampler import Sampler, SamplingMetadata
from frontend_service.input_processor import InputProcessor
from tandem.protocol.convert import sampling_params_from_proto, sampling_params_to_proto
from tandem.protocol.outputs import EngineCoreOutput, ErrorCode, FinishReason
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams, int64_seed
from tandem.protocol.structured_output import KINDS
from tandem.protocol.structured_output import StructuredOutputsParams as SO

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 40
MAX_NUM_SEQS = 8
MAX_LOGPROBS = 5
F32_MAX = float(torch.finfo(torch.float32).max)
HUGE = sys.float_info.max
TINY = 5e-324  # the smallest positive double (a float32 0)

# One constraint of every kind (each short: a few tokens complete it).
CONSTRAINTS: dict[str, SO] = {
    "json": SO(
        json=json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            }
        ),
        disable_any_whitespace=True,
    ),
    "regex": SO(regex="[a-z]{2,6}"),
    "choice": SO(choice=["yes", "no"]),
    "grammar": SO(grammar='root ::= "(" [0-9]{1,3} ")"'),
    "json_object": SO(json_object=True),
    "structural_tag": SO(
        structural_tag=json.dumps(
            {
                "type": "structural_tag",
                "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
                "triggers": ["<f"],
            }
        )
    ),
}
assert set(CONSTRAINTS) == set(KINDS)

# Extreme values of every numeric field of SamplingParams (``eos`` stands for the EOS
# token id, filled in per engine). Values outside a field's documented range are here
# too: they must be refused naming the field.
EXTREMES: dict[str, list[Any]] = {
    "n": [1, 2, MAX_NUM_SEQS, MAX_NUM_SEQS + 1, 2**31, 2**64],
    "temperature": [
        0.0,
        TINY,
        1e-300,
        1e-5,
        1.0000001e-5,
        1e-3,
        1e10,
        1e38,
        F32_MAX,
        1e39,
        1e300,
        HUGE,
    ],
    "top_p": [TINY, 1e-300, 1e-45, 1e-38, 0.5, 1.0 - 1e-16, 1.0],
    "top_k": [-1, 1, 2, 1023, 1024, 1025, 2**31, 2**63 - 1, 2**64],
    "min_p": [0.0, TINY, 1e-300, 1e-38, 0.999999, 1.0],
    "seed": [-(2**63), -1, 0, 1, 2**63 - 1, 2**63, 2**64 - 1],
    "presence_penalty": [-2.0, -TINY, TINY, 2.0],
    "frequency_penalty": [-2.0, -TINY, TINY, 2.0],
    "repetition_penalty": [
        TINY,
        1e-300,
        1e-45,
        1e-38,
        1e-30,
        1e-5,
        0.5,
        2.0,
        1e30,
        1e38,
        F32_MAX,
        1e300,
        HUGE,
    ],
    "logit_bias": ["huge", "-huge", "f32max", "tiny", "eos:huge", "eos:-huge"],
    "allowed_token_ids": [[0], ["eos"], [5, 6, 7], list(range(1024))],
    "max_tokens": [1, 2, MAX_MODEL_LEN, 2**31, 2**63 - 1],
    "min_tokens": [0, 1, 8, MAX_MODEL_LEN, 2**31, 2**63 - 1],
    "stop_token_ids": [[0], ["eos"], [5, 6, 7]],
    "logprobs": [0, 1, MAX_LOGPROBS, MAX_LOGPROBS + 1, 2**63 - 1],
    "prompt_logprobs": [0, 1, MAX_LOGPROBS, MAX_LOGPROBS + 1, 2**63 - 1],
}
# The values above past a field's documented range (every other one must run).
OUT_OF_RANGE: dict[str, set[Any]] = {
    "n": {MAX_NUM_SEQS + 1, 2**31, 2**64},  # n <= the engines' max_num_seqs
    "max_tokens": {MAX_MODEL_LEN, 2**31, 2**63 - 1},  # within the room the prompt leaves
    "min_tokens": {MAX_MODEL_LEN, 2**31, 2**63 - 1},
    "logprobs": {MAX_LOGPROBS + 1, 2**63 - 1},  # <= the engine's max_logprobs
    "prompt_logprobs": {MAX_LOGPROBS + 1, 2**63 - 1},
}
# The fields that hold no number (or only a structure checked elsewhere).
NON_NUMERIC = {
    "stop",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "detokenize",
    "output_kind",
    "structured_outputs",
    "speculative",
}


@dataclass
class Env:
    core: EngineCore
    processor: InputProcessor
    eos: int
    vocab_size: int
    counter: int = 0


@pytest.fixture(scope="module")
def env(tiny_llama_dir: str) -> Iterator[Env]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    core = EngineCore(
        EngineConfig(
            model=tiny_llama_dir,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=MAX_NUM_SEQS,
            max_logprobs=MAX_LOGPROBS,
        )
    )
    mc = core.model_config
    processor = InputProcessor(
        tokenizer,
        core.max_model_len,
        mc.vocab_size,
        core.config.max_logprobs,
        tokenizer.eos_token_id,
        mc.eos_token_ids,
        max_num_seqs=core.config.max_num_seqs,
    )
    yield Env(core, processor, tokenizer.eos_token_id, mc.vocab_size)
    core.shutdown()


def _value(env: Env, field: str, value: Any) -> Any:
    """Placeholders of EXTREMES made concrete for this engine."""
    if field in ("allowed_token_ids", "stop_token_ids"):
        return [env.eos if t == "eos" else t for t in value]
    if field == "logit_bias":
        token, _, size = value.rpartition(":")
        bias = {"huge": HUGE, "-huge": -HUGE, "f32max": F32_MAX, "tiny": TINY}[size]
        if token == "eos":
            return {env.eos: bias}
        return {t: bias for t in (5, 6, 7, env.eos)}
    return value


def _params(env: Env, **fields: Any) -> SamplingParams:
    fields = {k: _value(env, k, v) for k, v in fields.items()}
    fields.setdefault("max_tokens", 8)
    return SamplingParams(**fields)


def _run_batch(env: Env, cases: list[SamplingParams], prompt: str = "a") -> list[Any]:
    """Submit every case, run the engine until idle; per case: the InvalidRequestError
    that refused it, or its children's final outputs."""
    core = env.core
    results: list[Any] = []
    for params in cases:
        env.counter += 1
        try:
            processed = env.processor.process(f"r{env.counter}", params, prompt=prompt)
            added: list[str] = []
            try:
                for req in processed.engine_requests:
                    core.add_request(req)
                    added.append(req.request_id)
            except InvalidRequestError:
                core.abort_requests(added)
                raise
        except InvalidRequestError as exc:
            results.append(exc)
            continue
        results.append([r.request_id for r in processed.engine_requests])
    finals: dict[str, EngineCoreOutput] = {}
    for _ in range(10_000):
        if not core.has_unfinished_requests():
            break
        for out in core.step().all_outputs():
            if out.finish_reason is not None:
                finals[out.request_id] = out
    else:
        raise AssertionError("the engine did not finish")
    aborts = core.take_ended_outputs()
    if aborts is not None:
        for out in aborts.all_outputs():
            finals.setdefault(out.request_id, out)
    return [
        r if isinstance(r, InvalidRequestError) else [finals[rid] for rid in r] for r in results
    ]


def _check(params: SamplingParams, result: Any) -> str:
    """Refused naming a field of the request, or every child ran to STOP / LENGTH."""
    if isinstance(result, InvalidRequestError):
        assert result.field.split(".")[0].split("[")[0] in {
            f.name for f in dataclasses.fields(params)
        }, result
        return "refused"
    for out in result:
        assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (
            params,
            out.finish_reason,
            out.error,
        )
    return "ran"


def test_extremes_cover_every_numeric_field() -> None:
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields == set(EXTREMES) | NON_NUMERIC


# ---- the issue's reproductions -------------------------------------------------------


def test_issue_repro_runs(env: Env) -> None:
    """prompt "a", repetition_penalty=1e-300, max_tokens=8, json_object: ended INTERNAL."""
    params = SamplingParams(
        repetition_penalty=1e-300, max_tokens=8, structured_outputs=SO(json_object=True)
    )
    (result,) = _run_batch(env, [params])
    assert _check(params, result) == "ran"


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_huge_temperature_with_each_kind_runs(env: Env, kind: str) -> None:
    cases = [
        SamplingParams(temperature=t, seed=seed, max_tokens=8, structured_outputs=CONSTRAINTS[kind])
        for t in (1e300, HUGE)
        for seed in (None, 7)
    ]
    for params, result in zip(cases, _run_batch(env, cases), strict=True):
        assert _check(params, result) == "ran"


# ---- every field's extremes, alone and with each constraint --------------------------


@pytest.mark.parametrize("kind", [None, *CONSTRAINTS])
def test_each_extreme_alone(env: Env, kind: str | None) -> None:
    so = None if kind is None else CONSTRAINTS[kind]
    cases, expected = [], []
    for field, values in EXTREMES.items():
        for value in values:
            for seed in (None, 3):
                fields: dict[str, Any] = {field: value, "structured_outputs": so}
                if field != "seed":
                    fields["seed"] = seed
                elif seed is None:
                    continue
                if field == "min_tokens":
                    fields["max_tokens"] = None  # the room the prompt leaves
                cases.append(_params(env, **fields))
                refused = value in OUT_OF_RANGE.get(field, ())
                expected.append((field, value, "refused" if refused else "ran"))
    results = _run_batch(env, cases)
    outcomes = [
        (f, v, _check(p, r)) for (f, v, _), p, r in zip(expected, cases, results, strict=True)
    ]
    assert outcomes == expected
    for (field, _, outcome), result in zip(expected, results, strict=True):
        if outcome == "refused":
            assert result.field == field, result


# ---- combinations (hypothesis) -------------------------------------------------------


@st.composite
def _combined(draw: st.DrawFn) -> dict[str, Any]:
    """A few extreme fields at once, a constraint kind or none, seeded or not."""
    names = draw(st.sets(st.sampled_from(sorted(EXTREMES)), min_size=1, max_size=5))
    fields = {name: draw(st.sampled_from(EXTREMES[name])) for name in sorted(names)}
    kind = draw(st.sampled_from([None, *CONSTRAINTS]))
    fields["structured_outputs"] = None if kind is None else CONSTRAINTS[kind]
    if "seed" not in fields:
        fields["seed"] = draw(st.sampled_from([None, 11]))
    fields.setdefault("max_tokens", draw(st.sampled_from([1, 4, 8])))
    fields["ignore_eos"] = draw(st.booleans())
    return fields


@settings(
    max_examples=50,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(_combined(), min_size=4, max_size=4))
def test_combined_extremes_run_or_are_refused(env: Env, batch: list[dict[str, Any]]) -> None:
    cases = [_params(env, **fields) for fields in batch]
    for params, result in zip(cases, _run_batch(env, cases), strict=True):
        _check(params, result)


# ---- the sampler itself --------------------------------------------------------------


def _masked_logits(rows: int, vocab: int, allowed: list[int]) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    mask = torch.ones(vocab, dtype=torch.bool)
    mask[allowed] = False
    return logits.masked_fill(mask, float("-inf"))  # as the structured-output mask leaves them


@pytest.mark.parametrize(
    ("knobs", "allowed"),
    [
        (dict(temperature=1e300), [1, 20, 30]),
        (dict(temperature=HUGE, seed=5), [1, 20, 30]),
        (dict(repetition_penalty=1e-300), [1, 20, 30]),
        (dict(repetition_penalty=1e-300, temperature=0.0), [1, 20, 30]),
        (dict(repetition_penalty=1e300, temperature=1e-5), [1, 20, 30]),
        (dict(logit_bias={1: HUGE, 2: -HUGE}), [1, 20, 30]),
        (
            dict(logit_bias={1: HUGE}, repetition_penalty=TINY, temperature=1.0000001e-5),
            [1, 20, 30],
        ),
        (dict(top_p=TINY, min_p=1.0, top_k=2**40, temperature=1e300), [1, 20, 30]),
        # The constraint allows none of allowed_token_ids: the constraint wins.
        (dict(allowed_token_ids=[1, 2]), [20, 30]),
        # The constraint allows only stop tokens, min_tokens blocks them: they stay.
        (dict(min_tokens=4, stop_token_ids=[20, 30], temperature=0.0), [20, 30]),
        (dict(min_tokens=4, stop_token_ids=[20, 30], logit_bias={20: -HUGE}), [20, 30]),
    ],
)
def test_sampler_keeps_a_constrained_token(knobs: dict[str, Any], allowed: list[int]) -> None:
    """Whatever the knobs, every row samples one of the tokens its mask allows, and
    processed logits hold only -inf (masked) or finite values within MAX_LOGIT."""
    rows, vocab = 4, 64
    logits = _masked_logits(rows, vocab, allowed)
    params = [SamplingParams(**knobs)] * rows
    prompts = [[20, 30, 1], [1], [20], [5]]
    outputs = [[30, 30], [], [1, 20], [7]]
    seeds = [p.seed for p in params]
    md = SamplingMetadata.from_requests(params, prompts, outputs, seeds, [20] * rows, vocab, "cpu")
    processed = Sampler._process(logits.clone(), md)
    assert not processed.isnan().any() and not (processed == float("inf")).any()
    assert (processed > float("-inf")).any(dim=-1).all()
    assert processed[processed > float("-inf")].abs().max() <= MAX_LOGIT
    for _ in range(3):
        sampled = Sampler()(logits.clone(), md).sampled_token_ids.tolist()
        assert all(t in allowed for t in sampled), (sampled, allowed)


def test_normal_values_unchanged_by_the_saturation() -> None:
    """The clamps touch only values past float32's reach: ordinary penalties and biases
    give the same logits bit for bit as the plain formulas."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 4
    params = [
        SamplingParams(
            temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={3: 7.5}
        ),
        SamplingParams(temperature=0.0, repetition_penalty=0.7, frequency_penalty=-1.0),
        SamplingParams(temperature=0.0),
    ]
    prompts, outputs = [[3, 4, 5], [6, 7], [1]], [[3, 3, 9], [7], []]
    md = SamplingMetadata.from_requests(params, prompts, outputs, [None] * 3, [None] * 3, 50, "cpu")
    got = Sampler._process(logits.clone(), md)
    expected = logits.clone()
    expected[0, 3] += 7.5
    for row, p in enumerate(params):
        seen = set(prompts[row]) | set(outputs[row])
        for t in seen:
            v = expected[row, t]
            rep = torch.tensor(p.repetition_penalty, dtype=torch.float32)
            v = v / rep if v > 0 else v * rep
            count = outputs[row].count(t)
            v = (
                v
                - torch.tensor(p.frequency_penalty) * count
                - torch.tensor(p.presence_penalty) * (count > 0)
            )
            expected[row, t] = v
    assert torch.equal(got, expected)


# ---- seeds over the wire -------------------------------------------------------------


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1, 2**63, 2**64 - 1])
def test_every_accepted_seed_crosses_the_wire_as_the_same_stream(seed: int) -> None:
    params = SamplingParams(seed=seed)
    params.validate()
    back = sampling_params_from_proto(sampling_params_to_proto(params))
    assert back.seed == int64_seed(seed) and (back.seed - seed) % 2**64 == 0
    assert -(2**63) <= back.seed < 2**63


def test_child_seeds_of_the_largest_seed_stay_on_the_wire(env: Env) -> None:
    """n children get seed + i: past int64 they wrap (the same stream mod 2**64)."""
    processed = env.processor.process(
        "wrap", SamplingParams(seed=2**63 - 1, n=3, max_tokens=2), prompt="a"
    )
    seeds = [r.sampling_params.seed for r in processed.engine_requests]
    assert seeds == [2**63 - 1, -(2**63), -(2**63) + 1]
    for req in processed.engine_requests:
        sampling_params_to_proto(req.sampling_params)  # fits the int64 field


def test_an_engine_error_names_its_code(env: Env) -> None:
    """A request the engine refuses after queueing (a constraint that does not compile)
    ends ERROR with INVALID_ARGUMENT and the field, never a bare ERROR."""
    params = SamplingParams(max_tokens=4, structured_outputs=SO(regex="(unclosed"))
    ((out,),) = _run_batch(env, [params])
    assert out.finish_reason == FinishReason.ERROR
    assert out.error is not None and out.error.code == ErrorCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in out.error.message
