"""Pooling (embedding) requests: ``encode`` with vLLM's name and shape.

A pooling request is one engine request that finishes in one output carrying its
vector; it takes the same placement, admission, pause, deadline and failure paths as
generation (a ``Stream`` in the shared ``StreamTable``, whose engine failures AsyncLLM
routes), but no text work: AsyncLLM hands each engine step to ``take_pooled`` first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from frontend_service.outputs import PoolingOutput, PoolingRequestOutput
from frontend_service.streams import Stream, StreamTable, request_ids, send
from tandem.protocol.outputs import EngineCoreOutput
from tandem.protocol.pooling_params import PoolingParams

if TYPE_CHECKING:
    from frontend_service.admission import RequestGate
    from frontend_service.engine_group import EngineGroup
    from frontend_service.input_processor import InputProcessor


class PoolingRequests:
    """``encode`` (AsyncLLM delegates to it) and the hand-over of pooling outputs.

    Given the input processor (validation, tokens), the engine group (placement), the
    live streams (tracked as generation's are, so failures and control reach them), the
    entry gate (admission and pause) and the client index stamped on each request.
    """

    def __init__(
        self,
        input_processor: InputProcessor,
        engines: EngineGroup,
        streams: StreamTable,
        gate: RequestGate,
        client_index: int,
    ) -> None:
        self._input_processor = input_processor
        self._engines = engines
        self._streams = streams
        self._gate = gate
        self._client_index = client_index
        self.in_flight = 0  # pooling requests tracked now; 0: steps skip ``take_pooled``

    def take_pooled(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Hand each pooling output to its caller; return the other outputs."""
        rest = []
        for out in outputs:
            if out.pooling_output is None:
                rest.append(out)
                continue
            stream = self._streams.stream_of(out.request_id)
            if stream is None:
                continue
            stream.got_output = stream.finished = True
            request = stream.requests[0]
            stream.queue.put_nowait(PoolingRequestOutput(
                out.request_id, PoolingOutput(out.pooling_output), request.prompt_token_ids, out.num_cached_tokens
            ))
        return rest

    async def encode(
        self,
        pooling_params: PoolingParams | None = None,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
        add_special_tokens: bool | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Yield the one output of a pooling request (its ``request_id`` is the caller's).
        Failures raise as in ``AsyncLLM.generate``."""
        arrival = time.monotonic()
        admitted = False
        try:
            admitted = self._gate.admit()
            await self._gate.wait_open()
            user_id, internal_id = request_ids(request_id)
            request = self._input_processor.process_pooling(
                internal_id, pooling_params, prompt=prompt, prompt_token_ids=prompt_token_ids,
                priority=priority, client_index=self._client_index, trace_headers=trace_headers,
                add_special_tokens=add_special_tokens,
            )
            engine = self._engines.pick(request)
            stream = Stream(
                asyncio.Queue(), engine, [internal_id], requests=[request],
                deadline=None if timeout_s is None else arrival + timeout_s,
            )
            self._streams.track(internal_id, stream)
            self.in_flight += 1
            try:
                send(stream, engine)
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                item.request_id = user_id
                yield item
            finally:
                self.in_flight -= 1
                self._streams.untrack(internal_id, stream)
                if not stream.finished:
                    stream.engine.abort([internal_id])
        finally:
            self._gate.leave(admitted)
