"""Request migration: a stream whose engine dies, or drains past its deadline, goes on
on another engine, and its caller never notices.

The frontend holds every prompt and every token it has streamed. When the engine running
a stream is lost (its stream broke: killed, crashed, unreachable; or it drained and
aborted what was left with UNAVAILABLE), each unfinished engine request of the stream is
placed on another serving engine as a *continuation*: the same request with
``generated_token_ids`` = the tokens the frontend has received for it. The engine counts
them as output and computes their KV (a prefix-cache hit where it has them), then
generates from there. The output processor (detokenizer, stop strings, logprobs, n>1
children) never stopped, so the client sees no error, no gap and no duplicate.

What it guarantees: greedy decoding continues exactly; seeded sampling continues
bit-for-bit (the engine's random stream is a function of (seed, output position));
penalties, min_tokens and max_tokens count the generated tokens as output; structured
output replays its grammar over them (engine side). What it does not: unseeded random
sampling continues with fresh randomness (a valid sample, not the one the lost engine
would have drawn); tokens the lost engine produced that never reached the frontend are
generated again (the client never saw them); streaming-input sessions are not migrated
(their history lives in one engine's KV cache) and fail UNAVAILABLE as before. A request
migrates at most ``max_migrations`` times; after that it fails with UNAVAILABLE. With no
serving engine at that moment (one engine lost while the other restarts, a rolling
restart), the stream waits up to ``wait_s`` seconds (within its deadline) for one to
serve, then fails with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from frontend_service.admission import RequestFailedError
from frontend_service.engine_client import EngineConnection, EngineUnavailableError
from frontend_service.streams import Stream, StreamTable, send
from tandem.protocol.outputs import EngineCoreRequest

if TYPE_CHECKING:
    import argparse

    from frontend_service.engine_group import EngineGroup
    from frontend_service.metrics import FrontendMetrics
    from frontend_service.output_processor import OutputProcessor


logger = logging.getLogger(__name__)

DEFAULT_MAX_MIGRATIONS = 3
DEFAULT_WAIT_S = 10.0
_WAIT_POLL_S = 0.05  # how often a waiting stream looks for a serving engine


@dataclass(frozen=True)
class MigrationConfig:
    """Whether and how often a request moves to another engine when its engine is lost."""

    enabled: bool = True  # --no-request-migration turns it off: such requests fail UNAVAILABLE
    max_migrations: int = DEFAULT_MAX_MIGRATIONS  # per request; one more loss fails it
    wait_s: float = DEFAULT_WAIT_S  # with no serving engine, how long a stream waits for one

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if not self.wait_s >= 0:
            raise ValueError(f"wait_s must be >= 0, got {self.wait_s}")


class MigrationReason(enum.Enum):
    """The ``reason`` label of ``tandem:request_migrations_total``."""

    ENGINE_DEAD = "engine_dead"  # its stream to the engine broke
    ENGINE_DRAINED = "engine_drained"  # the engine's drain timeout ended it


def continuation(request: EngineCoreRequest, generated: Sequence[int]) -> EngineCoreRequest:
    """``request`` resumed after ``generated`` output tokens (prompt logprobs, already
    delivered with the first tokens, are not asked again)."""
    params = request.sampling_params
    if generated and params.prompt_logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=None)
    return dataclasses.replace(request, generated_token_ids=list(generated), sampling_params=params)


class StreamMigration:
    """Moves the streams of a lost engine to another one (see the module docstring).

    Given the engine group (the new engine), the live streams (to mark a moved stream's
    old outputs stale, and to fail one that cannot move), the output processor (the
    tokens each engine request has received) and the metrics (migrations counted).
    """

    def __init__(
        self,
        config: MigrationConfig,
        engines: EngineGroup,
        streams: StreamTable,
        output_processor: OutputProcessor,
        metrics: FrontendMetrics | None,
    ) -> None:
        self.config = config
        self._engines = engines
        self._streams = streams
        self._output_processor = output_processor
        self._metrics = metrics
        self._waits: set[asyncio.Task[None]] = set()  # streams waiting for a serving engine

    def migrate(self, internal_id: str, stream: Stream, reason: MigrationReason, why: str) -> bool:
        """Continue ``stream`` on another engine, now or (no engine serving) once one
        serves within ``wait_s``; False when it cannot (migration off, the request's limit
        reached, a session, nothing to continue): the caller fails it."""
        config = self.config
        if not config.enabled or stream.session or stream.migrations >= config.max_migrations:
            return False
        try:
            target = self._engines.pick(stream.requests[0], exclude=[stream.engine])
        except EngineUnavailableError as exc:
            if config.wait_s <= 0:
                return False
            self._streams.mark_moved(stream)  # the lost engine's late outputs: stale
            task = asyncio.ensure_future(self._wait_and_move(internal_id, stream, reason, why, str(exc)))
            self._waits.add(task)
            task.add_done_callback(self._waits.discard)
            return True
        return self._move(internal_id, stream, target, reason, why)

    async def _wait_and_move(
        self, internal_id: str, stream: Stream, reason: MigrationReason, why: str, unavailable: str
    ) -> None:
        """Poll for a serving engine for ``wait_s`` (and within the deadline); fail the
        stream UNAVAILABLE if none comes, stop if the caller went away."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.config.wait_s
        if stream.deadline is not None:
            until = min(until, loop.time() + stream.deadline - time.monotonic())
        logger.info("request %s waits up to %.1f s for a serving engine (%s)", internal_id, until - loop.time(), why)
        while self._streams.by_id.get(internal_id) is stream and not stream.finished:
            try:  # any serving engine, the lost one too once it is back (restarted)
                target = self._engines.pick(stream.requests[0])
            except EngineUnavailableError as exc:
                unavailable = str(exc)
                if loop.time() >= until:
                    self._streams.fail(internal_id, stream, EngineUnavailableError(f"{why}; and then {unavailable}"))
                    return
                await asyncio.sleep(_WAIT_POLL_S)
                continue
            if not self._move(internal_id, stream, target, reason, why):
                self._streams.fail(internal_id, stream, EngineUnavailableError(why))
            return

    def _move(
        self, internal_id: str, stream: Stream, target: EngineConnection, reason: MigrationReason, why: str
    ) -> bool:
        """Send ``stream``'s unfinished requests to ``target`` as continuations."""
        lost = stream.engine
        requests = []
        for request in stream.requests:
            if request.pooling_params is not None:  # no tokens: sent again as it was
                requests.append(request)
                continue
            generated = self._output_processor.generated_token_ids(request.request_id)
            if generated is not None:  # None: this child has finished
                requests.append(continuation(request, generated))
        if not requests:
            return False
        lost.abort([r.request_id for r in requests])  # a drained engine: nothing left there
        stream.engine = target
        stream.migrations += 1
        self._streams.mark_moved(stream)
        try:
            send(stream, target, requests)
        except (RequestFailedError, EngineUnavailableError) as exc:
            self._streams.fail(internal_id, stream, exc)
            return True
        generated_total = sum(len(r.generated_token_ids) for r in requests)
        logger.info(
            "request %s migrated from engine %s to engine %s after %d generated token(s) "
            "(%s: %s; migration %d of at most %d)",
            internal_id, lost.address, target.address, generated_total, reason.value, why,
            stream.migrations, self.config.max_migrations,
        )
        if self._metrics is not None:
            self._metrics.request_migrations.labels(reason=reason.value).inc()
        if stream.span is not None:
            stream.span.add_event("tandem.request.migrated", {
                "tandem.migration.reason": reason.value,
                "tandem.migration.from": lost.address,
                "tandem.migration.to": target.address,
                "tandem.migration.generated_tokens": generated_total,
            })
        return True


def add_migration_cli(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument(
        "--no-request-migration", dest="request_migration", action="store_false",
        default=env("TANDEM_REQUEST_MIGRATION", "1").lower() not in ("0", "false", "no", "off"),
        help="Fail a request with UNAVAILABLE when its engine dies or drains it, instead of "
        "continuing it on another engine (env TANDEM_REQUEST_MIGRATION=0; default: migrate).",
    )
    p.add_argument(
        "--request-migration-wait", type=float,
        default=float(env("TANDEM_REQUEST_MIGRATION_WAIT", str(DEFAULT_WAIT_S))),
        help="Seconds a stream whose engine was lost waits for a serving engine when none is "
        "serving at that moment (within its deadline), then fails with UNAVAILABLE; 0: fail at "
        f"once (env TANDEM_REQUEST_MIGRATION_WAIT; default {DEFAULT_WAIT_S:g}).",
    )
    p.add_argument(
        "--max-request-migrations", type=int,
        default=int(env("TANDEM_MAX_REQUEST_MIGRATIONS", str(DEFAULT_MAX_MIGRATIONS))),
        help="Times one request may move to another engine; one more loss fails it with "
        f"UNAVAILABLE (env TANDEM_MAX_REQUEST_MIGRATIONS; default {DEFAULT_MAX_MIGRATIONS}).",
    )


def migration_config_from_args(args: argparse.Namespace) -> MigrationConfig:
    try:
        return MigrationConfig(args.request_migration, args.max_request_migrations, args.request_migration_wait)
    except ValueError as exc:
        raise SystemExit(f"tandem: migration settings: {exc}") from None
