"""Pooling (embedding) requests on AsyncLLM: ``encode`` with vLLM's name and shape.

A pooling request is one engine request that finishes in one output carrying its
vector; it takes the same placement, admission, pause, deadline and failure paths as
generation (the stream and engine-failure machinery of AsyncLLM), but no text work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from frontend_service.outputs import PoolingOutput, PoolingRequestOutput
from frontend_service.streams import Stream, request_ids
from tandem.protocol.outputs import EngineCoreOutput
from tandem.protocol.pooling_params import PoolingParams


class Pooling:
    """Mixed into AsyncLLM (which provides the streams, engines and admission)."""

    streams: dict[str, Stream]
    _owner: dict[str, str]
    _num_pooling: int

    def take_pooled(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Hand each pooling output to its caller; return the other outputs."""
        rest = []
        for out in outputs:
            if out.pooling_output is None:
                rest.append(out)
                continue
            stream = self.streams.get(self._owner.get(out.request_id, ""))
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
        Failures raise as in ``generate``."""

        llm: Any = self
        arrival = time.monotonic()
        admitted = False
        try:
            admitted = llm._admit()
            await llm._resumed.wait()
            user_id, internal_id = request_ids(request_id)
            request = llm.input_processor.process_pooling(
                internal_id, pooling_params, prompt=prompt, prompt_token_ids=prompt_token_ids,
                priority=priority, client_index=llm.client_index, trace_headers=trace_headers,
                add_special_tokens=add_special_tokens,
            )
            engine = llm.engines.pick(request)
            stream = Stream(
                asyncio.Queue(), engine, [internal_id], requests=[request],
                deadline=None if timeout_s is None else arrival + timeout_s,
            )
            llm._track(internal_id, stream)
            self._num_pooling += 1
            try:
                llm._send(stream, engine)
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                item.request_id = user_id
                yield item
            finally:
                self._num_pooling -= 1
                llm._untrack(internal_id, stream)
                if not stream.finished:
                    stream.engine.abort([internal_id])
        finally:
            llm._leave(admitted)
