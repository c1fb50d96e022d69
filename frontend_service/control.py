"""Operator control of AsyncLLM's requests: abort by id, pause / resume, the drain."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from typing import Any

from frontend_service.engine_client import EngineUnavailableError
from frontend_service.streams import Stream


class PauseMode(enum.Enum):
    ABORT = "abort"  # abort in-flight requests
    WAIT = "wait"  # let in-flight requests finish


class RequestControl:
    """Mixed into AsyncLLM (its streams, output processor, ``_fail`` and ``_resumed``)."""

    streams: dict[str, Stream]
    output_processor: Any
    _resumed: asyncio.Event
    _fail: Any
    engines: Any
    closed: bool

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

    # ---- graceful drain ----------------------------------------------------------------

    async def drain(self, timeout: float, poll_interval: float = 0.05) -> int:
        """Wait up to ``timeout`` seconds for every request to finish, then fail what is
        left with UNAVAILABLE (its engine requests aborted). Returns how many failed.

        The caller stops admitting new requests first (the servicer's draining gate).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.num_unfinished and loop.time() < deadline:
            await asyncio.sleep(poll_interval)
        return self.fail_all(f"the frontend's drain timeout ({timeout:g}s) passed: aborted")

    async def shutdown(self) -> None:
        """Fail what is still running (UNAVAILABLE) and close the engine connections;
        idempotent (vLLM's ``AsyncLLM.shutdown``; also ``async with AsyncLLM(...)``)."""
        if self.closed:
            return
        self.closed = True
        self.fail_all("the AsyncLLM was shut down")
        await self.engines.close()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    def fail_all(self, reason: str) -> int:
        """Fail every unfinished request with UNAVAILABLE ``reason``; returns how many."""
        left = [(rid, s) for rid, s in self.streams.items() if not s.finished]
        for internal_id, stream in left:
            self._fail(internal_id, stream, EngineUnavailableError(reason))
        return len(left)
