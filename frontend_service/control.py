"""Operator control of AsyncLLM's requests: abort by id, pause / resume, the drain.

``RequestControl`` acts on the live streams (``StreamTable``), their text state (the
``OutputProcessor``) and the entry of new requests (``RequestGate``, closed while paused).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence

from frontend_service.admission import RequestGate
from frontend_service.engine_client import EngineUnavailableError
from frontend_service.output_processor import OutputProcessor
from frontend_service.streams import StreamTable, user_id_of


class PauseMode(enum.Enum):
    ABORT = "abort"  # abort in-flight requests
    WAIT = "wait"  # let in-flight requests finish


class RequestControl:
    def __init__(self, streams: StreamTable, output_processor: OutputProcessor, gate: RequestGate) -> None:
        self._streams = streams
        self._output_processor = output_processor
        self._gate = gate

    def abort(self, request_ids: Sequence[str]) -> int:
        """Abort user requests by their ids; returns how many were found."""
        wanted = set(request_ids)
        found = 0
        for internal_id, stream in list(self._streams.by_id.items()):
            if user_id_of(internal_id) not in wanted or stream.finished:
                continue
            found += 1
            result = self._output_processor.abort_requests([internal_id])
            stream.engine.abort(result.reqs_to_abort)
            stream.finished = True
            for _, request_output in result.request_outputs:
                stream.queue.put_nowait(request_output)
        return found

    # ---- pause / resume ----------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return not self._gate.is_open

    async def pause(self, mode: PauseMode, poll_interval: float = 0.05) -> None:
        """New requests wait; in-flight ones are aborted or allowed to finish."""
        self._gate.close()
        if mode is PauseMode.ABORT:
            self.abort([user_id_of(internal_id) for internal_id in self._streams.by_id])
        while self._streams.num_unfinished:
            await asyncio.sleep(poll_interval)

    def resume(self) -> None:
        self._gate.open()

    @property
    def num_unfinished(self) -> int:
        return self._streams.num_unfinished

    # ---- graceful drain ----------------------------------------------------------------

    async def drain(self, timeout: float, poll_interval: float = 0.05) -> int:
        """Wait up to ``timeout`` seconds for every request to finish, then fail what is
        left with UNAVAILABLE (its engine requests aborted). Returns how many failed.

        The caller stops admitting new requests first (the servicer's draining gate).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._streams.num_unfinished and loop.time() < deadline:
            await asyncio.sleep(poll_interval)
        return self.fail_all(f"the frontend's drain timeout ({timeout:g}s) passed: aborted")

    def fail_all(self, reason: str) -> int:
        """Fail every unfinished request with UNAVAILABLE ``reason``; returns how many."""
        left = self._streams.unfinished()
        for internal_id, stream in left:
            self._streams.fail(internal_id, stream, EngineUnavailableError(reason))
        return len(left)
