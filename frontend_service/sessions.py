"""Streaming-input sessions (vLLM's streaming input): the prompt arrives in chunks, and
after each chunk the engine generates a continuation that streams back. The frontend's
side of them is ``StreamingInputSessions`` (the engine keeps its own per-session state,
``engine_service.sessions``).

One session is one engine request (``resumable``) that stays on its engine between
turns with its KV cache: turn k's prompt is everything before it (every earlier chunk
and continuation) plus chunk k, and only the new tokens are computed. Restrictions, as
the reference's: n = 1, no FINAL_ONLY output, no stop strings; also no structured output
or prompt logprobs. Closing the inputs (or the caller going away) ends the session and
frees its blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from frontend_service.outputs import RequestOutput
from frontend_service.streams import Stream, StreamTable, request_ids
from tandem.protocol.sampling_params import InvalidRequestError, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from frontend_service.admission import RequestGate
    from frontend_service.engine_group import EngineGroup
    from frontend_service.input_processor import InputProcessor
    from frontend_service.output_processor import OutputProcessor


@dataclass
class SessionChunk:
    """One input of a session: text or token ids, and (optionally) new sampling params
    for this turn and the ones after it."""

    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    sampling_params: SamplingParams | None = None
    add_special_tokens: bool | None = None  # None: yes for the first chunk only


async def as_session_chunks(inputs: AsyncIterator[Any], params: SamplingParams) -> AsyncIterator[SessionChunk]:
    """Text, token-id lists or SessionChunks -> SessionChunks; ``params`` for the first."""
    first = True
    async for item in inputs:
        if isinstance(item, str):
            chunk = SessionChunk(prompt=item)
        elif isinstance(item, SessionChunk):
            chunk = item
        else:
            chunk = SessionChunk(prompt_token_ids=list(item))
        if first and chunk.sampling_params is None:
            chunk.sampling_params = params
        first = False
        yield chunk


def check_session_params(params: SamplingParams) -> None:
    """Raise InvalidRequestError naming what a session does not allow."""
    for field, bad, why in (
        ("n", params.n != 1, "a session generates one sequence (n = 1)"),
        ("output_kind", params.output_kind == RequestOutputKind.FINAL_ONLY, "a session streams its turns"),
        ("stop", bool(params.stop), "stop strings are not supported in a session"),
        ("structured_outputs", params.structured_outputs is not None, "not supported in a session"),
        ("prompt_logprobs", params.prompt_logprobs is not None, "not supported in a session"),
    ):
        if bad:
            raise InvalidRequestError(field, getattr(params, field), why)


class StreamingInputSessions:
    """Runs streaming-input sessions, one turn per input chunk (AsyncLLM delegates to it).

    Given the input and output processors (each turn is validated, tokenized and then
    detokenized as one request), the engine group (the session's engine, picked once),
    the live streams, the entry gate (admission for the session, the pause before each
    turn) and the client index stamped on each turn's request.
    """

    def __init__(
        self,
        input_processor: InputProcessor,
        output_processor: OutputProcessor,
        engines: EngineGroup,
        streams: StreamTable,
        gate: RequestGate,
        client_index: int,
    ) -> None:
        self._input_processor = input_processor
        self._output_processor = output_processor
        self._engines = engines
        self._streams = streams
        self._gate = gate
        self._client_index = client_index

    async def generate(
        self,
        inputs: AsyncIterator[SessionChunk],
        *,
        request_id: str | None = None,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield each turn's outputs (the last of a turn has ``finished`` set)."""
        user_id, internal_id = request_ids(request_id)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        params = SamplingParams(output_kind=RequestOutputKind.DELTA)
        stream: Stream | None = None
        admitted = False
        try:
            admitted = self._gate.admit()
            turn = 0
            async for chunk in inputs:
                await self._gate.wait_open()
                params = chunk.sampling_params or params
                check_session_params(params)
                add_special = chunk.add_special_tokens if chunk.add_special_tokens is not None else turn == 0
                processed = self._input_processor.process(
                    internal_id, params, prompt=chunk.prompt, prompt_token_ids=chunk.prompt_token_ids,
                    priority=priority, client_index=self._client_index, trace_headers=trace_headers,
                    add_special_tokens=add_special,
                )
                request = dataclasses.replace(processed.engine_requests[0], resumable=True)
                processed.engine_requests[0] = request
                if stream is None:
                    stream = Stream(asyncio.Queue(), self._engines.pick(request), [request.request_id],
                                    requests=[request], deadline=deadline, session=True)
                    self._streams.track(internal_id, stream)
                    stream.tried.append(stream.engine)
                stream.finished = False
                stream.requests = [request]
                self._output_processor.add_processed(processed)
                if deadline is not None:
                    request.timeout_s = deadline - time.monotonic()
                stream.engine.add_request(request)  # a session stays on its engine
                while True:
                    item = await stream.queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    item.request_id = user_id
                    yield item
                    stream.leave_rounds()
                    if item.finished:
                        break
                turn += 1
        finally:
            if stream is not None:
                stream.leave_rounds()
                self._streams.untrack(internal_id, stream)
                self._output_processor.abort_requests([internal_id])
                stream.engine.abort(stream.engine_request_ids)  # ends the session: blocks freed
            self._gate.leave(admitted)
