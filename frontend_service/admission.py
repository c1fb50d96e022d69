"""Frontend admission control, and the failures a request can end with.

``RequestGate`` is where every request of AsyncLLM enters: a place under the bound on
requests in progress, then (while generation is paused) a wait until it resumes.

``PendingLimit`` bounds the requests a frontend has admitted and not yet finished
(``--max-pending-requests``): beyond it, ``Generate`` answers RESOURCE_EXHAUSTED at
once, before tokenizing and without contacting an engine. The bound protects the
frontend's own memory and CPU; engines bound their own queues. The retry hint is the
expected wait for one admitted request to finish, from an EWMA of finishes per second.

``RequestFailedError`` carries a ``RequestError`` (code, message, retry hint) from an
engine or from the frontend itself; ``errors.py`` turns it into the client's status.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tandem.drain_rate import DrainRate
from tandem.protocol.outputs import ErrorCode, RequestError

DEFAULT_MAX_PENDING_REQUESTS = 4096


class RequestFailedError(RuntimeError):
    """A request ended with a status other than OK; ``error`` says which."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error

    @property
    def code(self) -> ErrorCode:
        return self.error.code


def deadline_exceeded(message: str) -> RequestFailedError:
    return RequestFailedError(RequestError(ErrorCode.DEADLINE_EXCEEDED, message))


class PendingLimit:
    """At most ``max_pending`` requests between ``acquire`` and ``release``; 0: unbounded."""

    def __init__(
        self, max_pending: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_pending < 0:
            raise ValueError(f"max_pending_requests must be >= 0, got {max_pending}")
        self.max_pending = max_pending
        self.pending = 0
        self.drain_rate = DrainRate()
        self._clock = clock

    def acquire(self) -> None:
        """Count one more request in, or raise RequestFailedError(RESOURCE_EXHAUSTED)."""
        if self.max_pending and self.pending >= self.max_pending:
            # A refusal is also a point in time at which the queue was full: it lets
            # the rate fall when nothing finishes for a while.
            self.drain_rate.observe(self._clock(), 0, self.pending)
            raise RequestFailedError(
                RequestError(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    f"the frontend has {self.pending} requests in progress "
                    f"(max_pending_requests={self.max_pending})",
                    retry_after_ms=self.drain_rate.retry_after_ms(),
                )
            )
        self.pending += 1

    def release(self) -> None:
        self.pending -= 1
        self.drain_rate.observe(self._clock(), 1, self.pending)


class RequestGate:
    """The entry of every request: ``limit`` (a PendingLimit; None: unbounded), and the
    pause (closed: new requests wait in ``wait_open``, those in flight go on)."""

    def __init__(self, limit: PendingLimit | None) -> None:
        self.limit = limit
        self._open = asyncio.Event()
        self._open.set()

    def admit(self) -> bool:
        """Take a place under the limit (RequestFailedError with RESOURCE_EXHAUSTED when
        full); whether one was taken, for ``leave``."""
        if self.limit is None:
            return False
        self.limit.acquire()
        return True

    def leave(self, admitted: bool) -> None:
        if admitted and self.limit is not None:
            self.limit.release()

    async def wait_open(self) -> None:
        await self._open.wait()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()
