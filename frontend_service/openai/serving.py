"""Completions and chat completions on the frontend's AsyncLLM, in OpenAI's shapes.

Each handler returns either a response dict (non-streaming) or an async iterator of SSE
events (bytes). A stream raises its first failure before it has yielded anything, so
``app.py`` can still answer with the right HTTP status; after that a failure becomes a
last ``data: {"error": {...}}`` event, then ``data: [DONE]``. Closing the iterator (a
client that went away) closes the AsyncLLM generators, which aborts the engine requests.

Chat: ``chat_tools.ChatPlan`` says what a request does with ``tools`` and reasoning (the
prompt it renders, the constraint of a forced tool choice); a ``ChoiceReader`` per choice
turns the output into ``reasoning_content``, ``content`` and ``tool_calls``, streamed or
whole. Without tools or a reasoning parser the text passes as generated.

Choice indices: prompt ``p`` of a completions request with ``n`` samples gives choices
``p * n + i`` (vLLM's numbering); a request with several prompts runs them concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from frontend_service.admission import RequestFailedError
from frontend_service.async_llm import AsyncLLM
from frontend_service.openai import ChatParsing, chat_tools, shapes
from frontend_service.openai.chat_tools import ChatPlan, ChoiceReader
from frontend_service.openai.protocol import ChatCompletionRequest, CompletionRequest
from frontend_service.outputs import CompletionOutput, RequestOutput, RequestUsage
from tandem.protocol.outputs import ErrorCode, RequestError
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams

ErrorEvent = Callable[[BaseException], bytes]  # app.py's in-stream error event


@dataclass
class Call:
    """What every generation needs besides the body: the AsyncLLM and request context."""

    llm: AsyncLLM
    model: str  # the served model name, echoed in responses
    trace_headers: dict[str, str] | None
    error_event: ErrorEvent
    lora_request: Any = None  # the LoRARequest the body's "model" named; None: the base model
    parsing: ChatParsing = field(default_factory=ChatParsing)  # --tool-call-parser, --reasoning-parser


def _failed(c: CompletionOutput) -> None:
    if c.finish_reason == "error":
        raise RequestFailedError(RequestError(ErrorCode.INTERNAL, "the engine failed this request"))


async def _merged(
    llm: AsyncLLM, params: SamplingParams, inputs: list[dict[str, Any]], request_id: str,
    extra: dict[str, Any],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(prompt index, output) of every prompt's generation, as they arrive."""
    if len(inputs) == 1:
        async for out in llm.generate(params, request_id=request_id, **inputs[0], **extra):
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((index, out))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [
        asyncio.ensure_future(
            pump(i, llm.generate(params, request_id=f"{request_id}-{i}", **inp, **extra))
        )
        for i, inp in enumerate(inputs)
    ]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


class _Stream:
    """Shared SSE bookkeeping: the JSON head of every chunk, usage, error framing."""

    def __init__(self, call: Call, request_id: str, object_name: str, options: Any) -> None:
        self.call = call
        # Every chunk is '{"id":...,"object":...,"created":...,"model":...,"choices":[' + ...
        self.head = (
            f'{{"id":{shapes.dumps(request_id)},"object":"{object_name}",'
            f'"created":{int(time.time())},"model":{shapes.dumps(call.model)},"choices":['
        )
        self.include_usage = bool(options and options.include_usage)
        self.continuous = bool(options and options.continuous_usage_stats)
        self.usage: dict[int, RequestUsage] = {}  # prompt index -> latest usage

    def total_usage(self) -> dict[str, Any]:
        total = RequestUsage()
        for part in self.usage.values():
            shapes.add_usage(total, part)
        return shapes.usage(total.prompt_tokens, total.completion_tokens, total.cached_tokens)

    def chunk(self, choice: dict[str, Any], extra: str = "") -> bytes:
        usage = f',"usage":{shapes.dumps(self.total_usage())}' if self.continuous else ""
        return f"data: {self.head}{shapes.dumps(choice)}]{usage}{extra}}}\n\n".encode()

    def final(self) -> bytes:
        usage = f"data: {self.head}],\"usage\":{shapes.dumps(self.total_usage())}}}\n\n".encode()
        return (usage if self.include_usage else b"") + shapes.DONE

    async def run(self, events: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        """``events`` then the final usage and [DONE]; failures before the first event
        propagate, later ones become an error event."""
        started = False
        try:
            async for event in events:
                started = True
                yield event
        except Exception as exc:
            if not started:
                raise
            yield self.call.error_event(exc)
            yield shapes.DONE
            return
        finally:
            await events.aclose()
        yield self.final()


# ---- /v1/completions ------------------------------------------------------------------------


async def completions(call: Call, req: CompletionRequest) -> dict[str, Any] | AsyncGenerator[bytes, None]:
    req.check()
    params = req.sampling_params(call.llm.sampling_defaults)
    if req.echo and req.logprobs is not None:
        params = replace(params, prompt_logprobs=req.logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    extra = {"trace_headers": call.trace_headers, "priority": req.priority,
             "cache_salt": req.cache_salt, "add_special_tokens": req.add_special_tokens,
             "lora_request": call.lora_request}
    outputs = _merged(call.llm, params, req.prompts(), req.request_id or request_id, extra)
    if req.stream:
        stream = _Stream(call, request_id, "text_completion", req.stream_options)
        return stream.run(_completion_events(call, req, params, stream, outputs))
    return await _completion_response(call, req, request_id, outputs)


def _prompt_text(call: Call, out: RequestOutput) -> str:
    return out.prompt if out.prompt is not None else call.llm.tokenizer.decode(out.prompt_token_ids)


def _echo_logprobs(builder: shapes.CompletionLogprobs, out: RequestOutput) -> dict[str, Any]:
    positions = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return builder.build(out.prompt_token_ids, positions)


def _merge_logprobs(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def _completion_choice(
    call: Call, req: CompletionRequest, index: int, c: CompletionOutput, echo: str | None,
    builder: shapes.CompletionLogprobs | None, echo_lp: dict[str, Any] | None,
) -> dict[str, Any]:
    """One choice; ``echo``: prompt text to put first (first chunk only)."""
    _failed(c)
    logprobs = None
    if builder is not None and c.logprobs is not None:
        logprobs = _merge_logprobs(echo_lp, builder.build(c.token_ids, c.logprobs))
    choice: dict[str, Any] = {
        "index": index,
        "text": c.text if echo is None else echo + c.text,
        "logprobs": logprobs,
        "finish_reason": shapes.finish_reason(c.finish_reason),
    }
    if c.finish_reason is not None:
        choice["stop_reason"] = c.stop_reason
    if req.return_token_ids:
        choice["token_ids"] = list(c.token_ids)
    return choice


async def _completion_events(
    call: Call, req: CompletionRequest, params: SamplingParams, stream: _Stream,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
) -> AsyncGenerator[bytes, None]:
    n = params.n
    seen: set[int] = set()  # choices that sent their first chunk (echo goes there)
    builders: dict[int, shapes.CompletionLogprobs] = {}
    try:
        async for p, out in outputs:
            stream.usage[p] = out.usage
            for c in out.outputs:
                index = p * n + c.index
                first = index not in seen
                echo = echo_lp = None
                builder = builders.get(index)
                if first:
                    seen.add(index)
                    if req.logprobs is not None:
                        builder = builders[index] = shapes.CompletionLogprobs(req.logprobs, call.llm.tokenizer)
                    if req.echo:
                        echo = _prompt_text(call, out)
                        if builder is not None:
                            echo_lp = _echo_logprobs(builder, out)
                if not (c.text or c.finish_reason or echo or (req.return_token_ids and c.token_ids)):
                    continue  # nothing to show yet (text held back for a stop string or UTF-8)
                choice = _completion_choice(call, req, index, c, echo, builder, echo_lp)
                extra = ""
                if first and req.return_token_ids and c.index == 0:
                    extra = f',"prompt_token_ids":{shapes.dumps(out.prompt_token_ids)}'
                yield stream.chunk(choice, extra)
    finally:
        await outputs.aclose()


async def _completion_response(
    call: Call, req: CompletionRequest, request_id: str,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
) -> dict[str, Any]:
    finals: dict[int, RequestOutput] = {}
    async for p, out in outputs:
        finals[p] = out  # FINAL_ONLY: one output per prompt, with everything
    choices = []
    total = RequestUsage()
    prompt_ids: list[list[int]] = []
    for p in sorted(finals):
        out = finals[p]
        shapes.add_usage(total, out.usage)
        prompt_ids.append(out.prompt_token_ids)
        for c in out.outputs:
            builder = None
            echo_lp = None
            if req.logprobs is not None:
                builder = shapes.CompletionLogprobs(req.logprobs, call.llm.tokenizer)
                if req.echo:
                    echo_lp = _echo_logprobs(builder, out)
            echo = _prompt_text(call, out) if req.echo else None
            choices.append(_completion_choice(
                call, req, p * req.n + c.index, c, echo, builder, echo_lp
            ))
    response: dict[str, Any] = {
        "id": request_id, "object": "text_completion", "created": int(time.time()),
        "model": call.model, "choices": choices,
        "usage": shapes.usage(total.prompt_tokens, total.completion_tokens, total.cached_tokens),
    }
    if req.return_token_ids:
        response["prompt_token_ids"] = prompt_ids[0] if len(prompt_ids) == 1 else prompt_ids
    return response


# ---- /v1/chat/completions -------------------------------------------------------------------


async def chat(call: Call, req: ChatCompletionRequest) -> dict[str, Any] | AsyncGenerator[bytes, None]:
    plan = chat_tools.plan_chat(req, call.llm.tokenizer, call.parsing)
    params = plan.sampling_params(req.sampling_params(call.llm.sampling_defaults), req)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    extra = {"trace_headers": call.trace_headers, "priority": req.priority,
             "cache_salt": req.cache_salt, "add_generation_prompt": req.add_generation_prompt,
             "lora_request": call.lora_request}
    inputs = [_chat_input(call, req, plan)]
    outputs = _merged(call.llm, params, inputs, req.request_id or request_id, extra)
    if req.stream:
        stream = _Stream(call, request_id, "chat.completion.chunk", req.stream_options)
        return stream.run(_chat_events(call, req, params, stream, outputs, plan))
    return await _chat_response(call, req, request_id, outputs, plan)


def _chat_input(call: Call, req: ChatCompletionRequest, plan: ChatPlan) -> dict[str, Any]:
    """The AsyncLLM input: the messages, or with tools or chat_template_kwargs the chat
    template's text rendered here (the input processor's renderer passes neither)."""
    messages = req.chat_messages()
    if not plan.tools and not req.chat_template_kwargs:
        return {"messages": messages}
    text = chat_tools.render_chat(
        call.llm.tokenizer, messages, plan.tools or None, req.add_generation_prompt, req.chat_template_kwargs or {}
    )
    limit = getattr(getattr(call.llm, "input_processor", None), "max_prompt_chars", None)
    if isinstance(limit, int) and len(text) > limit:
        raise InvalidRequestError(
            "messages", f"<{len(text)} characters>", f"the rendered chat's {len(text)} characters are "
            f"more than the model's context can hold ({limit} characters at most)",
        )
    return {"prompt": text, "add_special_tokens": False}  # the template wrote its special tokens


def _chat_logprobs(call: Call, req: ChatCompletionRequest, c: CompletionOutput) -> dict[str, Any] | None:
    if not req.logprobs or c.logprobs is None:
        return None
    return shapes.chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0, call.llm.tokenizer)


async def _chat_events(
    call: Call, req: ChatCompletionRequest, params: SamplingParams, stream: _Stream,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None], plan: ChatPlan,
) -> AsyncGenerator[bytes, None]:
    first = True
    readers: dict[int, ChoiceReader] = {}  # choice index -> its parsers' state
    try:
        async for _, out in outputs:
            stream.usage[0] = out.usage
            if first:  # every choice opens with the assistant role, as OpenAI streams do
                first = False
                extra = ""
                if req.return_token_ids:
                    extra = f',"prompt_token_ids":{shapes.dumps(out.prompt_token_ids)}'
                for i in range(params.n):
                    role = {"index": i, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}
                    yield stream.chunk(role, extra if i == 0 else "")
            for c in out.outputs:
                _failed(c)
                delta: dict[str, Any] = {"content": c.text} if c.text else {}
                finish = c.finish_reason
                if plan.reads_output:
                    reader = readers.get(c.index)
                    if reader is None:
                        reader = readers[c.index] = plan.reader(out.prompt)
                    delta = reader.delta(c.text, c.finish_reason is not None)
                    finish = reader.finish_reason(finish)
                if not (delta or c.finish_reason or (req.return_token_ids and c.token_ids)):
                    continue
                choice: dict[str, Any] = {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": _chat_logprobs(call, req, c),
                    "finish_reason": shapes.finish_reason(finish),
                }
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                if req.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                yield stream.chunk(choice)
    finally:
        await outputs.aclose()


async def _chat_response(
    call: Call, req: ChatCompletionRequest, request_id: str,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None], plan: ChatPlan,
) -> dict[str, Any]:
    final: RequestOutput | None = None
    async for _, out in outputs:
        final = out
    assert final is not None  # generate() ends with a finished output or raises
    choices = []
    for c in final.outputs:
        _failed(c)
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if plan.reads_output:
            reader = plan.reader(final.prompt)
            message = reader.message(c.text)
            finish = reader.finish_reason(finish)
        choice: dict[str, Any] = {
            "index": c.index,
            "message": message,
            "logprobs": _chat_logprobs(call, req, c),
            "finish_reason": shapes.finish_reason(finish),
            "stop_reason": c.stop_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    u = final.usage
    response: dict[str, Any] = {
        "id": request_id, "object": "chat.completion", "created": int(time.time()),
        "model": call.model, "choices": choices,
        "usage": shapes.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
    }
    if req.return_token_ids:
        response["prompt_token_ids"] = final.prompt_token_ids
    return response
