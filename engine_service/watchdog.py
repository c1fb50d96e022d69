"""The step-loop watchdog: tells a hung engine core from a busy one.

``EngineCoreLoop`` beats (``heartbeat``, ``busy``) on every iteration of its thread.
A loop that has unfinished requests and has not beaten for ``step_timeout`` seconds
is stuck inside one step (a kernel that never returns, a deadlock): the engine can
neither finish nor abort anything, so its health must say so and the process must
exit non-zero for its orchestrator to restart it. An idle loop blocks on its input
queue without beating; that is not a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)


class Beating(Protocol):
    """What the watchdog reads of an EngineCoreLoop (both set by the loop thread)."""

    heartbeat: float  # time.monotonic() of the last iteration
    busy: bool  # it had unfinished requests at that iteration


class StepWatchdog:
    def __init__(
        self,
        loop: Beating,
        step_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if step_timeout <= 0:
            raise ValueError(f"step_timeout must be > 0, got {step_timeout}")
        self.loop = loop
        self.step_timeout = step_timeout
        self.clock = clock

    def check(self) -> str | None:
        """Why the loop counts as hung, or None while it is fine."""
        if not self.loop.busy:
            return None
        silent = self.clock() - self.loop.heartbeat
        if silent < self.step_timeout:
            return None
        return (
            f"engine step loop hung: no step finished for {silent:.0f}s with requests "
            f"running (--step-timeout {self.step_timeout:g}s)"
        )

    async def watch(self, on_hung: Callable[[str], None], interval: float | None = None) -> None:
        """Check every ``interval`` seconds (default: a tenth of the timeout, at most 1 s);
        call ``on_hung`` once with the reason and return when the loop hangs."""
        period = interval if interval is not None else min(1.0, self.step_timeout / 10)
        while True:
            await asyncio.sleep(period)
            reason = self.check()
            if reason is not None:
                logger.error(reason)
                on_hung(reason)
                return
