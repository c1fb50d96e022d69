"""Domain <-> tandem.v1 conversions: randomised round trips through the wire bytes."""

from __future__ import annotations

import math
import random
import struct
from dataclasses import replace
from typing import Any, TypeVar

import pytest
from google.protobuf.message import Message

from tandem.protocol import convert
from tandem.protocol.convert import ConversionError, EngineDeadError
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    Logprobs,
    RequestError,
    SchedulerStats,
    TokenColumns,
    UtilityOutput,
)
from tandem.protocol.sampling_params import InvalidRequestError, RequestOutputKind, SamplingParams
from tandem.v1 import common_pb2, engine_pb2

M = TypeVar("M", bound=Message)
ROUNDS = 200


def wire(msg: M) -> M:
    """Serialize and parse back, so tests cover the bytes, not just the Python object."""
    return type(msg).FromString(msg.SerializeToString())


def f32(x: float) -> float:
    """Round to the nearest float32, the precision of proto `float` fields."""
    return struct.unpack("f", struct.pack("f", x))[0]


def maybe(rng: random.Random, value: Any) -> Any:
    return value if rng.random() < 0.5 else None


def rand_sampling_params(rng: random.Random) -> SamplingParams:
    max_tokens = maybe(rng, rng.randint(1, 4096))
    return SamplingParams(
        n=rng.randint(1, 8),
        temperature=rng.choice([0.0, 1.0, rng.uniform(0, 2)]),
        top_p=rng.choice([1.0, rng.uniform(0.01, 1)]),
        top_k=rng.choice([None, -1, rng.randint(1, 100)]),
        min_p=rng.choice([0.0, rng.random()]),
        seed=rng.choice([None, 0, rng.randint(-(2**63), 2**63 - 1)]),
        presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.1, 2)]),
        logit_bias=maybe(
            rng, {rng.randint(0, 50000): f32(rng.uniform(-100, 100)) for _ in range(rng.randint(1, 5))}
        ),
        allowed_token_ids=maybe(rng, [rng.randint(0, 50000) for _ in range(rng.randint(1, 6))]),
        max_tokens=max_tokens,
        min_tokens=rng.randint(0, max_tokens or 10),
        stop=[f"stop{rng.randint(0, 9)}" for _ in range(rng.randint(0, 3))],
        stop_token_ids=[rng.randint(0, 50000) for _ in range(rng.randint(0, 3))],
        ignore_eos=rng.random() < 0.5,
        include_stop_str_in_output=rng.random() < 0.5,
        logprobs=maybe(rng, rng.randint(0, 20)),
        prompt_logprobs=maybe(rng, rng.randint(0, 20)),
        skip_special_tokens=rng.random() < 0.5,
        output_kind=rng.choice(list(RequestOutputKind)),
    )


def rand_request(rng: random.Random) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=f"req-{rng.getrandbits(64):x}",
        prompt_token_ids=[rng.randint(0, 2**31 - 1) for _ in range(rng.randint(1, 300))],
        sampling_params=rand_sampling_params(rng),
        eos_token_id=rng.choice([None, 0, rng.randint(1, 50000)]),
        arrival_time=rng.uniform(1.7e9, 1.8e9),
        priority=rng.randint(-10, 10),
        cache_salt=rng.choice([None, "", "tenant-a"]),
        client_index=rng.randint(0, 7),
        external_req_id=rng.choice([None, "", "client-id"]),
        trace_headers=maybe(rng, {"traceparent": f"00-{rng.getrandbits(128):032x}-01-01"}),
        timeout_s=rng.choice([None, 0.0, rng.uniform(0.001, 600.0)]),
    )


def rand_logprobs(rng: random.Random) -> Logprobs:
    positions = rng.randint(0, 6)
    columns = rng.randint(1, 5)
    values = [-math.inf, 0.0, -0.5]
    return Logprobs(
        token_ids=[[rng.randint(0, 50000) for _ in range(columns)] for _ in range(positions)],
        logprobs=[
            [rng.choice(values) if rng.random() < 0.2 else f32(-rng.expovariate(1)) for _ in range(columns)]
            for _ in range(positions)
        ],
        ranks=[rng.randint(1, 50000) for _ in range(positions)],
    )


def rand_utility_value(rng: random.Random, depth: int = 0) -> Any:
    choices: list[Any] = [
        None,
        rng.random() < 0.5,
        rng.randint(-(2**63), 2**63 - 1),
        rng.uniform(-1e9, 1e9),
        "text é",
        bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 8))),
    ]
    if depth < 2:
        choices.append([rand_utility_value(rng, depth + 1) for _ in range(rng.randint(0, 3))])
    return rng.choice(choices)


def rand_output(rng: random.Random) -> EngineCoreOutput:
    finish = rng.choice([None, *FinishReason])
    return EngineCoreOutput(
        request_id=f"req-{rng.randint(0, 999)}",
        new_token_ids=[rng.randint(0, 50000) for _ in range(rng.randint(0, 3))],
        new_logprobs=maybe(rng, rand_logprobs(rng)),
        new_prompt_logprobs=maybe(rng, rand_logprobs(rng)),
        finish_reason=finish,
        stop_reason=rng.choice([None, 0, rng.randint(1, 50000), "", "</s>"]) if finish else None,
        num_cached_tokens=rng.randint(0, 4096),
        trace_headers=maybe(rng, {"traceparent": "00-abc-def-01", "tracestate": "k=v"}),
        error=(
            RequestError(rng.choice(list(ErrorCode)), "why", rng.choice([0, rng.randint(1, 10**6)]))
            if finish is FinishReason.ERROR and rng.random() < 0.7
            else None
        ),
    )


def rand_outputs(rng: random.Random) -> EngineCoreOutputs:
    utility = None
    if rng.random() < 0.3:
        failed = rng.random() < 0.3
        utility = UtilityOutput(
            call_id=rng.getrandbits(64),
            result=None if failed else rand_utility_value(rng),
            failure_message="boom" if failed else None,
        )
    return EngineCoreOutputs(
        draining=rng.random() < 0.3,
        engine_index=rng.randint(0, 15),
        outputs=[rand_output(rng) for _ in range(rng.randint(0, 8))],
        scheduler_stats=maybe(
            rng,
            SchedulerStats(
                num_running_reqs=rng.randint(0, 256),
                num_waiting_reqs=rng.randint(0, 256),
                kv_cache_usage=rng.random(),
                prefix_cache_queries=rng.randint(0, 10**6),
                prefix_cache_hits=rng.randint(0, 10**6),
                num_preemptions=rng.randint(0, 5),
                num_free_blocks=rng.randint(0, 10**5),
                num_total_blocks=rng.randint(0, 10**5),
            ),
        ),
        timestamp=rng.uniform(0, 1e6),
        utility_output=utility,
        finished_requests=maybe(rng, {f"req-{i}" for i in range(rng.randint(1, 4))}),
    )


# ---- sampling params --------------------------------------------------------


def test_sampling_params_round_trip() -> None:
    rng = random.Random(1)
    for _ in range(ROUNDS):
        sp = rand_sampling_params(rng)
        sp.validate()
        back = convert.sampling_params_from_proto(wire(convert.sampling_params_to_proto(sp)))
        assert back == sp


def test_sampling_params_unset_fields_take_documented_defaults() -> None:
    back = convert.sampling_params_from_proto(common_pb2.SamplingParams())
    # Everything is the domain default except max_tokens (unset means no limit) and
    # output_kind (the gRPC API streams deltas unless asked otherwise).
    assert back == SamplingParams(max_tokens=None, output_kind=RequestOutputKind.DELTA)
    assert back.skip_special_tokens is True and back.n == 1 and back.temperature == 1.0


def test_sampling_params_zero_values_survive() -> None:
    sp = SamplingParams(temperature=0.0, seed=0, logprobs=0, prompt_logprobs=0, top_k=-1,
                        skip_special_tokens=False, top_p=1.0)
    msg = wire(convert.sampling_params_to_proto(sp))
    assert msg.HasField("temperature") and msg.HasField("seed") and msg.HasField("logprobs")
    back = convert.sampling_params_from_proto(msg)
    assert back.temperature == 0.0 and back.greedy
    assert back.seed == 0 and back.logprobs == 0 and back.prompt_logprobs == 0
    assert back.top_k == -1 and back.skip_special_tokens is False


def test_sampling_params_unknown_output_kind_is_invalid_request() -> None:
    with pytest.raises(InvalidRequestError) as info:
        convert.sampling_params_from_proto(common_pb2.SamplingParams(output_kind=17))
    assert info.value.field == "output_kind"


def test_output_kind_mapping() -> None:
    assert convert.output_kind_from_proto(common_pb2.OUTPUT_KIND_UNSPECIFIED) is RequestOutputKind.DELTA
    assert convert.output_kind_from_proto(common_pb2.OUTPUT_KIND_DELTA) is RequestOutputKind.DELTA
    assert convert.output_kind_to_proto(RequestOutputKind.FINAL_ONLY) == common_pb2.OUTPUT_KIND_FINAL_ONLY


# ---- requests and inputs ----------------------------------------------------


def test_engine_core_request_round_trip() -> None:
    rng = random.Random(2)
    for _ in range(ROUNDS):
        req = rand_request(rng)
        back = convert.engine_core_request_from_proto(wire(convert.engine_core_request_to_proto(req)))
        assert back == req


def test_request_optional_strings_keep_empty_apart_from_unset() -> None:
    req = EngineCoreRequest("r", [1], SamplingParams(), cache_salt="", external_req_id=None)
    msg = wire(convert.engine_core_request_to_proto(req, data_parallel_rank=0))
    assert msg.HasField("cache_salt") and not msg.HasField("external_req_id")
    assert msg.HasField("data_parallel_rank") and msg.data_parallel_rank == 0
    back = convert.engine_core_request_from_proto(msg)
    assert back.cache_salt == "" and back.external_req_id is None and back.eos_token_id is None


def test_request_without_params_is_rejected() -> None:
    with pytest.raises(InvalidRequestError) as info:
        convert.engine_core_request_from_proto(engine_pb2.EngineCoreRequest(request_id="r"))
    assert info.value.field == "sampling_params"


def test_pooling_request_round_trip() -> None:
    from tandem.protocol.pooling_params import PoolingParams

    pooling = engine_pb2.EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], pooling_params=common_pb2.PoolingParams())
    back = convert.engine_core_request_from_proto(pooling)
    assert back.pooling_params == PoolingParams()  # every default: embed, LAST, normalized
    req = EngineCoreRequest("p", [3, 4], SamplingParams(), pooling_params=PoolingParams("embed", "MEAN", False, 8))
    msg = convert.engine_core_request_to_proto(req)
    assert msg.WhichOneof("params") == "pooling_params"
    assert convert.engine_core_request_from_proto(msg).pooling_params == req.pooling_params
    out = EngineCoreOutput("p", [], finish_reason=FinishReason.STOP, pooling_output=[0.5, -1.0])
    assert convert.engine_core_output_from_proto(convert.engine_core_output_to_proto(out)).pooling_output == [0.5, -1.0]


def test_input_builders_set_the_right_oneof() -> None:
    req = rand_request(random.Random(3))
    add = wire(convert.add_input(req))
    assert add.WhichOneof("kind") == "add"
    assert convert.engine_core_request_from_proto(add.add) == req
    abort = wire(convert.abort_input(iter(["a", "b"])))
    assert abort.WhichOneof("kind") == "abort" and list(abort.abort.request_ids) == ["a", "b"]
    hello = wire(convert.hello_input(3, "abc123"))
    assert hello.WhichOneof("kind") == "hello"
    assert hello.hello.client_index == 3 and hello.hello.tokenizer_fingerprint == "abc123"
    util = wire(convert.utility_input(2**64 - 1, "add_lora", ["x", (1, 2.5)]))
    assert convert.utility_call_from_proto(util.utility) == (2**64 - 1, "add_lora", ["x", [1, 2.5]])


# ---- utility ----------------------------------------------------------------


def test_utility_values_round_trip_and_keep_types() -> None:
    rng = random.Random(4)
    for _ in range(ROUNDS):
        value = rand_utility_value(rng)
        back = convert.utility_value_from_proto(wire(convert.utility_value_to_proto(value)))
        assert back == value and type(back) is type(value)
    assert convert.utility_value_from_proto(convert.utility_value_to_proto(True)) is True
    assert convert.utility_value_from_proto(convert.utility_value_to_proto(1)) is not True
    assert convert.utility_value_from_proto(convert.utility_value_to_proto((1, (2,)))) == [1, [2]]
    with pytest.raises(TypeError):
        convert.utility_value_to_proto({"a": 1})


def test_utility_output_outcomes() -> None:
    for out in (
        UtilityOutput(call_id=5),
        UtilityOutput(call_id=6, result=[1, "two", None]),
        UtilityOutput(call_id=7, result=False),
        UtilityOutput(call_id=8, failure_message=""),
    ):
        assert convert.utility_output_from_proto(wire(convert.utility_output_to_proto(out))) == out
    # A failed call's result is dropped.
    msg = convert.utility_output_to_proto(UtilityOutput(call_id=9, result=3, failure_message="bad"))
    assert msg.WhichOneof("outcome") == "failure_message"


# ---- logprobs and engine outputs -------------------------------------------


def test_logprobs_packed_layout() -> None:
    lp = Logprobs(token_ids=[[7, 1, 2], [8, 3, 4]], logprobs=[[-0.5, -0.25, -1.0], [-2.0, -math.inf, -3.0]], ranks=[2, 1])
    msg = convert.logprobs_to_proto(lp)
    assert msg.num_columns == 3
    assert list(msg.token_ids) == [7, 1, 2, 8, 3, 4]
    assert list(msg.logprobs) == [-0.5, -0.25, -1.0, -2.0, -math.inf, -3.0]
    assert list(msg.ranks) == [2, 1]
    assert convert.logprobs_from_proto(wire(msg)) == lp


def test_logprobs_round_trip() -> None:
    rng = random.Random(5)
    for _ in range(ROUNDS):
        lp = rand_logprobs(rng)
        assert convert.logprobs_from_proto(wire(convert.logprobs_to_proto(lp))) == lp


def test_logprobs_shape_errors() -> None:
    ragged = Logprobs(token_ids=[[1, 2], [3], [4, 5, 6]], logprobs=[[0.0, 0.0], [0.0], [0.0] * 3], ranks=[1, 1, 1])
    with pytest.raises(ConversionError):
        convert.logprobs_to_proto(ragged)
    missing_rank = Logprobs(token_ids=[[1], [2]], logprobs=[[0.0], [0.0]], ranks=[1])
    with pytest.raises(ConversionError):
        convert.logprobs_to_proto(missing_rank)
    short = common_pb2.Logprobs(token_ids=[1, 2, 3], logprobs=[0.0, 0.0], ranks=[1], num_columns=3)
    with pytest.raises(ConversionError):
        convert.logprobs_from_proto(short)
    no_columns = common_pb2.Logprobs(ranks=[1], num_columns=0)
    with pytest.raises(ConversionError):
        convert.logprobs_from_proto(no_columns)


def round_trip(outs: EngineCoreOutputs) -> EngineCoreOutputs:
    return convert.engine_core_outputs_from_proto(wire(convert.engine_core_outputs_to_proto(outs)))


def assert_same_step(back: EngineCoreOutputs, outs: EngineCoreOutputs) -> None:
    """Equal, except that the order of the outputs does not matter and plain outputs
    may move from ``outputs`` into the columns (the wire keeps column outputs and
    detailed ones apart)."""
    assert sorted(back.all_outputs(), key=repr) == sorted(outs.all_outputs(), key=repr)
    assert replace(back, outputs=[], token_columns=None) == replace(outs, outputs=[], token_columns=None)
    assert all(not is_plain(o) for o in back.outputs)


def is_plain(out: EngineCoreOutput) -> bool:
    """Whether the output may travel in TokenColumns."""
    return (
        out.new_logprobs is None
        and out.new_prompt_logprobs is None
        and out.finish_reason is None
        and out.stop_reason is None
        and out.trace_headers is None
        and out.error is None
        and out.pooling_output is None
    )


def rand_plain_output(rng: random.Random, request_id: str, one_token: bool, cached: bool) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id,
        [rng.randint(0, 2**31 - 1) for _ in range(1 if one_token else rng.randint(0, 5))],
        num_cached_tokens=rng.randint(0, 4096) if cached else 0,
    )


def rand_mixed_outputs(rng: random.Random) -> EngineCoreOutputs:
    """A step mixing column-eligible outputs (sometimes all one token each, sometimes
    all without cached tokens: the columns sent empty) and detailed ones."""
    n = rng.choice([0, 1, rng.randint(2, 40)])
    share_plain = rng.choice([0.0, 1.0, rng.random()])
    one_token, cached = rng.random() < 0.5, rng.random() < 0.5
    outputs = []
    for i in range(n):
        if rng.random() < share_plain:
            outputs.append(rand_plain_output(rng, f"plain-{i}", one_token, cached))
        else:
            outputs.append(replace(rand_output(rng), request_id=f"detail-{i}"))
    outs = rand_outputs(rng)
    outs.outputs = outputs
    return outs


def test_engine_core_outputs_round_trip() -> None:
    rng = random.Random(6)
    for _ in range(ROUNDS):
        outs = rand_outputs(rng)
        assert_same_step(round_trip(outs), outs)


def test_engine_core_outputs_round_trip_with_columns() -> None:
    rng = random.Random(7)
    for _ in range(ROUNDS * 2):
        outs = rand_mixed_outputs(rng)
        assert_same_step(round_trip(outs), outs)


def test_plain_outputs_travel_in_the_columns() -> None:
    rng = random.Random(8)
    for _ in range(ROUNDS):
        outs = rand_mixed_outputs(rng)
        msg = wire(convert.engine_core_outputs_to_proto(outs))
        plain = [o for o in outs.outputs if is_plain(o)]
        detailed = [o for o in outs.outputs if not is_plain(o)]
        assert [o.request_id for o in msg.outputs] == [o.request_id for o in detailed]
        assert msg.HasField("token_columns") == bool(plain)
        cols = msg.token_columns
        assert list(cols.request_ids) == [o.request_id for o in plain]
        assert list(cols.new_token_ids) == [t for o in plain for t in o.new_token_ids]
        counts = [len(o.new_token_ids) for o in plain]
        assert list(cols.num_new_tokens) == ([] if set(counts) <= {1} else counts)
        cached = [o.num_cached_tokens for o in plain]
        assert list(cols.num_cached_tokens) == ([] if set(cached) <= {0} else cached)


def test_decode_step_is_three_flat_columns() -> None:
    outputs = [EngineCoreOutput(f"r{i}", [1000 + i]) for i in range(256)]
    msg = wire(convert.engine_core_outputs_to_proto(EngineCoreOutputs(outputs=outputs)))
    assert not msg.outputs
    cols = msg.token_columns
    assert list(cols.request_ids) == [f"r{i}" for i in range(256)]
    assert list(cols.new_token_ids) == [1000 + i for i in range(256)]
    assert not cols.num_new_tokens and not cols.num_cached_tokens  # one token each, none cached
    back = convert.engine_core_outputs_from_proto(msg)
    assert back.outputs == [] and back.all_outputs() == outputs
    assert back.token_columns == TokenColumns([f"r{i}" for i in range(256)], [1000 + i for i in range(256)])


def test_details_keep_an_output_out_of_the_columns() -> None:
    lp = Logprobs(token_ids=[], logprobs=[], ranks=[])  # empty, but set
    detailed = [
        EngineCoreOutput("lp", [1], new_logprobs=lp),
        EngineCoreOutput("plp", [1], new_prompt_logprobs=lp),
        EngineCoreOutput("fin", [1], finish_reason=FinishReason.LENGTH),
        EngineCoreOutput("stop", [1], stop_reason=0),  # falsy, still a detail
        EngineCoreOutput("trace", [1], trace_headers={"traceparent": "00-a-b-01"}),
    ]
    outs = EngineCoreOutputs(outputs=[*detailed, EngineCoreOutput("plain", [], num_cached_tokens=3)])
    msg = wire(convert.engine_core_outputs_to_proto(outs))
    assert [o.request_id for o in msg.outputs] == [o.request_id for o in detailed]
    assert list(msg.token_columns.request_ids) == ["plain"]
    assert list(msg.token_columns.num_new_tokens) == [0]
    assert_same_step(convert.engine_core_outputs_from_proto(msg), outs)


def rand_columns(rng: random.Random, prefix: str) -> TokenColumns:
    n = rng.randint(1, 30)
    one_token, cached = rng.random() < 0.5, rng.random() < 0.5
    outputs = [rand_plain_output(rng, f"{prefix}-{i}", one_token, cached) for i in range(n)]
    return TokenColumns.from_outputs(outputs)


def test_token_columns_are_their_outputs() -> None:
    rng = random.Random(9)
    for _ in range(ROUNDS):
        one_token, cached = rng.random() < 0.5, rng.random() < 0.5
        outputs = [rand_plain_output(rng, f"r{i}", one_token, cached) for i in range(rng.randint(1, 30))]
        cols = TokenColumns.from_outputs(outputs)
        assert cols.to_outputs() == outputs and len(cols) == len(outputs)
        assert (cols.num_new_tokens is None) == all(len(o.new_token_ids) == 1 for o in outputs)
        assert (cols.num_cached_tokens is None) == all(o.num_cached_tokens == 0 for o in outputs)
        keep = [rng.random() < 0.5 for _ in outputs]
        assert cols.select(keep).to_outputs() == [o for o, k in zip(outputs, keep) if k]
        other = rand_columns(rng, "other")
        assert cols.concat(other).to_outputs() == outputs + other.to_outputs()


def test_domain_columns_round_trip_as_columns() -> None:
    # What the engine builds (columns, plus plain outputs that ended up in outputs) reads
    # back as one TokenColumns: the engine's columns first, then the moved outputs.
    rng = random.Random(10)
    for _ in range(ROUNDS):
        outs = rand_mixed_outputs(rng)
        outs.token_columns = rand_columns(rng, "col")
        back = round_trip(outs)
        assert_same_step(back, outs)
        assert back.token_columns is not None
        moved = [o for o in outs.outputs if is_plain(o)]
        assert back.token_columns.to_outputs() == outs.token_columns.to_outputs() + moved
        assert back.outputs == [o for o in outs.outputs if not is_plain(o)]


def test_request_error_codes_on_the_wire() -> None:
    err = RequestError(ErrorCode.RESOURCE_EXHAUSTED, "queue full", retry_after_ms=250)
    out = EngineCoreOutput("r", [], finish_reason=FinishReason.ERROR, error=err)
    msg = wire(convert.engine_core_outputs_to_proto(EngineCoreOutputs(outputs=[out], draining=True)))
    assert msg.draining and msg.outputs[0].error.code == 8  # google.rpc.Code RESOURCE_EXHAUSTED
    assert msg.outputs[0].error.retry_after_ms == 250
    assert convert.engine_core_outputs_from_proto(msg).outputs == [out]
    unknown = engine_pb2.RequestError(code=99, message="from a newer engine")
    assert convert.request_error_from_proto(unknown).code is ErrorCode.INTERNAL


def test_empty_step_has_no_columns() -> None:
    outs = EngineCoreOutputs(engine_index=2, scheduler_stats=SchedulerStats(num_running_reqs=0))
    msg = wire(convert.engine_core_outputs_to_proto(outs))
    assert not msg.HasField("token_columns") and not msg.outputs
    assert round_trip(outs) == outs
    empty_columns = engine_pb2.EngineCoreOutputs(token_columns=engine_pb2.TokenColumns())
    assert convert.engine_core_outputs_from_proto(wire(empty_columns)).outputs == []


def test_reader_accepts_plain_outputs_as_messages() -> None:
    # Column-eligible outputs sent the detailed way (e.g. by an older engine) read the same.
    plain = EngineCoreOutput("a", [5, 6], num_cached_tokens=16)
    msg = engine_pb2.EngineCoreOutputs(outputs=[convert.engine_core_output_to_proto(plain)])
    assert convert.engine_core_outputs_from_proto(wire(msg)).outputs == [plain]


@pytest.mark.parametrize(
    "columns",
    [
        engine_pb2.TokenColumns(request_ids=["a", "b"], new_token_ids=[1]),
        engine_pb2.TokenColumns(request_ids=["a", "b"], new_token_ids=[1, 2, 3], num_new_tokens=[1]),
        engine_pb2.TokenColumns(request_ids=["a", "b"], new_token_ids=[1, 2, 3], num_new_tokens=[1, 1]),
        engine_pb2.TokenColumns(request_ids=["a", "b"], new_token_ids=[1, 2], num_cached_tokens=[3]),
        engine_pb2.TokenColumns(new_token_ids=[1], num_new_tokens=[1]),
    ],
)
def test_inconsistent_columns_raise(columns: engine_pb2.TokenColumns) -> None:
    with pytest.raises(ConversionError):
        convert.engine_core_outputs_from_proto(engine_pb2.EngineCoreOutputs(token_columns=columns))


def test_stop_reason_and_finish_reason_on_the_wire() -> None:
    token_stop = EngineCoreOutput("a", [2], finish_reason=FinishReason.STOP, stop_reason=0)
    msg = wire(convert.engine_core_output_to_proto(token_stop))
    assert msg.finish_reason == common_pb2.FINISH_REASON_STOP
    assert msg.WhichOneof("stop_reason") == "stop_token_id" and msg.stop_token_id == 0
    string_stop = EngineCoreOutput("a", [], finish_reason=FinishReason.STOP, stop_reason="")
    assert wire(convert.engine_core_output_to_proto(string_stop)).WhichOneof("stop_reason") == "stop_str"
    running = wire(convert.engine_core_output_to_proto(EngineCoreOutput("a", [1])))
    assert running.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert convert.engine_core_output_from_proto(running).finished is False
    # A finish reason from a newer peer still ends the request.
    assert convert.finish_reason_from_proto(99) is FinishReason.ERROR
    assert convert.finish_reason_from_proto(0) is None


def test_empty_containers_read_back_as_none() -> None:
    outs = EngineCoreOutputs(engine_index=1, timestamp=2.0, finished_requests=set())
    back = convert.engine_core_outputs_from_proto(wire(convert.engine_core_outputs_to_proto(outs)))
    assert back.finished_requests is None and back.scheduler_stats is None and back.outputs == []


def test_engine_dead_signal_raises() -> None:
    msg = wire(convert.engine_dead_outputs(3, "CUDA error: out of memory"))
    assert msg.HasField("engine_dead") and not msg.outputs
    with pytest.raises(EngineDeadError) as info:
        convert.engine_core_outputs_from_proto(msg)
    assert info.value.engine_index == 3 and "out of memory" in info.value.message
