"""AsyncLLM: the frontend's engine-facing core, as vLLM's AsyncLLM but over gRPC.

``generate()`` validates and tokenizes a request, places it on an engine, and yields
``RequestOutput``s as the engine's per-step outputs arrive; closing the generator (a
client cancel or disconnect) aborts the engine request. Text work (detokenization,
stop strings, n>1) happens in the shared ``OutputProcessor``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_service.outputs import EngineCoreOutputs
from engine_service.sampling_params import SamplingParams
from frontend_service.engine_client import (
    EngineConnection,
    EngineGroup,
    EngineUnavailableError,
)
from frontend_service.input_processor import InputProcessor
from frontend_service.output_processor import OutputProcessor
from frontend_service.outputs import RequestOutput

logger = logging.getLogger(__name__)


class PauseMode(enum.Enum):
    ABORT = "abort"  # abort in-flight requests
    WAIT = "wait"  # let in-flight requests finish


@dataclass
class _Stream:
    """Where one user request's outputs go, and which engine runs it."""

    queue: asyncio.Queue[RequestOutput | BaseException]
    engine: EngineConnection
    engine_request_ids: list[str]
    finished: bool = False


class AsyncLLM:
    def __init__(
        self,
        tokenizer: Any,
        engines: EngineGroup,
        input_processor: InputProcessor,
        client_index: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.engines = engines
        self.input_processor = input_processor
        self.output_processor = OutputProcessor(tokenizer)
        self.client_index = client_index
        self.streams: dict[str, _Stream] = {}  # internal request id -> stream
        self._resumed = asyncio.Event()
        self._resumed.set()

    # ---- engine callbacks (run on the event loop) ----------------------------------

    def on_engine_outputs(self, engine: EngineConnection, outs: EngineCoreOutputs) -> None:
        if not outs.outputs:
            return
        processed = self.output_processor.process_outputs(outs.outputs)
        for internal_id, request_output in processed.request_outputs:
            stream = self.streams.get(internal_id)
            if stream is not None:
                stream.finished = request_output.finished
                stream.queue.put_nowait(request_output)
        if processed.reqs_to_abort:
            engine.abort(processed.reqs_to_abort)  # stop strings matched

    def on_engine_dead(self, engine: EngineConnection, reason: str) -> None:
        """Fail every request on the dead engine with UNAVAILABLE; others keep going."""
        dead = [rid for rid, s in self.streams.items() if s.engine is engine and not s.finished]
        self.output_processor.abort_requests(dead)
        for rid in dead:
            self.streams[rid].queue.put_nowait(EngineUnavailableError(reason))

    # ---- the API ------------------------------------------------------------------

    async def generate(
        self,
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs of one request; its ``request_id`` is the caller's id."""
        await self._resumed.wait()
        user_id = request_id or uuid.uuid4().hex
        # Engine-side ids stay unique even if two clients pick the same request id.
        internal_id = f"{user_id}-{uuid.uuid4().hex[:8]}"
        processed = self.input_processor.process(
            internal_id,
            sampling_params,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
            priority=priority,
            cache_salt=cache_salt,
            client_index=self.client_index,
            trace_headers=trace_headers,
        )
        engine = self.engines.pick()
        stream = _Stream(asyncio.Queue(), engine, [r.request_id for r in processed.engine_requests])
        self.output_processor.add_processed(processed)
        self.streams[internal_id] = stream
        try:
            for req in processed.engine_requests:
                engine.add_request(req)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                item.request_id = user_id
                yield item
                if item.finished:
                    return
        finally:
            self.streams.pop(internal_id, None)
            if not stream.finished:
                # Cancelled, disconnected, failed or closed early: free the engine's blocks.
                result = self.output_processor.abort_requests([internal_id])
                engine.abort(result.reqs_to_abort or stream.engine_request_ids)

    def abort(self, request_ids: Sequence[str]) -> int:
        """Abort user requests by their ids; returns how many were found."""
        wanted = set(request_ids)
        found = 0
        for internal_id, stream in list(self.streams.items()):
            if internal_id.rsplit("-", 1)[0] not in wanted or stream.finished:
                continue
            found += 1
            result = self.output_processor.abort_requests([internal_id])
            stream.engine.abort(result.reqs_to_abort)
            stream.finished = True
            for _, request_output in result.request_outputs:
                stream.queue.put_nowait(request_output)
        return found

    # ---- pause / resume ----------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def pause(self, mode: PauseMode, poll_interval: float = 0.05) -> None:
        """New requests wait; in-flight ones are aborted or allowed to finish."""
        self._resumed.clear()
        if mode is PauseMode.ABORT:
            self.abort([rid.rsplit("-", 1)[0] for rid in self.streams])
        while any(not s.finished for s in self.streams.values()):
            await asyncio.sleep(poll_interval)

    def resume(self) -> None:
        self._resumed.set()

    @property
    def num_unfinished(self) -> int:
        return sum(1 for s in self.streams.values() if not s.finished)
