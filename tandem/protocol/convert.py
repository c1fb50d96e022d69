"""Conversions between the engine's domain dataclasses and ``tandem.v1`` messages.

Pure functions, both directions. The engine-step path (EngineCoreOutputs and its
parts) runs once per step for every request in the batch, so it builds messages
with constructor keywords and hands whole lists to packed repeated fields, leaving
the per-element work to protobuf's C code.

Mapping rules, where the two sides differ:
- Domain ``None`` <-> proto ``optional`` field not set. Unset optional fields with
  a non-None domain default (temperature, top_p, ...) read back as that default;
  ``max_tokens`` not set means no limit (``None``), as the proto documents.
- Empty proto containers read back as ``None`` where the domain field is optional
  (logit_bias, allowed_token_ids, trace_headers, finished_requests).
- ``RequestOutputKind`` is shifted by one on the wire (0 is OUTPUT_KIND_UNSPECIFIED,
  read as DELTA: a gRPC stream that did not choose gets only what is new in each
  message; the domain default, for the in-process ``LLM``, stays vLLM's CUMULATIVE). ``FinishReason`` values are equal on both sides, 0 = None.
- Logprobs are float32 on the wire: values read back rounded to float32.
- EngineCoreOutputs: outputs with nothing but new tokens and a cached-token count
  travel in ``token_columns`` (flat packed arrays), the others as EngineCoreOutput
  messages. The domain side has the same split (``EngineCoreOutputs.token_columns``,
  a ``TokenColumns`` of lists): the reader hands the columns on as columns, so a
  plain decode step costs no object per request on either side; plain outputs found
  in ``outputs`` are moved into the columns when sent.
- Fields that only exist on the wire (EngineCoreRequest.data_parallel_rank,
  pooling_params, EngineCoreOutputs.engine_dead) have keyword arguments or raise;
  they have no domain twin.

Malformed messages raise ``ConversionError``; request fields a client could get
wrong raise ``InvalidRequestError`` (gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, compress
from operator import attrgetter, not_
from typing import Any

from tandem.protocol.kv_transfer import KvTransferParams
from tandem.protocol.lora import LoRARequest
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
from tandem.protocol.pooling_params import PoolingParams
from tandem.protocol.sampling_params import (
    InvalidRequestError,
    RequestOutputKind,
    SamplingDefaults,
    SamplingParams,
    int64_seed,
)
from tandem.protocol.structured_output import StructuredOutputsParams
from tandem.v1 import common_pb2, engine_pb2, kv_transfer_pb2

__all__ = [
    "ConversionError",
    "EngineDeadError",
    "abort_input",
    "add_input",
    "engine_core_output_from_proto",
    "engine_core_output_to_proto",
    "engine_core_outputs_from_proto",
    "engine_core_outputs_to_proto",
    "engine_core_request_from_proto",
    "engine_core_request_to_proto",
    "engine_dead_outputs",
    "finish_reason_from_proto",
    "finish_reason_to_proto",
    "hello_input",
    "logprobs_from_proto",
    "logprobs_to_proto",
    "output_kind_from_proto",
    "output_kind_to_proto",
    "pooling_params_from_proto",
    "pooling_params_to_proto",
    "request_error_from_proto",
    "request_error_to_proto",
    "sampling_params_from_proto",
    "sampling_params_to_proto",
    "scheduler_stats_from_proto",
    "scheduler_stats_to_proto",
    "structured_outputs_from_proto",
    "structured_outputs_to_proto",
    "token_columns_from_proto",
    "token_columns_to_proto",
    "utility_call_from_proto",
    "utility_call_to_proto",
    "utility_input",
    "utility_output_from_proto",
    "utility_output_to_proto",
    "utility_value_from_proto",
    "utility_value_to_proto",
]


class ConversionError(ValueError):
    """A protobuf message is malformed (violates a documented layout invariant)."""


class EngineDeadError(RuntimeError):
    """The engine said it is failing (EngineCoreOutputs.engine_dead was set)."""

    def __init__(self, engine_index: int, message: str) -> None:
        self.engine_index = engine_index
        self.message = message
        super().__init__(f"engine {engine_index} died: {message}")


# Domain defaults that unset optional proto fields stand for.
_SP_DEFAULTS = SamplingParams()
_NO_MODEL_DEFAULTS = SamplingDefaults()
_MAX_FINISH_REASON = max(FinishReason)
_NUM_OUTPUT_KINDS = len(RequestOutputKind)


# ---- enums ------------------------------------------------------------------


def output_kind_to_proto(kind: RequestOutputKind) -> int:
    """Domain RequestOutputKind -> common_pb2.OutputKind value (never UNSPECIFIED)."""
    return int(kind) + 1


def output_kind_from_proto(value: int) -> RequestOutputKind:
    """common_pb2.OutputKind value -> domain; UNSPECIFIED is DELTA (the API's default)."""
    if value == common_pb2.OUTPUT_KIND_UNSPECIFIED:
        return RequestOutputKind.DELTA
    if not 0 < value <= _NUM_OUTPUT_KINDS:
        raise InvalidRequestError("output_kind", value, "unknown output kind")
    return RequestOutputKind(value - 1)


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    """Domain FinishReason (None: not finished) -> common_pb2.FinishReason value."""
    return 0 if reason is None else int(reason)


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """common_pb2.FinishReason value -> domain; 0 is None (not finished).

    A non-zero value this code does not know still means "finished" (the proto's
    compatibility rule); it reads as ERROR so that the request is not left hanging.
    """
    if value == 0:
        return None
    if 0 < value <= _MAX_FINISH_REASON:
        return FinishReason(value)
    return FinishReason.ERROR


# ---- sampling params and requests ------------------------------------------


def sampling_params_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    """Every field is written explicitly, so the reader needs no shared defaults."""
    return common_pb2.SamplingParams(
        n=sp.n,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        seed=None if sp.seed is None else int64_seed(sp.seed),
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        logit_bias=sp.logit_bias,
        allowed_token_ids=sp.allowed_token_ids,
        max_tokens=sp.max_tokens,
        min_tokens=sp.min_tokens,
        stop=sp.stop,
        stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        logprobs=sp.logprobs,
        prompt_logprobs=sp.prompt_logprobs,
        skip_special_tokens=sp.skip_special_tokens,
        detokenize=sp.detokenize,
        output_kind=output_kind_to_proto(sp.output_kind),
        structured_outputs=structured_outputs_to_proto(sp.structured_outputs),
        speculative=sp.speculative,
    )


def structured_outputs_to_proto(
    so: StructuredOutputsParams | None,
) -> common_pb2.StructuredOutputs | None:
    """Domain constraint -> proto (None stays unset). Call ``validate`` first."""
    if so is None:
        return None
    kind = so.kind
    value: Any = so.spec()
    if kind == "choice":
        value = common_pb2.ChoiceList(choices=so.choice)
    elif kind == "json_object":
        value = True
    return common_pb2.StructuredOutputs(
        **{kind: value}, disable_any_whitespace=so.disable_any_whitespace
    )


def structured_outputs_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputsParams | None:
    """Proto -> domain; an empty message (no kind set) is None. Does not validate."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    value: Any = getattr(msg, kind)
    if kind == "choice":
        value = list(msg.choice.choices)
    elif kind == "json_object":
        value = True
    return StructuredOutputsParams(
        **{kind: value}, disable_any_whitespace=msg.disable_any_whitespace
    )


def sampling_params_from_proto(
    msg: common_pb2.SamplingParams, defaults: SamplingDefaults | None = None
) -> SamplingParams:
    """Unset fields take the model's own settings (``defaults``, from its generation
    config) where it has them, else the proto's documented defaults. Does not validate
    ranges: call ``SamplingParams.validate`` on the result."""
    has = msg.HasField
    d = _SP_DEFAULTS
    own = defaults or _NO_MODEL_DEFAULTS

    def sampling(name: str, fallback: Any) -> Any:
        return own.pick(name, getattr(msg, name) if has(name) else None, fallback)

    return SamplingParams(
        n=msg.n if msg.HasField("n") else 1,
        temperature=sampling("temperature", d.temperature),
        top_p=sampling("top_p", d.top_p),
        top_k=sampling("top_k", None),
        min_p=sampling("min_p", d.min_p),
        seed=msg.seed if has("seed") else None,
        presence_penalty=msg.presence_penalty if has("presence_penalty") else d.presence_penalty,
        frequency_penalty=(
            msg.frequency_penalty if has("frequency_penalty") else d.frequency_penalty
        ),
        repetition_penalty=sampling("repetition_penalty", d.repetition_penalty),
        logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        max_tokens=msg.max_tokens if has("max_tokens") else None,
        min_tokens=msg.min_tokens,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logprobs=msg.logprobs if has("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if has("prompt_logprobs") else None,
        skip_special_tokens=(
            msg.skip_special_tokens if has("skip_special_tokens") else d.skip_special_tokens
        ),
        detokenize=msg.detokenize if has("detokenize") else d.detokenize,
        speculative=msg.speculative if has("speculative") else True,
        output_kind=output_kind_from_proto(msg.output_kind),
        structured_outputs=(
            structured_outputs_from_proto(msg.structured_outputs)
            if has("structured_outputs")
            else None
        ),
    )


_POOLING_TYPES = {"LAST": common_pb2.POOLING_TYPE_LAST, "MEAN": common_pb2.POOLING_TYPE_MEAN,
                  "CLS": common_pb2.POOLING_TYPE_CLS}
_POOLING_NAMES = {v: k for k, v in _POOLING_TYPES.items()}


def pooling_params_to_proto(pp: PoolingParams) -> common_pb2.PoolingParams:
    return common_pb2.PoolingParams(
        task=pp.task,
        pooling_type=_POOLING_TYPES.get(pp.pooling_type, common_pb2.POOLING_TYPE_UNSPECIFIED),
        normalize=pp.normalize,
        dimensions=pp.dimensions,
    )


def pooling_params_from_proto(msg: common_pb2.PoolingParams) -> PoolingParams:
    """Unset fields take the documented defaults. Does not validate ranges."""
    pooling_type = msg.pooling_type
    if pooling_type == common_pb2.POOLING_TYPE_UNSPECIFIED:
        pooling_type = common_pb2.POOLING_TYPE_LAST
    if pooling_type not in _POOLING_NAMES:
        raise InvalidRequestError("pooling_params.pooling_type", pooling_type, "unknown pooling type")
    return PoolingParams(
        task=msg.task or "embed",
        pooling_type=_POOLING_NAMES[pooling_type],  # type: ignore[arg-type]
        normalize=msg.normalize if msg.HasField("normalize") else True,
        dimensions=msg.dimensions if msg.HasField("dimensions") else None,
    )


def lora_request_to_proto(req: LoRARequest) -> common_pb2.LoRARequest:
    return common_pb2.LoRARequest(
        lora_name=req.lora_name, lora_int_id=req.lora_int_id, lora_path=req.lora_path
    )


def lora_request_from_proto(msg: common_pb2.LoRARequest, field: str = "lora_request") -> LoRARequest:
    """Raises InvalidRequestError naming ``field.<attribute>`` when it is malformed."""
    req = LoRARequest(msg.lora_name, msg.lora_int_id, msg.lora_path)
    req.validate(field)
    return req


def engine_core_request_to_proto(
    req: EngineCoreRequest, data_parallel_rank: int | None = None
) -> engine_pb2.EngineCoreRequest:
    pooling = req.pooling_params
    return engine_pb2.EngineCoreRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling_params=None if pooling is not None else sampling_params_to_proto(req.sampling_params),
        pooling_params=None if pooling is None else pooling_params_to_proto(pooling),
        eos_token_id=req.eos_token_id,
        arrival_time=req.arrival_time,
        priority=req.priority,
        cache_salt=req.cache_salt,
        client_index=req.client_index,
        external_req_id=req.external_req_id,
        trace_headers=req.trace_headers,
        data_parallel_rank=data_parallel_rank,
        timeout_s=req.timeout_s,
        lora_request=lora_request_to_proto(req.lora_request) if req.lora_request is not None else None,
        resumable=req.resumable,
        generated_token_ids=req.generated_token_ids,
        kv_transfer_params=(
            None if req.kv_transfer_params is None else kv_transfer_params_to_proto(req.kv_transfer_params)
        ),
    )


def engine_core_request_from_proto(msg: engine_pb2.EngineCoreRequest) -> EngineCoreRequest:
    """Raises InvalidRequestError when the request has neither sampling nor pooling
    params. A pooling request gets default (unused) sampling params.
    ``data_parallel_rank`` is routing information and is not carried over; read it
    from the message."""
    params = msg.WhichOneof("params")
    if params is None:
        raise InvalidRequestError("sampling_params", None, "is required (or pooling_params)")
    pooling = pooling_params_from_proto(msg.pooling_params) if params == "pooling_params" else None
    return EngineCoreRequest(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling_params=(
            SamplingParams(max_tokens=1) if pooling is not None else sampling_params_from_proto(msg.sampling_params)
        ),
        pooling_params=pooling,
        eos_token_id=msg.eos_token_id if msg.HasField("eos_token_id") else None,
        arrival_time=msg.arrival_time,
        priority=msg.priority,
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
        client_index=msg.client_index,
        external_req_id=msg.external_req_id if msg.HasField("external_req_id") else None,
        trace_headers=dict(msg.trace_headers) or None,
        timeout_s=msg.timeout_s if msg.HasField("timeout_s") else None,
        lora_request=lora_request_from_proto(msg.lora_request) if msg.HasField("lora_request") else None,
        resumable=msg.resumable,
        generated_token_ids=list(msg.generated_token_ids),
        kv_transfer_params=(
            kv_transfer_params_from_proto(msg.kv_transfer_params) if msg.HasField("kv_transfer_params") else None
        ),
    )


def kv_transfer_params_to_proto(params: KvTransferParams) -> kv_transfer_pb2.KvTransferParams:
    return kv_transfer_pb2.KvTransferParams(
        do_remote_decode=params.do_remote_decode,
        do_remote_prefill=params.do_remote_prefill,
        remote_engine_id=params.remote_engine_id,
        remote_address=params.remote_address,
        remote_request_id=params.remote_request_id,
        remote_block_ids=params.remote_block_ids,
        block_hashes=params.block_hashes,
        num_tokens=params.num_tokens,
        block_size=params.block_size,
        expires_at=params.expires_at,
        transfer_secret=params.transfer_secret,
    )


def kv_transfer_params_from_proto(msg: kv_transfer_pb2.KvTransferParams) -> KvTransferParams:
    return KvTransferParams(
        do_remote_decode=msg.do_remote_decode,
        do_remote_prefill=msg.do_remote_prefill,
        remote_engine_id=msg.remote_engine_id,
        remote_address=msg.remote_address,
        remote_request_id=msg.remote_request_id,
        remote_block_ids=list(msg.remote_block_ids),
        block_hashes=list(msg.block_hashes),
        num_tokens=msg.num_tokens,
        block_size=msg.block_size,
        expires_at=msg.expires_at,
        transfer_secret=msg.transfer_secret,
    )


# ---- engine inputs ----------------------------------------------------------


def hello_input(
    client_index: int, tokenizer_fingerprint: str = "", output_window: int = 0
) -> engine_pb2.EngineCoreInput:
    return engine_pb2.EngineCoreInput(
        hello=engine_pb2.Hello(
            client_index=client_index, tokenizer_fingerprint=tokenizer_fingerprint,
            output_window=output_window,
        )
    )


def ack_input(count: int = 1) -> engine_pb2.EngineCoreInput:
    return engine_pb2.EngineCoreInput(ack=engine_pb2.OutputsAck(count=count))


def batch_input(inputs: Sequence[engine_pb2.EngineCoreInput]) -> engine_pb2.EngineCoreInput:
    return engine_pb2.EngineCoreInput(batch=engine_pb2.InputBatch(inputs=inputs))


def add_input(
    req: EngineCoreRequest, data_parallel_rank: int | None = None
) -> engine_pb2.EngineCoreInput:
    return engine_pb2.EngineCoreInput(add=engine_core_request_to_proto(req, data_parallel_rank))


def abort_input(request_ids: Iterable[str]) -> engine_pb2.EngineCoreInput:
    return engine_pb2.EngineCoreInput(abort=engine_pb2.AbortRequests(request_ids=request_ids))


def utility_input(call_id: int, method: str, args: Sequence[Any] = ()) -> engine_pb2.EngineCoreInput:
    return engine_pb2.EngineCoreInput(utility=utility_call_to_proto(call_id, method, args))


# ---- utility calls ----------------------------------------------------------


def utility_value_to_proto(value: Any) -> engine_pb2.UtilityValue:
    """None, bool, int, float, str, bytes, LoRARequest, and lists/tuples of these (nested)."""
    # bool before int: bool is a subclass of int.
    if value is None:
        return engine_pb2.UtilityValue()
    if isinstance(value, bool):
        return engine_pb2.UtilityValue(bool_value=value)
    if isinstance(value, int):
        return engine_pb2.UtilityValue(int_value=value)
    if isinstance(value, float):
        return engine_pb2.UtilityValue(float_value=value)
    if isinstance(value, str):
        return engine_pb2.UtilityValue(string_value=value)
    if isinstance(value, bytes | bytearray | memoryview):
        return engine_pb2.UtilityValue(bytes_value=bytes(value))
    if isinstance(value, LoRARequest):
        return engine_pb2.UtilityValue(lora_request=lora_request_to_proto(value))
    if isinstance(value, list | tuple | set | frozenset):
        return engine_pb2.UtilityValue(
            list_value=engine_pb2.UtilityValueList(
                values=[utility_value_to_proto(v) for v in value]
            )
        )
    raise TypeError(f"utility value of type {type(value).__name__} has no wire form")


def utility_value_from_proto(msg: engine_pb2.UtilityValue) -> Any:
    """Sequences read back as lists."""
    kind = msg.WhichOneof("value")
    if kind is None:
        return None
    if kind == "list_value":
        return [utility_value_from_proto(v) for v in msg.list_value.values]
    if kind == "lora_request":
        return lora_request_from_proto(msg.lora_request)
    return getattr(msg, kind)


def utility_call_to_proto(
    call_id: int, method: str, args: Sequence[Any] = ()
) -> engine_pb2.UtilityCall:
    return engine_pb2.UtilityCall(
        call_id=call_id, method=method, args=[utility_value_to_proto(a) for a in args]
    )


def utility_call_from_proto(msg: engine_pb2.UtilityCall) -> tuple[int, str, list[Any]]:
    """Returns (call_id, method, args)."""
    return msg.call_id, msg.method, [utility_value_from_proto(a) for a in msg.args]


def utility_output_to_proto(out: UtilityOutput) -> engine_pb2.UtilityOutput:
    """A failure message wins over a result (the result of a failed call is meaningless)."""
    if out.failure_message is not None:
        return engine_pb2.UtilityOutput(call_id=out.call_id, failure_message=out.failure_message)
    if out.result is None:
        return engine_pb2.UtilityOutput(call_id=out.call_id)
    return engine_pb2.UtilityOutput(call_id=out.call_id, result=utility_value_to_proto(out.result))


def utility_output_from_proto(msg: engine_pb2.UtilityOutput) -> UtilityOutput:
    outcome = msg.WhichOneof("outcome")
    if outcome == "failure_message":
        return UtilityOutput(call_id=msg.call_id, failure_message=msg.failure_message)
    if outcome == "result":
        return UtilityOutput(call_id=msg.call_id, result=utility_value_from_proto(msg.result))
    return UtilityOutput(call_id=msg.call_id)


# ---- engine outputs (hot path) ---------------------------------------------


def logprobs_to_proto(lp: Logprobs) -> common_pb2.Logprobs:
    """Flattens the [P, C] rows row-major. Raises ConversionError on ragged rows."""
    rows = lp.token_ids
    num_columns = len(rows[0]) if rows else 0
    num_positions = len(lp.ranks)
    token_ids = list(chain.from_iterable(rows))
    logprobs = list(chain.from_iterable(lp.logprobs))
    expected = num_positions * num_columns
    if (
        len(rows) != num_positions
        or len(token_ids) != expected
        or len(logprobs) != expected
        or len(set(map(len, rows))) > 1
    ):
        raise ConversionError(
            f"logprobs are not a [{num_positions}, {num_columns}] table: {len(rows)} rows, "
            f"{len(token_ids)} token ids, {len(logprobs)} logprobs"
        )
    return common_pb2.Logprobs(
        token_ids=token_ids, logprobs=logprobs, ranks=lp.ranks, num_columns=num_columns
    )


def _rows(flat: list[Any], num_columns: int) -> list[list[Any]]:
    # zip over C references to one iterator yields consecutive C-tuples: row-major rows.
    return list(map(list, zip(*[iter(flat)] * num_columns)))


def logprobs_from_proto(msg: common_pb2.Logprobs) -> Logprobs:
    """Raises ConversionError unless len(token_ids) == len(logprobs) == P * C."""
    ranks = list(msg.ranks)
    num_columns = msg.num_columns
    token_ids = list(msg.token_ids)
    logprobs = list(msg.logprobs)
    expected = len(ranks) * num_columns
    if len(token_ids) != expected or len(logprobs) != expected or (ranks and not num_columns):
        raise ConversionError(
            f"Logprobs with {len(ranks)} positions and {num_columns} columns needs "
            f"{expected} entries, got {len(token_ids)} token ids and {len(logprobs)} logprobs"
        )
    if not ranks:
        return Logprobs(token_ids=[], logprobs=[], ranks=[])
    return Logprobs(
        token_ids=_rows(token_ids, num_columns),
        logprobs=_rows(logprobs, num_columns),
        ranks=ranks,
    )


def engine_core_output_to_proto(out: EngineCoreOutput) -> engine_pb2.EngineCoreOutput:
    stop = out.stop_reason
    return engine_pb2.EngineCoreOutput(
        request_id=out.request_id,
        new_token_ids=out.new_token_ids,
        new_logprobs=None if out.new_logprobs is None else logprobs_to_proto(out.new_logprobs),
        new_prompt_logprobs=(
            None if out.new_prompt_logprobs is None else logprobs_to_proto(out.new_prompt_logprobs)
        ),
        finish_reason=0 if out.finish_reason is None else out.finish_reason,
        stop_token_id=stop if isinstance(stop, int) else None,
        stop_str=stop if isinstance(stop, str) else None,
        num_cached_tokens=out.num_cached_tokens,
        trace_headers=out.trace_headers,
        error=None if out.error is None else request_error_to_proto(out.error),
        pooling_output=out.pooling_output,
        kv_transfer_params=(
            None if out.kv_transfer_params is None else kv_transfer_params_to_proto(out.kv_transfer_params)
        ),
    )


def engine_core_output_from_proto(msg: engine_pb2.EngineCoreOutput) -> EngineCoreOutput:
    has = msg.HasField
    stop_kind = msg.WhichOneof("stop_reason")
    return EngineCoreOutput(
        request_id=msg.request_id,
        new_token_ids=list(msg.new_token_ids),
        new_logprobs=logprobs_from_proto(msg.new_logprobs) if has("new_logprobs") else None,
        new_prompt_logprobs=(
            logprobs_from_proto(msg.new_prompt_logprobs) if has("new_prompt_logprobs") else None
        ),
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        stop_reason=None if stop_kind is None else getattr(msg, stop_kind),
        num_cached_tokens=msg.num_cached_tokens,
        trace_headers=dict(msg.trace_headers) or None,
        error=request_error_from_proto(msg.error) if has("error") else None,
        pooling_output=list(msg.pooling_output) if msg.pooling_output else None,
        kv_transfer_params=(
            kv_transfer_params_from_proto(msg.kv_transfer_params) if has("kv_transfer_params") else None
        ),
    )


def request_error_to_proto(err: RequestError) -> engine_pb2.RequestError:
    return engine_pb2.RequestError(
        code=int(err.code), message=err.message, retry_after_ms=err.retry_after_ms
    )


def request_error_from_proto(msg: engine_pb2.RequestError) -> RequestError:
    """A code this side does not know reads as INTERNAL."""
    try:
        code = ErrorCode(msg.code)
    except ValueError:
        code = ErrorCode.INTERNAL
    return RequestError(code, msg.message, msg.retry_after_ms)


def scheduler_stats_to_proto(stats: SchedulerStats) -> engine_pb2.SchedulerStats:
    return engine_pb2.SchedulerStats(
        num_running_reqs=stats.num_running_reqs,
        num_waiting_reqs=stats.num_waiting_reqs,
        kv_cache_usage=stats.kv_cache_usage,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_preemptions=stats.num_preemptions,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
    )


def scheduler_stats_from_proto(msg: engine_pb2.SchedulerStats) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=msg.num_running_reqs,
        num_waiting_reqs=msg.num_waiting_reqs,
        kv_cache_usage=msg.kv_cache_usage,
        prefix_cache_queries=msg.prefix_cache_queries,
        prefix_cache_hits=msg.prefix_cache_hits,
        num_preemptions=msg.num_preemptions,
        num_free_blocks=msg.num_free_blocks,
        num_total_blocks=msg.num_total_blocks,
    )


# The fields an output must have unset (None) to travel in TokenColumns. An empty
# trace_headers dict does not count as unset here; it goes the detailed way and
# reads back as None, as it always did.
_detail_fields = attrgetter(
    "new_logprobs", "new_prompt_logprobs", "finish_reason", "stop_reason", "trace_headers", "error",
    "pooling_output", "kv_transfer_params",
)
_NO_DETAILS = (None,) * 8


def _split_plain(
    outputs: list[EngineCoreOutput],
) -> tuple[list[EngineCoreOutput], list[EngineCoreOutput]]:
    """(column-eligible outputs, the others), each in the original order."""
    details = list(map(_detail_fields, outputs))
    num_plain = details.count(_NO_DETAILS)  # C-level comparisons, no Python loop
    if num_plain == len(outputs):
        return outputs, []
    if num_plain == 0:
        return [], outputs
    mask = [d == _NO_DETAILS for d in details]
    return list(compress(outputs, mask)), list(compress(outputs, map(not_, mask)))


def _token_columns_fields(cols: TokenColumns) -> dict[str, list[Any] | None]:
    """TokenColumns' fields by name. Whole lists go to protobuf's C code; a None
    column is sent empty. Passed as a dict to the enclosing message's constructor,
    they are written in place (a TokenColumns message would be copied once more)."""
    return {
        "request_ids": cols.request_ids,
        "num_new_tokens": cols.num_new_tokens,
        "new_token_ids": cols.new_token_ids,
        "num_cached_tokens": cols.num_cached_tokens,
    }


def token_columns_to_proto(cols: TokenColumns) -> engine_pb2.TokenColumns:
    return engine_pb2.TokenColumns(**_token_columns_fields(cols))


def token_columns_from_proto(msg: engine_pb2.TokenColumns) -> TokenColumns:
    """Raises ConversionError when the columns' lengths disagree. (Slicing a
    repeated field makes its list in C, faster than ``list()``.)"""
    request_ids = msg.request_ids[:]
    n = len(request_ids)
    tokens = msg.new_token_ids[:]
    counts: list[int] | None = msg.num_new_tokens[:] or None
    if counts is None:
        if len(tokens) != n:
            raise ConversionError(f"TokenColumns: {n} requests but {len(tokens)} tokens")
    elif len(counts) != n or sum(counts) != len(tokens):
        raise ConversionError(
            f"TokenColumns: {n} requests, {len(counts)} token counts summing to "
            f"{sum(counts)}, {len(tokens)} tokens"
        )
    cached: list[int] | None = msg.num_cached_tokens[:] or None
    if cached is not None and len(cached) != n:
        raise ConversionError(f"TokenColumns: {n} requests but {len(cached)} cached counts")
    return TokenColumns(request_ids, tokens, counts, cached)


def engine_core_outputs_to_proto(outs: EngineCoreOutputs) -> engine_pb2.EngineCoreOutputs:
    """``token_columns`` and any output in ``outputs`` that carries only new tokens
    go into token_columns, the rest into outputs."""
    stats = outs.scheduler_stats
    utility = outs.utility_output
    columns = outs.token_columns
    plain, detailed = _split_plain(outs.outputs)
    if plain:
        extra = TokenColumns.from_outputs(plain)
        columns = extra if columns is None else columns.concat(extra)
    return engine_pb2.EngineCoreOutputs(
        engine_index=outs.engine_index,
        outputs=[engine_core_output_to_proto(o) for o in detailed],
        token_columns=None if columns is None else _token_columns_fields(columns),
        scheduler_stats=None if stats is None else scheduler_stats_to_proto(stats),
        timestamp=outs.timestamp,
        utility_output=None if utility is None else utility_output_to_proto(utility),
        finished_requests=outs.finished_requests,
        draining=outs.draining,
        num_steps=outs.num_steps if outs.num_steps > 1 else 0,
    )


def engine_core_outputs_from_proto(msg: engine_pb2.EngineCoreOutputs) -> EngineCoreOutputs:
    """Raises EngineDeadError if the message is the engine-dead signal. The column
    outputs stay columns (no object per request); empty columns read as None."""
    has = msg.HasField
    if has("engine_dead"):
        raise EngineDeadError(msg.engine_index, msg.engine_dead.message)
    columns = token_columns_from_proto(msg.token_columns) if has("token_columns") else None
    return EngineCoreOutputs(
        engine_index=msg.engine_index,
        outputs=list(map(engine_core_output_from_proto, msg.outputs)),
        scheduler_stats=(
            scheduler_stats_from_proto(msg.scheduler_stats) if has("scheduler_stats") else None
        ),
        timestamp=msg.timestamp,
        utility_output=(
            utility_output_from_proto(msg.utility_output) if has("utility_output") else None
        ),
        finished_requests=set(msg.finished_requests) or None,
        draining=msg.draining,
        token_columns=columns if columns else None,
        num_steps=msg.num_steps or 1,
    )


def engine_dead_outputs(
    engine_index: int, message: str, timestamp: float = 0.0
) -> engine_pb2.EngineCoreOutputs:
    """The last message an engine sends on a stream before ending it because it failed."""
    return engine_pb2.EngineCoreOutputs(
        engine_index=engine_index,
        timestamp=timestamp,
        engine_dead=engine_pb2.EngineDead(message=message),
    )
