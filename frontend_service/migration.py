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
migrates at most ``max_migrations`` times; after that, or with no engine left, it fails
with UNAVAILABLE.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from frontend_service.admission import RequestFailedError
from frontend_service.engine_client import EngineConnection, EngineUnavailableError
from tandem.protocol.outputs import EngineCoreRequest

if TYPE_CHECKING:
    import argparse

    from frontend_service.async_llm import _Stream

logger = logging.getLogger(__name__)

DEFAULT_MAX_MIGRATIONS = 3


@dataclass(frozen=True)
class MigrationConfig:
    """Whether and how often a request moves to another engine when its engine is lost."""

    enabled: bool = True  # --no-request-migration turns it off: such requests fail UNAVAILABLE
    max_migrations: int = DEFAULT_MAX_MIGRATIONS  # per request; one more loss fails it

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")


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


class Migration:
    """Mixed into AsyncLLM (which provides the streams, engines, output processor, sends)."""

    migration: MigrationConfig
    _moved: set[str]

    def _migrate(self, internal_id: str, stream: _Stream, reason: MigrationReason, why: str) -> bool:
        """Continue ``stream`` on another engine; False when it cannot (migration off, the
        request's limit reached, a session, no other engine): the caller fails it."""
        llm: Any = self
        config = self.migration
        if not config.enabled or stream.session or stream.migrations >= config.max_migrations:
            return False
        lost = stream.engine
        try:
            target: EngineConnection = llm.engines.pick(stream.requests[0], exclude=[lost])
        except EngineUnavailableError:
            return False
        requests = []
        for request in stream.requests:
            if request.pooling_params is not None:  # no tokens: sent again as it was
                requests.append(request)
                continue
            generated = llm.output_processor.generated_token_ids(request.request_id)
            if generated is not None:  # None: this child has finished
                requests.append(continuation(request, generated))
        if not requests:
            return False
        lost.abort([r.request_id for r in requests])  # a drained engine: nothing left there
        stream.engine = target
        stream.migrations += 1
        self._moved.update(stream.engine_request_ids)
        try:
            llm._send(stream, target, requests)
        except (RequestFailedError, EngineUnavailableError) as exc:
            llm._fail(internal_id, stream, exc)
            return True
        generated_total = sum(len(r.generated_token_ids) for r in requests)
        logger.info(
            "request %s migrated from engine %s to engine %s after %d generated token(s) "
            "(%s: %s; migration %d of at most %d)",
            internal_id, lost.address, target.address, generated_total, reason.value, why,
            stream.migrations, config.max_migrations,
        )
        if llm.metrics is not None:
            llm.metrics.request_migrations.labels(reason=reason.value).inc()
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
        "--max-request-migrations", type=int,
        default=int(env("TANDEM_MAX_REQUEST_MIGRATIONS", str(DEFAULT_MAX_MIGRATIONS))),
        help="Times one request may move to another engine; one more loss fails it with "
        f"UNAVAILABLE (env TANDEM_MAX_REQUEST_MIGRATIONS; default {DEFAULT_MAX_MIGRATIONS}).",
    )


def migration_config_from_args(args: argparse.Namespace) -> MigrationConfig:
    try:
        return MigrationConfig(args.request_migration, args.max_request_migrations)
    except ValueError as exc:
        raise SystemExit(f"tandem: --max-request-migrations: {exc}") from None
