"""``vllm.grpc.engine`` messages <-> Tandem's domain types: the protocol's one edge.

Unset proto3 scalars arrive as 0; they are read the way vLLM's reference servicer
reads them: ``temperature`` unset -> 1.0, ``top_p`` 0 -> 1.0, ``top_k`` 0 -> disabled,
``repetition_penalty`` 0 -> 1.0, ``n`` 0 -> 1, ``max_tokens`` unset -> up to the
model's length. Anything the engine cannot serve (text prompts, media, KV transfer)
raises ``InvalidRequestError`` naming the field, which the servicer answers with
INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from tandem.protocol.outputs import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs
from tandem.protocol.pooling_params import PoolingParams
from tandem.protocol.sampling_params import InvalidRequestError, RequestOutputKind, SamplingParams
from tandem.protocol.structured_output import StructuredOutputsParams


@dataclasses.dataclass
class GenerateCall:
    """One ``Generate`` RPC as the engine runs it: ``requests[i]`` is choice ``i``."""

    request_id: str
    requests: list[EngineCoreRequest]
    stream: bool

    @property
    def child_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]


def child_request_id(request_id: str, index: int, n: int) -> str:
    """Choice ``index`` of ``n``: the request id itself when n == 1 (as the frontend
    names its children), so an ``Abort`` naming the request id reaches it."""
    return request_id if n == 1 else f"{index}_{request_id}"


def call_id_of(engine_request_id: str) -> str:
    """The call's request id of a choice (the inverse of ``child_request_id``)."""
    index, sep, rest = engine_request_id.partition("_")
    return rest if sep and index.isdigit() else engine_request_id


def prompt_tokens(msg: vllm_engine_pb2.GenerateRequest | vllm_engine_pb2.EmbedRequest) -> list[int]:
    if isinstance(msg, vllm_engine_pb2.GenerateRequest):
        kind = msg.WhichOneof("input")
        if kind == "text":
            raise InvalidRequestError(
                "text", msg.text[:40], "this engine takes token ids only: send `tokenized.input_ids`"
            )
        if kind is None:
            raise InvalidRequestError("tokenized", None, "the request has no prompt")
    if not msg.tokenized.input_ids:
        raise InvalidRequestError("tokenized.input_ids", [], "the prompt is empty")
    return list(msg.tokenized.input_ids)


def _refuse_unsupported(msg: vllm_engine_pb2.GenerateRequest) -> None:
    if msg.HasField("mm_inputs") or len(msg.extra_mm_inputs) or msg.HasField("media_refs"):
        raise InvalidRequestError("mm_inputs", "<media>", "this engine serves text-only models")
    if msg.HasField("kv_transfer_params") or msg.HasField("kv_transfer_params_json"):
        raise InvalidRequestError("kv_transfer_params", "<set>", "this engine does no KV transfer")
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != 0:
        raise InvalidRequestError("data_parallel_rank", msg.data_parallel_rank, "this engine has one rank (0)")


def _constraint(sp: vllm_engine_pb2.SamplingParams) -> StructuredOutputsParams | None:
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        return StructuredOutputsParams(json=sp.json_schema)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(sp.choice.choices))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True) if sp.json_object else None
    return StructuredOutputsParams(**{kind: getattr(sp, kind)})


def sampling_params_from_proto(sp: vllm_engine_pb2.SamplingParams, stream: bool) -> SamplingParams:
    """The request's SamplingParams (n kept: the caller splits it into choices)."""
    return SamplingParams(
        n=sp.n or 1,
        temperature=sp.temperature if sp.HasField("temperature") else 1.0,
        top_p=sp.top_p or 1.0,
        top_k=sp.top_k or None,
        min_p=sp.min_p,
        seed=sp.seed if sp.HasField("seed") else None,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty or 1.0,
        logit_bias=dict(sp.logit_bias) or None,
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else None,
        min_tokens=sp.min_tokens,
        # The gateway matches stop strings on its own detokenized text; kept for validation.
        stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,
        prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
        skip_special_tokens=sp.skip_special_tokens,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=_constraint(sp),
    )


def generate_call_from_proto(
    msg: vllm_engine_pb2.GenerateRequest, eos_token_ids: Sequence[int]
) -> GenerateCall:
    """One engine request per choice. ``eos_token_ids``: the model's, the first as the
    request's EOS and the others as stop tokens (unless ``ignore_eos``)."""
    if not msg.request_id:
        raise InvalidRequestError("request_id", "", "must not be empty")
    _refuse_unsupported(msg)
    prompt = prompt_tokens(msg)
    sp = msg.sampling_params
    if sp.HasField("truncate_prompt_tokens") and sp.truncate_prompt_tokens > 0:
        prompt = prompt[-sp.truncate_prompt_tokens :]
    params = sampling_params_from_proto(sp, msg.stream)
    if not isinstance(params.n, int) or params.n < 1:
        raise InvalidRequestError("sampling_params.n", params.n, "must be >= 1")
    eos = eos_token_ids[0] if eos_token_ids else None
    if not params.ignore_eos:
        params.stop_token_ids += [t for t in eos_token_ids[1:] if t not in params.stop_token_ids]
    requests = []
    for index in range(params.n):
        child = dataclasses.replace(
            params,
            n=1,
            seed=None if params.seed is None else params.seed + index,
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
        )
        requests.append(
            EngineCoreRequest(
                child_request_id(msg.request_id, index, params.n), list(prompt), child,
                eos_token_id=eos, external_req_id=msg.request_id,
            )
        )
    return GenerateCall(msg.request_id, requests, msg.stream)


def embed_request_from_proto(msg: vllm_engine_pb2.EmbedRequest) -> EngineCoreRequest:
    if not msg.request_id:
        raise InvalidRequestError("request_id", "", "must not be empty")
    return EngineCoreRequest(
        msg.request_id, prompt_tokens(msg), SamplingParams(max_tokens=1),
        external_req_id=msg.request_id, pooling_params=PoolingParams(),
    )


# ---- outputs ------------------------------------------------------------------------------

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


@dataclasses.dataclass
class ChoiceState:
    """What one choice produced so far (the completion's counts and logprobs)."""

    index: int
    prompt_len: int
    output_ids: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    prompt_logprobs: Logprobs | None = None
    logprobs: list[Logprobs] = dataclasses.field(default_factory=list)
    sent_first: bool = False


def _output_logprobs(parts: Sequence[Logprobs]) -> vllm_engine_pb2.OutputLogProbs | None:
    if not parts:
        return None
    out = vllm_engine_pb2.OutputLogProbs()
    for part in parts:
        for ids, values in zip(part.token_ids, part.logprobs, strict=True):
            out.token_ids.append(ids[0])
            out.token_logprobs.append(values[0])
            out.top_logprobs.append(vllm_engine_pb2.TopLogProbs(values=values[1:], token_ids=ids[1:]))
    return out


def _input_logprobs(
    logprobs: Logprobs | None, prompt: Sequence[int]
) -> vllm_engine_pb2.InputLogProbs | None:
    """Row i of the domain's prompt logprobs is prompt position i + 1; position 0 has none."""
    if logprobs is None:
        return None
    out = vllm_engine_pb2.InputLogProbs(token_ids=list(prompt))
    out.token_logprobs.append(vllm_engine_pb2.InputTokenLogProb())
    out.top_logprobs.append(vllm_engine_pb2.TopLogProbs())
    for ids, values in zip(logprobs.token_ids, logprobs.logprobs, strict=True):
        out.token_logprobs.append(vllm_engine_pb2.InputTokenLogProb(value=values[0]))
        out.top_logprobs.append(vllm_engine_pb2.TopLogProbs(values=values[1:], token_ids=ids[1:]))
    return out


def absorb(state: ChoiceState, out: EngineCoreOutput) -> None:
    """Fold one step's output of this choice into its state."""
    state.output_ids.extend(out.new_token_ids)
    if out.num_cached_tokens:
        state.cached_tokens = out.num_cached_tokens
    if out.new_prompt_logprobs is not None:
        state.prompt_logprobs = out.new_prompt_logprobs
    if out.new_logprobs is not None:
        state.logprobs.append(out.new_logprobs)


def stream_chunk(
    state: ChoiceState, out: EngineCoreOutput, prompt: Sequence[int]
) -> vllm_engine_pb2.GenerateResponse:
    """The delta of one step (as vLLM's servicer: ``completion_tokens`` counts the delta,
    the gateway adds them up; prompt logprobs ride on a choice's first chunk)."""
    chunk = vllm_engine_pb2.GenerateStreamChunk(
        token_ids=out.new_token_ids,
        prompt_tokens=state.prompt_len,
        completion_tokens=len(out.new_token_ids),
        cached_tokens=state.cached_tokens,
        index=state.index,
    )
    step_logprobs = _output_logprobs([out.new_logprobs] if out.new_logprobs is not None else [])
    if step_logprobs is not None:
        chunk.output_logprobs.CopyFrom(step_logprobs)
    if not state.sent_first:
        state.sent_first = True
        inputs = _input_logprobs(state.prompt_logprobs, prompt)
        if inputs is not None:
            chunk.input_logprobs.CopyFrom(inputs)
    return vllm_engine_pb2.GenerateResponse(chunk=chunk)


def complete(
    state: ChoiceState, out: EngineCoreOutput, prompt: Sequence[int], stream: bool
) -> vllm_engine_pb2.GenerateResponse:
    """A choice's end. Streaming: its ids are the last delta (the chunks carried the
    rest); otherwise the whole completion, with logprobs."""
    ids = out.new_token_ids if stream else state.output_ids
    done = vllm_engine_pb2.GenerateComplete(
        output_ids=ids,
        finish_reason=FINISH_REASONS[out.finish_reason or FinishReason.STOP],
        prompt_tokens=state.prompt_len,
        completion_tokens=len(ids),
        cached_tokens=state.cached_tokens,
        index=state.index,
    )
    if isinstance(out.stop_reason, int) and not isinstance(out.stop_reason, bool):
        done.matched_token_id = out.stop_reason
    elif isinstance(out.stop_reason, str) and out.finish_reason == FinishReason.STOP:
        done.matched_stop_str = out.stop_reason
    if not stream:
        outputs = _output_logprobs(state.logprobs)
        if outputs is not None:
            done.output_logprobs.CopyFrom(outputs)
        inputs = _input_logprobs(state.prompt_logprobs, prompt)
        if inputs is not None:
            done.input_logprobs.CopyFrom(inputs)
    return vllm_engine_pb2.GenerateResponse(complete=done)


def embed_response(out: EngineCoreOutput, prompt_len: int) -> vllm_engine_pb2.EmbedResponse:
    vector = out.pooling_output or []
    return vllm_engine_pb2.EmbedResponse(embedding=vector, prompt_tokens=prompt_len, embedding_dim=len(vector))


def flush_cache_response(success: bool, message: str) -> common_pb2.FlushCacheResponse:
    return common_pb2.FlushCacheResponse(success=success, message=message)
