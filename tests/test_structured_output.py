"""Structured output: constraints are validated, compiled off the step, enforced by the
token mask, and hold under chunked prefill, preemption, prefix caching, n>1, seeds and
logprobs. The test models have random weights, so their free output is noise: whatever
a constrained request emits comes from the mask.
"""

from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.structured_output import Advance, StructuredRequest
from engine_service.structured_output.backend import compile_matcher, load_tokenizer
from kernels import reference
from tandem.protocol.convert import sampling_params_from_proto, sampling_params_to_proto
from tandem.protocol.outputs import EngineCoreRequest, ErrorCode, FinishReason
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams
from tandem.protocol.structured_output import StructuredOutputsParams as SO

SCHEMAS: list[dict] = [
    {  # object, required fields, bounded number
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # array of enums
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 4,
    },
    {  # nested object, number with bounds, enum
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 1000},
            "pos": {
                "type": "object",
                "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}},
                "required": ["x"],
                "additionalProperties": False,
            },
            "kind": {"enum": ["a", "b"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "pos", "kind", "ok"],
        "additionalProperties": False,
    },
]
# [0-9], not \d: the regex engine's \d is Unicode's digit class, which may be newer than
# Python's unicodedata.
REGEXES = [r"[a-z]{2,6}-[0-9]{2,3}", r"(yes|no), because [a-z]{1,8}\.", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"]
CHOICES = [["alpha", "beta", "gamma"], ["yes", "no"]]


def _constraints() -> list[tuple[SO, object]]:
    """(constraint, checker) pairs; the checker raises on a non-matching text."""
    pairs: list[tuple[SO, object]] = []
    for schema in SCHEMAS:
        pairs.append((
            SO(json=json.dumps(schema), disable_any_whitespace=True),
            lambda text, s=schema: jsonschema.validate(json.loads(text), s),
        ))
    for pattern in REGEXES:
        pairs.append((SO(regex=pattern), lambda text, p=pattern: _fullmatch(p, text)))
    for choice in CHOICES:
        pairs.append((SO(choice=choice), lambda text, c=choice: _is_in(text, c)))
    pairs.append((
        SO(grammar='root ::= "(" [0-9]{1,4} ("," [0-9]{1,4})* ")"'),
        lambda text: _fullmatch(r"\(\d{1,4}(,\d{1,4})*\)", text),
    ))
    pairs.append((SO(json_object=True), lambda text: _is_object(json.loads(text))))
    return pairs


def _fullmatch(pattern: str, text: str) -> None:
    if re.fullmatch(pattern, text) is None:
        raise AssertionError(f"{text!r} does not match {pattern!r}")


def _is_in(text: str, choices: list[str]) -> None:
    if text not in choices:
        raise AssertionError(f"{text!r} is not one of {choices}")


def _is_object(value: object) -> None:
    if not isinstance(value, dict):
        raise AssertionError(f"{value!r} is not a JSON object")


# ---- the contract ----------------------------------------------------------------


def test_params_validation_names_the_field() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        SamplingParams(structured_outputs=SO(regex="a", choice=["a"])).validate()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        SamplingParams(structured_outputs=SO()).validate()
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_outputs=SO(json="{not json")).validate()
    assert err.value.field == "structured_outputs.json"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_outputs=SO(choice=["a", ""])).validate()
    assert err.value.field == "structured_outputs.choice"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_outputs=SO(json="[1, 2]")).validate()
    assert err.value.field == "structured_outputs.json"


@pytest.mark.parametrize("so", [c for c, _ in _constraints()] + [SO(structural_tag='{"x": 1}')])
def test_proto_round_trip(so: SO) -> None:
    sp = SamplingParams(structured_outputs=so)
    back = sampling_params_from_proto(sampling_params_to_proto(sp)).structured_outputs
    assert back is not None
    assert back.key == so.key


def test_unconstrained_params_stay_unset_on_the_wire() -> None:
    msg = sampling_params_to_proto(SamplingParams())
    assert not msg.HasField("structured_outputs")
    assert sampling_params_from_proto(msg).structured_outputs is None


# ---- the mask kernel ----------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 1024])
def test_bitmask_reference_matches_a_bit_by_bit_loop(vocab: int, rng: random.Random) -> None:
    batch, k = 5, 3
    words = (vocab + 31) // 32
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(batch, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (k, words), dtype=torch.int32, generator=gen)
    rows = torch.randperm(batch, generator=gen)[:k]
    expected = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    got = logits.clone()
    reference.apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, expected)


def test_native_bitmask_matches_reference(rng: random.Random) -> None:
    from kernels import cpu_ops

    if not cpu_ops.native_available():
        pytest.skip("native CPU kernels did not build (no compiler?)")
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for vocab in (7, 32, 1000, 49152):
        words = (vocab + 31) // 32
        batch = 9
        logits = torch.randn(batch, vocab, generator=gen)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32, generator=gen)
        bitmask[0] = -1  # all allowed
        bitmask[1] = 0  # none allowed
        rows = torch.tensor([8, 0, 3, 5])
        want, got = logits.clone(), logits.clone()
        reference.apply_token_bitmask(want, bitmask, rows)
        cpu_ops.apply_token_bitmask(got, bitmask, rows)
        assert torch.equal(got, want), vocab
    with pytest.raises(RuntimeError, match="outside the logits"):
        cpu_ops.apply_token_bitmask(torch.zeros(2, 32), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2]))


# ---- the matcher ----------------------------------------------------------------


def test_matcher_rebuilds_when_out_of_step(tiny_llama_dir: str) -> None:
    tok = load_tokenizer(tiny_llama_dir, 1024)
    so = SO(regex=r"[a-z]{3}-\d{2}")
    state = StructuredRequest(so)
    state.start(compile_matcher(tok, so))
    ids = tok.tokenize_str("abc-")
    for t in ids:
        assert state.advance(t) is Advance.CONTINUE
    before = bytes(state.matcher.compute_bitmask())
    state.num_consumed = 0  # as if the matcher had lost its state
    state.sync(ids)
    assert state.num_consumed == len(ids)
    assert bytes(state.matcher.compute_bitmask()) == before
    assert state.advance(tok.tokenize_str("x")[0]) is Advance.REJECTED


def test_structural_tag_and_gbnf_compile(tiny_llama_dir: str) -> None:
    tok = load_tokenizer(tiny_llama_dir, 1024)
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f=add>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}, "end": "</f>"}],
        "triggers": ["<f="],
    }
    matcher = compile_matcher(tok, SO(structural_tag=json.dumps(tag)))
    assert matcher.consume_tokens(tok.tokenize_str('hi <f=add>{"a": 1}</f>'))
    with pytest.raises(InvalidRequestError) as err:
        compile_matcher(tok, SO(structural_tag=json.dumps({**tag, "triggers": ["<g="]})))
    assert err.value.field == "structured_outputs.structural_tag"
    matcher = compile_matcher(tok, SO(grammar='root ::= "a" [0-9]+'))
    assert matcher.consume_tokens(tok.tokenize_str("a42")) and matcher.is_accepting()


def test_compile_error_names_the_field(tiny_llama_dir: str) -> None:
    tok = load_tokenizer(tiny_llama_dir, 1024)
    for so, field in [
        (SO(regex="(unclosed"), "structured_outputs.regex"),
        (SO(grammar="root ::= ("), "structured_outputs.grammar"),
        (SO(json='{"type": "no-such-type"}'), "structured_outputs.json"),
    ]:
        with pytest.raises(InvalidRequestError) as err:
            compile_matcher(tok, so)
        assert err.value.field == field


# ---- the engine ----------------------------------------------------------------

SETUPS = {
    "fits": dict(max_num_batched_tokens=2048, enable_prefix_caching=False),
    "chunked": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    "preempt": dict(max_num_batched_tokens=512, num_gpu_blocks_override=24, enable_prefix_caching=False),
    "prefix": dict(max_num_batched_tokens=512, enable_prefix_caching=True),
}


def _core(model: str, **kwargs: object) -> EngineCore:
    return EngineCore(EngineConfig(model=model, max_model_len=256, max_num_seqs=16, max_logprobs=5, **kwargs))


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> tuple[dict, dict, int]:
    """Drive to completion: tokens, final outputs and preemptions seen."""
    for req in requests:
        core.add_request(req)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    final: dict = {}
    preemptions = 0
    deadline = time.monotonic() + 120
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish"
        outs = core.step()
        preemptions += outs.scheduler_stats.num_preemptions
        for o in outs.all_outputs():
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                final[o.request_id] = o
    core.kv_manager.pool.check_all_free()
    return tokens, final, preemptions


def _decode(tokenizer: object, ids: list[int], eos: int) -> str:
    if ids and ids[-1] == eos:
        ids = ids[:-1]
    return tokenizer.decode(ids)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir: str) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_every_finished_output_matches_its_constraint(tiny_llama_dir: str, hf_tokenizer: object) -> None:
    core = _core(tiny_llama_dir)
    eos = hf_tokenizer.eos_token_id  # type: ignore[attr-defined]
    rng = random.Random(0)
    requests, checkers = [], {}
    for i, (so, check) in enumerate(_constraints()):
        for j in range(4):  # greedy and seeded sampling, different prompts
            prompt = [rng.randrange(5, 1024) for _ in range(rng.randint(3, 40))]
            params = SamplingParams(
                max_tokens=96,
                temperature=0.0 if j < 2 else 1.0,
                seed=None if j < 2 else 100 + j,
                structured_outputs=so,
            )
            rid = f"c{i}-{j}"
            requests.append(EngineCoreRequest(rid, prompt, params, eos_token_id=eos))
            checkers[rid] = check
    tokens, final, _ = _run(core, requests)
    stopped = 0
    for rid, out in final.items():
        assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (rid, out.error)
        if out.finish_reason == FinishReason.STOP:
            checkers[rid](_decode(hf_tokenizer, tokens[rid], eos))
            stopped += 1
    # Every constraint here is bounded: nearly all finish inside max_tokens.
    assert stopped >= len(requests) - 4, f"only {stopped} of {len(requests)} stopped"


@pytest.mark.parametrize("setup", list(SETUPS))
def test_mixed_batch_equals_alone(setup: str, tiny_llama_dir: str) -> None:
    """Greedy constrained requests give the same tokens mixed with unconstrained ones,
    under chunked prefill, forced preemption and prefix caching, as alone."""
    rng = random.Random(7)
    shared = [rng.randrange(5, 1024) for _ in range(48)]
    pairs = _constraints()
    requests = []
    for i in range(12):
        prompt = ([*shared] if i % 3 == 0 else []) + [rng.randrange(5, 1024) for _ in range(rng.randint(4, 80))]
        so = pairs[i % len(pairs)][0] if i % 2 == 0 else None
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=so is None, structured_outputs=so)
        requests.append(EngineCoreRequest(f"m{i}", prompt, params, eos_token_id=2))
    alone_core = _core(tiny_llama_dir, max_num_batched_tokens=2048, enable_prefix_caching=False)
    alone = {}
    for req in requests:
        if req.sampling_params.structured_outputs is not None:
            alone.update(_run(alone_core, [req])[0])
    core = _core(tiny_llama_dir, **SETUPS[setup])
    mixed, final, preemptions = _run(core, requests)
    for rid, ids in alone.items():
        assert mixed[rid] == ids, rid
    if setup == "preempt":
        assert preemptions > 0
    if setup == "prefix":
        assert max(o.num_cached_tokens for o in final.values()) >= 32


def test_logprobs_are_of_the_masked_distribution(tiny_llama_dir: str) -> None:
    core = _core(tiny_llama_dir)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, structured_outputs=SO(choice=["yes", "no"]))
    _, final, _ = _run(core, [EngineCoreRequest("lp", [5, 6, 7, 8], params, eos_token_id=2)])
    lp = final["lp"].new_logprobs
    tok = load_tokenizer(tiny_llama_dir, 1024)
    firsts = {tok.tokenize_str("yes")[0], tok.tokenize_str("no")[0], tok.tokenize_str("y")[0], tok.tokenize_str("n")[0]}
    row_ids, row_lps = lp.token_ids[0], lp.logprobs[0]
    finite = {t for t, v in zip(row_ids, row_lps) if v > float("-inf")}
    assert finite and finite <= firsts, (row_ids, row_lps)
    # Masked: the allowed tokens share all the probability.
    total = sum(torch.tensor(v).exp().item() for v in row_lps[1:] if v > float("-inf"))
    assert total <= 1.0 + 1e-4


def test_bad_constraint_fails_alone_and_others_run(tiny_llama_dir: str) -> None:
    core = _core(tiny_llama_dir)
    bad = SamplingParams(max_tokens=8, structured_outputs=SO(regex="(unclosed"))
    good = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, final, _ = _run(core, [
        EngineCoreRequest("bad", [5, 6, 7], bad, eos_token_id=2),
        EngineCoreRequest("good", [5, 6, 7], good, eos_token_id=2),
    ])
    assert final["bad"].finish_reason == FinishReason.ERROR
    assert final["bad"].error.code == ErrorCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in final["bad"].error.message
    assert tokens["bad"] == []
    assert final["good"].finish_reason == FinishReason.LENGTH and len(tokens["good"]) == 8


def test_compiled_constraints_are_cached_and_bounded(tiny_llama_dir: str) -> None:
    core = _core(tiny_llama_dir, structured_output_cache_size=2)
    manager = core.structured
    reqs = [
        EngineCoreRequest(f"k{i}", [5, 6], SamplingParams(max_tokens=4, structured_outputs=SO(regex=p)), eos_token_id=2)
        for i, p in enumerate(["a+", "b+", "a+", "c+", "a+", "b+"])
    ]
    for req in reqs:
        _run(core, [req])
    # a+ miss, b+ miss, a+ hit, c+ miss (evicts b+), a+ hit, b+ miss
    assert (manager.cache_hits, manager.cache_misses) == (2, 4)
    assert len(manager._cache) == 2


def test_abort_while_compiling_leaves_nothing(tiny_llama_dir: str) -> None:
    core = _core(tiny_llama_dir, structured_output_cache_size=0)
    params = SamplingParams(max_tokens=4, structured_outputs=SO(json=json.dumps(SCHEMAS[2])))
    core.add_request(EngineCoreRequest("gone", [5, 6, 7], params, eos_token_id=2))
    core.abort_requests(["gone"])
    outs = core.step()
    assert [o.finish_reason for o in outs.all_outputs()] == [FinishReason.ABORT]
    assert core.structured.num_compiling == 0
    assert not core.has_unfinished_requests()
    core.kv_manager.pool.check_all_free()


def test_n_children_and_seeds(tiny_llama_dir: str, hf_tokenizer: object) -> None:
    """Seeded constrained sampling repeats exactly; each of n children is valid."""
    core = _core(tiny_llama_dir)
    so, check = _constraints()[0]
    mk = [
        EngineCoreRequest(f"s{i}", [9, 10, 11], SamplingParams(max_tokens=64, temperature=1.0, seed=i % 2, structured_outputs=so), eos_token_id=2)
        for i in range(4)
    ]
    tokens, final, _ = _run(core, mk)
    assert tokens["s0"] == tokens["s2"] and tokens["s1"] == tokens["s3"]
    assert tokens["s0"] != tokens["s1"]
    for rid, out in final.items():
        if out.finish_reason == FinishReason.STOP:
            check(_decode(hf_tokenizer, tokens[rid], 2))


def test_benchmark_runs(tiny_llama_dir: str) -> None:
    """benchmarks/structured_output.py end to end on the tiny model (no timing asserts)."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.structured_output", "--model", tiny_llama_dir,
         "--batch-sizes", "1,3", "--steps", "3", "--repeats", "1"],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("json schema", "regex", "grammar (GBNF)", "json_object"):
        assert name in proc.stdout
    assert "mask / free step" in proc.stdout


def test_a_continuation_replays_the_grammar_and_ends_the_same(tiny_llama_dir: str) -> None:
    """Request migration: a constrained request continued from any position of its output
    (the matcher replays the generated tokens) produces the rest of the same output."""
    core = _core(tiny_llama_dir)
    rng = random.Random()
    prompt = [rng.randrange(5, 1024) for _ in range(rng.randint(3, 40))]
    checked = 0
    for so, _ in _constraints()[:3]:
        for params in (
            SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=so),
            SamplingParams(max_tokens=64, temperature=1.0, seed=rng.randrange(2**31), structured_outputs=so),
        ):
            tokens, final, _ = _run(core, [EngineCoreRequest("alone", prompt, params, eos_token_id=2)])
            whole = tokens["alone"]
            if len(whole) < 2:
                continue
            cut = rng.randrange(1, len(whole))
            rest, final_rest, _ = _run(
                core, [EngineCoreRequest("cont", prompt, params, eos_token_id=2, generated_token_ids=whole[:cut])]
            )
            assert rest["cont"] == whole[cut:], (so, cut)
            assert final_rest["cont"].finish_reason == final["alone"].finish_reason
            checked += 1
    assert checked >= 3, "the constraints gave too few multi-token outputs to cut"


def test_a_request_the_step_fails_reports_why(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error found while updating after the forward (here: a token outside the
    constraint, the mask skipped on purpose) reaches the outputs with its reason."""
    core = _core(tiny_llama_dir)
    # No mask applied; the fill is still waited for (the matchers are its until it ends).
    monkeypatch.setattr(core.structured, "apply", lambda logits, fill: fill.future and fill.future.result())
    params = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=SO(regex="q{3}"))
    _, final, _ = _run(core, [EngineCoreRequest("r", [5, 6, 7], params, eos_token_id=2)])
    out = final["r"]
    assert out.finish_reason == FinishReason.ERROR  # the unmasked argmax left the constraint
    assert out.error is not None and out.error.code == ErrorCode.INTERNAL
    assert "outside the structured-output constraint" in out.error.message
