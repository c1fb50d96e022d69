"""OutputProcessor: engine outputs in, vLLM-shaped RequestOutputs out."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest

from frontend_service.input_processor import InputProcessor, ProcessedRequest
from frontend_service.output_processor import OutputProcessor
from frontend_service.outputs import RequestOutput
from frontend_service.parent_request import ParentRequest
from tandem.protocol.outputs import EngineCoreOutput, FinishReason, Logprobs, TokenColumns
from tandem.protocol.sampling_params import InvalidRequestError, RequestOutputKind, SamplingParams
from tests.text_factories import (
    CJK,
    EMOJI,
    byte_token_ids,
    random_text,
    split_ids,
)

DELTA = RequestOutputKind.DELTA
CUMULATIVE = RequestOutputKind.CUMULATIVE
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def _inputs(tokenizer: Any) -> InputProcessor:
    return InputProcessor(tokenizer, 4096, len(tokenizer), 5, tokenizer.eos_token_id)


def _start(
    tokenizer: Any, request_id: str = "req", prompt: str = "hello", **params: Any
) -> tuple[OutputProcessor, ProcessedRequest]:
    processed = _inputs(tokenizer).process(request_id, SamplingParams(**params), prompt=prompt)
    processor = OutputProcessor(tokenizer)
    processor.add_processed(processed)
    return processor, processed


def _chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    """Split ids into engine steps of 1-3 tokens."""
    out: list[list[int]] = []
    i = 0
    while i < len(ids):
        step = rng.randint(1, 3)
        out.append(ids[i : i + step])
        i += step
    return out


def _feed(
    processor: OutputProcessor,
    engine_id: str,
    ids: list[int],
    rng: random.Random,
    finish: FinishReason | None = FinishReason.LENGTH,
    processor_streams: bool = True,
) -> list[RequestOutput]:
    """Feed ``ids`` in random steps, the last step carrying ``finish``; collect outputs."""
    results: list[RequestOutput] = []
    steps = _chunks(rng, ids)
    for n, step in enumerate(steps):
        last = n == len(steps) - 1
        processed = processor.process_outputs(
            [EngineCoreOutput(engine_id, step, finish_reason=finish if last else None)]
        )
        outs = [out for _, out in processed.request_outputs]
        if processor_streams:
            assert len(outs) == 1  # DELTA and CUMULATIVE answer every step
        results += outs
    return results


def test_delta_pieces_concatenate_to_final_text(tokenizer: Any, rng: random.Random) -> None:
    for _ in range(10):
        text = random_text(rng, rng.randint(1, 30))
        ids = split_ids(rng, tokenizer, text)
        processor, _ = _start(tokenizer, output_kind=DELTA)
        outs = _feed(processor, "req", ids, rng)
        assert "".join(o.outputs[0].text for o in outs) == text
        assert [t for o in outs for t in o.outputs[0].token_ids] == ids
        assert all("\ufffd" not in o.outputs[0].text for o in outs)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].outputs[0].finish_reason == "length"
        assert outs[-1].usage.completion_tokens == len(ids)
        assert not processor.has_unfinished_requests()


def test_cumulative_outputs_grow_and_final_only_sends_once(
    tokenizer: Any, rng: random.Random
) -> None:
    text = random_text(rng, 20)
    ids = split_ids(rng, tokenizer, text)
    processor, processed = _start(tokenizer, output_kind=CUMULATIVE)
    outs = _feed(processor, "req", ids, rng)
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert texts[-1] == text and outs[-1].outputs[0].token_ids == ids
    assert outs[-1].prompt == "hello"
    assert outs[-1].prompt_token_ids == processed.prompt_token_ids

    processor, _ = _start(tokenizer, output_kind=FINAL_ONLY)
    outs = _feed(processor, "req", ids, rng, processor_streams=False)
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].text == text and outs[0].outputs[0].token_ids == ids


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_stop_string_across_tokens_truncates_and_requests_abort(
    include: bool, kind: RequestOutputKind, tokenizer: Any, rng: random.Random
) -> None:
    before = random_text(rng, rng.randint(1, 8)).replace("#", "")
    stop = "#" + rng.choice(CJK + EMOJI)
    ids = byte_token_ids(tokenizer, before + stop + random_text(rng, 5))
    processor, _ = _start(
        tokenizer, stop=[stop], include_stop_str_in_output=include, output_kind=kind
    )
    streamed: list[str] = []
    streamed_ids: list[int] = []
    aborts: list[str] = []
    for token in ids:
        result = processor.process_outputs([EngineCoreOutput("req", [token])])
        aborts += result.reqs_to_abort
        for _, out in result.request_outputs:
            streamed.append(out.outputs[0].text)
            streamed_ids += out.outputs[0].token_ids
            if out.finished:
                break
        if aborts:
            break
    expected = before + stop if include else before
    assert aborts == ["req"]
    final = out.outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    kept = final.token_ids if kind == CUMULATIVE else streamed_ids
    assert kept == byte_token_ids(tokenizer, before + stop)  # tokens up to the match
    if kind == DELTA:
        assert "".join(streamed) == expected
    else:
        # Nothing streamed is ever taken back: each output extends the previous one.
        assert all(b.startswith(a) for a, b in itertools.pairwise(streamed))
        assert streamed[-1] == expected
    # The engine may send one more step before the abort lands: it is ignored.
    assert processor.process_outputs([EngineCoreOutput("req", [5])]).request_outputs == []
    assert not processor.has_unfinished_requests()


def test_stop_string_mid_step_drops_the_later_tokens(tokenizer: Any, rng: random.Random) -> None:
    before = random_text(rng, rng.randint(1, 6))
    stop = "#" + rng.choice(EMOJI)
    kept = byte_token_ids(tokenizer, before + stop)
    ids = kept + split_ids(rng, tokenizer, random_text(rng, 4))
    processor, _ = _start(tokenizer, stop=[stop], logprobs=1)
    packed = _packed(rng, ids, 1, len(tokenizer))
    result = processor.process_outputs([EngineCoreOutput("req", ids, new_logprobs=packed)])
    ((_, out),) = result.request_outputs
    assert result.reqs_to_abort == ["req"] and out.finished
    assert out.outputs[0].text == before
    assert out.outputs[0].token_ids == kept
    assert len(out.outputs[0].logprobs) == len(kept)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(row[0] for row in packed.logprobs[: len(kept)])
    )


def test_stop_string_in_the_engines_final_step_needs_no_abort(tokenizer: Any) -> None:
    processor, _ = _start(tokenizer, stop=["ok"])
    ids = tokenizer.encode(" fine ok then", add_special_tokens=False)
    result = processor.process_outputs(
        [EngineCoreOutput("req", ids, finish_reason=FinishReason.LENGTH)]
    )
    assert result.reqs_to_abort == []
    ((_, out),) = result.request_outputs
    assert out.outputs[0].text == " fine " and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_is_hidden_unless_included(include: bool, tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    processor, _ = _start(tokenizer, skip_special_tokens=False, include_stop_str_in_output=include)
    ids = tokenizer.encode(" done", add_special_tokens=False)
    result = processor.process_outputs(
        [EngineCoreOutput("req", [*ids, eos], finish_reason=FinishReason.STOP)]
    )
    ((_, out),) = result.request_outputs
    assert out.outputs[0].text == " done" + ("</s>" if include else "")
    assert out.outputs[0].token_ids == [*ids, eos]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)


@pytest.mark.parametrize(
    ("reason", "name"),
    [
        (FinishReason.STOP, "stop"),
        (FinishReason.LENGTH, "length"),
        (FinishReason.ABORT, "abort"),
        (FinishReason.ERROR, "error"),
    ],
)
def test_engine_finish_reasons_map_to_names(
    reason: FinishReason, name: str, tokenizer: Any
) -> None:
    processor, _ = _start(tokenizer)
    result = processor.process_outputs(
        [EngineCoreOutput("req", [40], finish_reason=reason, stop_reason=7)]
    )
    ((_, out),) = result.request_outputs
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == (name, 7)


def _packed(rng: random.Random, chosen: list[int], k: int, vocab: int) -> Logprobs:
    token_ids, values, ranks = [], [], []
    for token in chosen:
        top = rng.sample([t for t in range(vocab) if t != token], k)
        row_values = sorted((math.log(rng.random()) for _ in range(k + 1)), reverse=True)
        token_ids.append([token, *top])
        values.append([row_values[-1], *row_values[:k]])
        ranks.append(rng.randint(k + 1, vocab))
    return Logprobs(token_ids, values, ranks)


def test_logprobs_are_decoded_ranked_and_streamed_by_kind(
    tokenizer: Any, rng: random.Random
) -> None:
    vocab = len(tokenizer)
    k = rng.randint(1, 5)
    ids = tokenizer.encode(random_text(rng, 8), add_special_tokens=False)
    processor, processed = _start(tokenizer, logprobs=k, prompt_logprobs=2, output_kind=DELTA)
    prompt_len = len(processed.prompt_token_ids)
    prompt_packed = _packed(rng, processed.prompt_token_ids[1:], 2, vocab)
    first = _packed(rng, ids[:1], k, vocab)
    rest = _packed(rng, ids[1:], k, vocab)
    outs = [
        o
        for batch in (
            [
                EngineCoreOutput(
                    "req", ids[:1], new_logprobs=first, new_prompt_logprobs=prompt_packed
                )
            ],
            [
                EngineCoreOutput(
                    "req", ids[1:], new_logprobs=rest, finish_reason=FinishReason.LENGTH
                )
            ],
        )
        for _, o in processor.process_outputs(batch).request_outputs
    ]
    assert (
        len(outs[0].outputs[0].logprobs) == 1 and len(outs[1].outputs[0].logprobs) == len(ids) - 1
    )
    entries = outs[0].outputs[0].logprobs + outs[1].outputs[0].logprobs
    rows = [(first, 0)] + [(rest, i) for i in range(len(ids) - 1)]
    for entry, (packed, row), token in zip(entries, rows, ids):
        assert list(entry) == packed.token_ids[row]  # chosen first, then the top-k
        assert entry[token].rank == packed.ranks[row]
        assert [entry[t].rank for t in packed.token_ids[row][1:]] == list(range(1, k + 1))
        for t, lp in entry.items():
            assert lp.decoded_token == tokenizer.decode([t])
    total = sum(p.logprobs[r][0] for p, r in rows)
    assert outs[-1].outputs[0].cumulative_logprob == pytest.approx(total)
    # Prompt logprobs: position 0 is None, then one row per later prompt token; DELTA
    # sends them once.
    assert outs[0].prompt_logprobs[0] is None and len(outs[0].prompt_logprobs) == prompt_len
    assert outs[1].prompt_logprobs is None


def test_no_logprobs_requested_gives_none(tokenizer: Any, rng: random.Random) -> None:
    processor, _ = _start(tokenizer)
    outs = _feed(processor, "req", [40, 41, 42], rng)
    assert outs[-1].outputs[0].logprobs is None
    assert outs[-1].outputs[0].cumulative_logprob is None
    assert outs[-1].prompt_logprobs is None


def _texts(rng: random.Random, tokenizer: Any, n: int) -> list[list[int]]:
    return [split_ids(rng, tokenizer, random_text(rng, rng.randint(1, 10))) for _ in range(n)]


def test_parent_request_fans_out_with_deterministic_ids_and_seeds() -> None:
    parent = ParentRequest("abc", SamplingParams(n=3, seed=10, stop=["x"]))
    assert [parent.child_request_id(i) for i in range(3)] == ["0_abc", "1_abc", "2_abc"]
    children = [parent.child_sampling_params(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12] and {c.n for c in children} == {1}
    assert children[0].stop == ["x"] and children[0].stop is not parent.sampling_params.stop
    unseeded = ParentRequest("abc", SamplingParams(n=2))
    assert unseeded.child_sampling_params(1).seed is None
    assert ParentRequest("solo", SamplingParams()).child_request_id(0) == "solo"
    with pytest.raises(IndexError):
        parent.child_request_id(3)


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL_ONLY])
def test_n3_children_aggregate_into_one_request(
    kind: RequestOutputKind, tokenizer: Any, rng: random.Random
) -> None:
    processor, processed = _start(tokenizer, "p", n=3, seed=1, output_kind=kind)
    assert [r.request_id for r in processed.engine_requests] == ["0_p", "1_p", "2_p"]
    seqs = _texts(rng, tokenizer, 3)
    cursors = [0, 0, 0]
    outs: list[RequestOutput] = []
    while any(c < len(s) for c, s in zip(cursors, seqs)):
        step = []
        for i in rng.sample(range(3), rng.randint(1, 3)):
            if cursors[i] >= len(seqs[i]):
                continue
            cursors[i] += 1
            done = cursors[i] == len(seqs[i])
            step.append(
                EngineCoreOutput(
                    f"{i}_p",
                    [seqs[i][cursors[i] - 1]],
                    finish_reason=FinishReason.LENGTH if done else None,
                )
            )
        result = processor.process_outputs(step)
        assert all(user_id == "p" for user_id, _ in result.request_outputs)
        outs += [o for _, o in result.request_outputs]
        if kind == DELTA and step:
            (out,) = [o for _, o in result.request_outputs]
            assert [c.index for c in out.outputs] == sorted(int(s.request_id[0]) for s in step)
    expected = [tokenizer.decode(s) for s in seqs]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    final = outs[-1]
    assert final.usage.completion_tokens == sum(len(s) for s in seqs)
    assert final.usage.prompt_tokens == len(processed.prompt_token_ids)
    if kind == DELTA:
        for i in range(3):
            assert "".join(c.text for o in outs for c in o.outputs if c.index == i) == expected[i]
    else:
        assert [c.index for c in final.outputs] == [0, 1, 2]
        assert [c.text for c in final.outputs] == expected
        assert [c.token_ids for c in final.outputs] == seqs
        assert all(len(o.outputs) == 3 for o in outs)
    if kind == FINAL_ONLY:
        assert len(outs) == 1
    assert not processor.has_unfinished_requests()


def test_abort_parent_aborts_all_unfinished_children(tokenizer: Any) -> None:
    processor, _ = _start(tokenizer, "p", n=3, output_kind=CUMULATIVE)
    processor.process_outputs(
        [
            EngineCoreOutput("0_p", [40], finish_reason=FinishReason.LENGTH),
            EngineCoreOutput("1_p", [41]),
        ]
    )
    result = processor.abort_requests(["p", "unknown"])
    assert sorted(result.reqs_to_abort) == ["1_p", "2_p"]
    ((user_id, out),) = result.request_outputs
    assert user_id == "p" and out.finished
    assert [c.finish_reason for c in out.outputs] == ["length", "abort", "abort"]
    assert processor.process_outputs([EngineCoreOutput("1_p", [42])]).request_outputs == []
    assert not processor.has_unfinished_requests()
    assert processor.abort_requests(["p"]).reqs_to_abort == []


def test_request_ids_must_be_unique(tokenizer: Any) -> None:
    processor, _ = _start(tokenizer, "dup")
    again = _inputs(tokenizer).process("dup", SamplingParams(), prompt="x")
    with pytest.raises(InvalidRequestError) as err:
        processor.add_processed(again)
    assert err.value.field == "request_id"
    assert processor.get_num_unfinished_requests() == 1


def test_without_tokenizer_token_ids_flow_and_text_is_empty(rng: random.Random) -> None:
    processor = OutputProcessor(None)
    processed = InputProcessor(None, 64, 100, 5, 1).process(
        "t", SamplingParams(logprobs=1), prompt_token_ids=[3, 4]
    )
    processor.add_processed(processed)
    ids = [rng.randrange(100) for _ in range(5)]
    result = processor.process_outputs(
        [
            EngineCoreOutput(
                "t", ids, new_logprobs=_packed(rng, ids, 1, 100), finish_reason=FinishReason.LENGTH
            )
        ]
    )
    ((_, out),) = result.request_outputs
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == ids
    assert all(lp.decoded_token is None for e in out.outputs[0].logprobs for lp in e.values())


def _step_outputs(
    rng: random.Random, seqs: dict[str, list[int]], cursors: dict[str, int]
) -> list[EngineCoreOutput]:
    """One engine step: a random subset of the unfinished engine requests gets 1-3 of
    its tokens; the last step of each carries LENGTH, some carry a cached count."""
    step = []
    for rid in rng.sample(sorted(seqs), rng.randint(1, len(seqs))):
        start = cursors[rid]
        if start >= len(seqs[rid]):
            continue
        cursors[rid] = min(start + rng.choice([1, 1, 2, 3]), len(seqs[rid]))
        done = cursors[rid] == len(seqs[rid])
        step.append(
            EngineCoreOutput(
                rid,
                seqs[rid][start : cursors[rid]],
                finish_reason=FinishReason.LENGTH if done else None,
                num_cached_tokens=rng.choice([0, 0, 16]),
            )
        )
    return step


def test_columns_give_the_same_outputs_as_objects(tokenizer: Any, rng: random.Random) -> None:
    # The frontend reads a step's plain outputs straight from TokenColumns; the
    # RequestOutputs and aborts must be those of the same outputs as objects.
    for _ in range(5):
        inputs = _inputs(tokenizer)
        by_objects, by_columns = OutputProcessor(tokenizer), OutputProcessor(tokenizer)
        seqs: dict[str, list[int]] = {}
        for u in range(rng.randint(1, 6)):
            params = SamplingParams(
                n=rng.choice([1, 1, 2]),
                output_kind=rng.choice([DELTA, CUMULATIVE, FINAL_ONLY]),
                stop=["#"] if rng.random() < 0.5 else [],
                logprobs=None if rng.random() < 0.7 else 1,
            )
            processed = inputs.process(f"u{u}", params, prompt="hi")
            by_objects.add_processed(processed)
            by_columns.add_processed(inputs.process(f"u{u}", params, prompt="hi"))
            for request in processed.engine_requests:
                text = random_text(rng, rng.randint(1, 12))
                if params.stop:  # the stop string shows up mid-sequence
                    text = text[: len(text) // 2] + "#" + text[len(text) // 2 :]
                seqs[request.request_id] = split_ids(rng, tokenizer, text)
        seqs["unknown"] = [7, 8]  # outputs for an id the frontend does not track are ignored
        cursors = dict.fromkeys(seqs, 0)
        while any(cursors[r] < len(s) for r, s in seqs.items()):
            step = _step_outputs(rng, seqs, cursors)
            plain = [o for o in step if o.finish_reason is None]
            detailed = [o for o in step if o.finish_reason is not None]
            want = by_objects.process_outputs(plain + detailed)
            got = by_columns.process_outputs(detailed, TokenColumns.from_outputs(plain) if plain else None)
            assert dict(got.request_outputs) == dict(want.request_outputs)
            assert len(got.request_outputs) == len(want.request_outputs)
            assert sorted(got.reqs_to_abort) == sorted(want.reqs_to_abort)
        assert not by_columns.has_unfinished_requests()


def _run_steps(
    processor: OutputProcessor, steps: list[list[EngineCoreOutput]]
) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for step in steps:
        outs += [o for _, o in processor.process_outputs(step).request_outputs]
    return outs


def _n_steps(rng: random.Random, seqs: list[list[int]], user_id: str) -> list[list[EngineCoreOutput]]:
    """Engine steps of ``len(seqs)`` children of ``user_id`` (ids ``f"{i}_{user_id}"``, or
    ``user_id`` for one child), each giving a random subset of them 1-3 tokens; each
    child's last step carries LENGTH."""
    ids = [user_id] if len(seqs) == 1 else [f"{i}_{user_id}" for i in range(len(seqs))]
    cursors = [0] * len(seqs)
    steps = []
    while any(c < len(s) for c, s in zip(cursors, seqs)):
        step = []
        for i in rng.sample(range(len(seqs)), rng.randint(1, len(seqs))):
            start = cursors[i]
            if start >= len(seqs[i]):
                continue
            cursors[i] = min(start + rng.choice([1, 1, 2, 3]), len(seqs[i]))
            done = cursors[i] == len(seqs[i])
            step.append(EngineCoreOutput(ids[i], seqs[i][start : cursors[i]],
                                         finish_reason=FinishReason.LENGTH if done else None))
        steps.append(step)
    return steps


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL_ONLY])
@pytest.mark.parametrize("n", [1, 3])
def test_stream_interval_sends_fewer_outputs_with_the_same_content(
    kind: RequestOutputKind, n: int, tokenizer: Any, rng: random.Random
) -> None:
    for _ in range(5):
        interval = rng.randint(2, 6)
        seqs = [split_ids(rng, tokenizer, random_text(rng, rng.randint(1, 30))) for _ in range(n)]
        steps = _n_steps(rng, seqs, "p")
        runs = {}
        for every in (1, interval):
            processed = _inputs(tokenizer).process("p", SamplingParams(n=n, seed=1, output_kind=kind), prompt="hi")
            processor = OutputProcessor(tokenizer, stream_interval=every)
            processor.add_processed(processed)
            runs[every] = _run_steps(processor, steps)
            assert not processor.has_unfinished_requests()
        plain, spaced = runs[1], runs[interval]
        assert [o.finished for o in spaced] == [False] * (len(spaced) - 1) + [True]
        if kind == DELTA:  # every token and character exactly once, in order, per child
            for i in range(n):
                def child(outs: list[RequestOutput], i: int = i) -> tuple[list[int], str]:
                    mine = [c for o in outs for c in o.outputs if c.index == i]
                    return [t for c in mine for t in c.token_ids], "".join(c.text for c in mine)

                assert child(spaced) == child(plain)
            final = {c.index: c.finish_reason for o in spaced for c in o.outputs if c.finish_reason}
            assert final == dict.fromkeys(range(n), "length")
        else:
            assert spaced[-1].outputs == plain[-1].outputs
        assert spaced[-1].usage == plain[-1].usage
        if kind == FINAL_ONLY:
            assert len(spaced) == len(plain) == 1
            continue
        # The first output at once; then one each time `interval` tokens were new.
        assert spaced[0].outputs == plain[0].outputs
        counts = [sum(len(c.token_ids) for c in o.outputs) for o in spaced]
        if kind == CUMULATIVE:
            counts = [b - a for a, b in zip([0, *counts], counts)]
        assert all(c >= interval for c in counts[1:-1])
        total = sum(map(len, seqs))
        assert len(spaced) <= 2 + (total - 1) // interval
        assert len(spaced) <= len(plain)


def test_stream_interval_must_be_a_positive_integer(tokenizer: Any) -> None:
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="stream interval"):
            OutputProcessor(tokenizer, stream_interval=bad)  # type: ignore[arg-type]


def test_stream_interval_holds_no_text_past_a_stop_string(tokenizer: Any) -> None:
    # A stop string ends the request within a held-back stretch: the final output
    # carries everything before it, nothing after.
    ids = tokenizer.encode("one two three four five six", add_special_tokens=False)
    runs = {}
    for every in (1, 4):
        processor, _ = _start(tokenizer, stop=["four"], output_kind=DELTA)
        processor.stream_interval = every
        outs = _run_steps(processor, [[EngineCoreOutput("req", [t])] for t in ids])
        runs[every] = ("".join(o.outputs[0].text for o in outs), outs[-1].outputs[0].finish_reason, len(outs))
    assert runs[4][:2] == runs[1][:2] == ("one two three ", "stop")
    assert runs[4][2] < runs[1][2]
