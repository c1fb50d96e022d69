"""Conversions between the public ``tandem.v1`` frontend messages and domain objects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend_service.outputs import CompletionOutput, Logprob, RequestOutput
from frontend_service.sessions import SessionChunk
from tandem.protocol import convert
from tandem.protocol.sampling_params import InvalidRequestError, SamplingDefaults, SamplingParams
from tandem.v1 import common_pb2, frontend_pb2


@dataclass
class GenerateArgs:
    """A GenerateRequest in domain terms: keyword arguments of AsyncLLM.generate."""

    sampling_params: SamplingParams
    kwargs: dict[str, Any]


def generate_args_from_proto(
    msg: frontend_pb2.GenerateRequest, defaults: SamplingDefaults | None = None
) -> GenerateArgs:
    # No sampling_params reads as an empty message: every field its documented default
    # (output_kind DELTA included), or the model's own setting (``defaults``).
    params = convert.sampling_params_from_proto(msg.sampling_params, defaults)
    kind = msg.WhichOneof("input")
    kwargs: dict[str, Any] = {
        "request_id": msg.request_id if msg.HasField("request_id") else None,
        "priority": msg.priority,
        "cache_salt": msg.cache_salt if msg.HasField("cache_salt") else None,
        "add_special_tokens": msg.add_special_tokens if msg.HasField("add_special_tokens") else None,
        "add_generation_prompt": (
            msg.add_generation_prompt if msg.HasField("add_generation_prompt") else None
        ),
    }
    if msg.HasField("lora_request"):
        kwargs["lora_request"] = convert.lora_request_from_proto(msg.lora_request)
    if kind == "prompt":
        kwargs["prompt"] = msg.prompt
    elif kind == "prompt_token_ids":
        kwargs["prompt_token_ids"] = list(msg.prompt_token_ids.token_ids)
    elif kind == "chat":
        kwargs["messages"] = [{"role": m.role, "content": m.content} for m in msg.chat.messages]
    else:
        raise InvalidRequestError("input", None, "set one of prompt, prompt_token_ids, chat")
    return GenerateArgs(params, kwargs)


def _pack_logprobs(
    positions: list[dict[int, Logprob] | None], chosen: list[int | None], k: int
) -> frontend_pb2.DecodedLogprobs:
    """Rows of [chosen, top-1 .. top-k]; see Logprobs in common.proto."""
    token_ids: list[int] = []
    values: list[float] = []
    texts: list[str] = []
    ranks: list[int] = []
    for entries, token in zip(positions, chosen):
        if entries is None or token is None:
            continue
        top = sorted(
            ((tid, lp) for tid, lp in entries.items() if lp.rank is not None and lp.rank <= k),
            key=lambda item: item[1].rank or 0,
        )
        row = [(token, entries[token]), *top]
        while len(row) < k + 1:
            row.append(row[0])
        for tid, lp in row:
            token_ids.append(tid)
            values.append(lp.logprob)
            texts.append(lp.decoded_token or "")
        ranks.append(entries[token].rank or 0)
    return frontend_pb2.DecodedLogprobs(
        logprobs=common_pb2.Logprobs(
            token_ids=token_ids, logprobs=values, ranks=ranks, num_columns=k + 1 if ranks else 0
        ),
        tokens=texts,
    )


def completion_to_proto(c: CompletionOutput, num_logprobs: int | None) -> frontend_pb2.CompletionOutput:
    msg = frontend_pb2.CompletionOutput(
        index=c.index,
        text=c.text,
        token_ids=c.token_ids,
        finish_reason=c.finish_reason or "",
    )
    if c.logprobs is not None and num_logprobs is not None:
        msg.logprobs.CopyFrom(_pack_logprobs(list(c.logprobs), list(c.token_ids), num_logprobs))
    if c.cumulative_logprob is not None:
        msg.cumulative_logprob = c.cumulative_logprob
    if isinstance(c.stop_reason, int):
        msg.stop_token_id = c.stop_reason
    elif isinstance(c.stop_reason, str):
        msg.stop_str = c.stop_reason
    return msg


def response_to_proto(
    out: RequestOutput, params: SamplingParams, first: bool
) -> frontend_pb2.GenerateResponse:
    msg = frontend_pb2.GenerateResponse(
        request_id=out.request_id,
        outputs=[completion_to_proto(c, params.logprobs) for c in out.outputs],
        usage=frontend_pb2.Usage(
            prompt_tokens=out.usage.prompt_tokens,
            completion_tokens=out.usage.completion_tokens,
            cached_tokens=out.usage.cached_tokens,
        ),
        finished=out.finished,
    )
    if first:
        msg.prompt_token_ids.extend(out.prompt_token_ids)
        if out.prompt_logprobs is not None and params.prompt_logprobs is not None:
            msg.prompt_logprobs.CopyFrom(
                _pack_logprobs(
                    list(out.prompt_logprobs), [None, *out.prompt_token_ids[1:]], params.prompt_logprobs
                )
            )
    return msg


MAX_EMBED_INPUTS = 2048


def embed_inputs_from_proto(msg: frontend_pb2.EmbedRequest) -> list[dict[str, Any]]:
    """Keyword arguments of ``AsyncLLM.encode`` for each input (prompt or token ids)."""
    if not msg.inputs:
        raise InvalidRequestError("inputs", [], "give at least one input")
    if len(msg.inputs) > MAX_EMBED_INPUTS:
        raise InvalidRequestError("inputs", f"<{len(msg.inputs)} inputs>", f"at most {MAX_EMBED_INPUTS}")
    add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else None
    out = []
    for i, item in enumerate(msg.inputs):
        kind = item.WhichOneof("input")
        if kind == "text":
            out.append({"prompt": item.text, "add_special_tokens": add_special})
        elif kind == "token_ids":
            out.append({"prompt_token_ids": list(item.token_ids.token_ids)})
        else:
            raise InvalidRequestError(f"inputs[{i}]", None, "set text or token_ids")
    return out


def session_chunk_from_proto(
    msg: frontend_pb2.GenerateSessionRequest, defaults: SamplingDefaults | None = None
) -> SessionChunk:
    """A GenerateSessionRequest as the AsyncLLM's SessionChunk (sampling params only if set)."""
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", None, "set prompt or prompt_token_ids")
    return SessionChunk(
        prompt=msg.prompt if kind == "prompt" else None,
        prompt_token_ids=list(msg.prompt_token_ids.token_ids) if kind == "prompt_token_ids" else None,
        sampling_params=(
            convert.sampling_params_from_proto(msg.sampling_params, defaults)
            if msg.HasField("sampling_params")
            else None
        ),
        add_special_tokens=msg.add_special_tokens if msg.HasField("add_special_tokens") else None,
    )
