"""A serving engine's life after start-up: serve, drain on SIGTERM/SIGINT, or fail.

    SERVING --signal--> draining --idle | drain timeout | second signal--> exit 0
       |                    |
       +--core died / step loop hung (watchdog)--> liveness NOT_SERVING, exit 1

While draining, readiness is NOT_SERVING and liveness SERVING; the servicer refuses
new adds with UNAVAILABLE (frontends place them elsewhere) and marks every message
``draining``. Requests still running when the drain ends are aborted with UNAVAILABLE
"drain timeout: aborted".

``LifecycleConfig`` holds the two timeouts and ``add_lifecycle_cli`` /
``lifecycle_config_from_args`` their flags; the engine server (server.py) passes them in.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_service.watchdog import StepWatchdog
from tandem.health import ServiceHealth
from tandem.signals import StopSignals, first_of

if TYPE_CHECKING:
    from engine_service.core_loop import EngineCoreLoop
    from engine_service.servicer import EngineServicer

logger = logging.getLogger(__name__)

# Before closing the streams of an engine that drained at once (nothing in flight):
# time for adds already on the wire to arrive and be refused (so frontends re-place
# them) instead of being cut off with the stream.
ANNOUNCE_SECONDS = 0.5
FLUSH_SECONDS = 0.2  # for the last messages (engine dead, aborts) to leave


@dataclass(frozen=True)
class LifecycleConfig:
    """How long a drain and a step may take (--drain-timeout, --step-timeout)."""

    # Seconds in-flight requests get to finish after SIGTERM/SIGINT; the rest are
    # then aborted with UNAVAILABLE "drain timeout: aborted".
    drain_timeout: float = 30.0
    # A step loop busy with requests that finishes no step for this many seconds is
    # hung: liveness goes NOT_SERVING and the process exits 1.
    step_timeout: float = 120.0


async def run_until_stopped(
    servicer: EngineServicer,
    health: ServiceHealth,
    engine_loop: EngineCoreLoop,
    engine_index: int,
    config: LifecycleConfig,
    signals: StopSignals,
) -> int:
    """Serve until stopped; returns the exit status (0: drained, 1: the core failed).

    ``engine_index``: for the log lines; ``signals``: installed by the caller before
    the engine reports SERVING.
    """
    watchdog = StepWatchdog(engine_loop, config.step_timeout)
    watching = asyncio.ensure_future(watchdog.watch(servicer.fail))
    try:
        if await first_of(servicer.died, signals.requested) is servicer.died:
            return await _fail(servicer, health)
        await health.draining()
        servicer.start_drain()
        ended = await first_of(
            servicer.died, servicer.drained, signals.forced, timeout=config.drain_timeout
        )
        if ended is servicer.died:
            return await _fail(servicer, health)
        if ended is None or ended is signals.forced:
            why = "drain timeout" if ended is None else "stopped again during the drain"
            count = servicer.abort_all(f"{why}: aborted")
            logger.warning("engine %d: %s, aborted %d requests", engine_index, why, count)
            await asyncio.sleep(FLUSH_SECONDS)
        else:
            logger.info("engine %d drained", engine_index)
            await asyncio.sleep(ANNOUNCE_SECONDS)
        servicer.close_streams()
        return 0
    finally:
        watching.cancel()


async def _fail(servicer: EngineServicer, health: ServiceHealth) -> int:
    await health.broken()
    await asyncio.sleep(FLUSH_SECONDS)  # let the engine-dead messages go out
    logger.error("engine core failed (%s); exiting non-zero", servicer.dead.message if servicer.dead else "?")
    return 1


def add_lifecycle_cli(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument(
        "--drain-timeout", type=float, default=float(env("TANDEM_DRAIN_TIMEOUT", "30")),
        help="Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are "
        "aborted (env TANDEM_DRAIN_TIMEOUT; default 30).",
    )
    p.add_argument(
        "--step-timeout", type=float, default=float(env("TANDEM_STEP_TIMEOUT", "120")),
        help="Seconds a step may run while requests wait before the engine counts as hung: "
        "health NOT_SERVING, exit 1 (env TANDEM_STEP_TIMEOUT; default 120).",
    )


def lifecycle_config_from_args(args: argparse.Namespace) -> LifecycleConfig:
    return LifecycleConfig(drain_timeout=args.drain_timeout, step_timeout=args.step_timeout)
