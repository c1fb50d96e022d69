"""SIGTERM/SIGINT as asyncio events: the first asks for a graceful drain, a second
cuts the drain short (both services handle them the same way)."""

from __future__ import annotations

import asyncio
import logging
import signal

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """``requested`` is set by the first SIGTERM/SIGINT, ``forced`` by any later one."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.forced = asyncio.Event()

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> StopSignals:
        """Handle the stop signals on ``loop`` (default: the running loop)."""
        loop = loop or asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.on_signal, sig)
        return self

    def on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.requested.is_set():
            logger.warning("%s again: cutting the drain short", name)
            self.forced.set()
        else:
            logger.info("%s: draining", name)
            self.requested.set()


async def first_of(*events: asyncio.Event, timeout: float | None = None) -> asyncio.Event | None:
    """Wait until one of ``events`` is set; return it (the first in order if several
    are), or None when ``timeout`` seconds pass first."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return next((e for e in events if e.is_set()), None)
