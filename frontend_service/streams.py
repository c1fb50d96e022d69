"""Where one user request's outputs go, and which engine runs it: the state AsyncLLM and
its mixins (migration, pooling, sessions, control, disaggregation) share per stream."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from frontend_service.engine_client import EngineConnection, OutputsRound
from frontend_service.outputs import RequestOutput
from tandem.protocol.outputs import EngineCoreRequest


def request_ids(request_id: str | None) -> tuple[str, str]:
    """(the caller's id, made up when None; the engine-side id). Engine-side ids stay
    unique even if two clients pick the same request id."""
    user_id = request_id or uuid.uuid4().hex
    return user_id, f"{user_id}-{uuid.uuid4().hex[:8]}"


@dataclass
class Stream:
    """Where one user request's outputs go, and which engine runs it."""

    queue: asyncio.Queue[RequestOutput | BaseException]
    engine: EngineConnection
    engine_request_ids: list[str]
    finished: bool = False
    requests: list[EngineCoreRequest] = field(default_factory=list)  # to place again
    deadline: float | None = None  # time.monotonic() when the caller stops waiting
    tried: list[EngineConnection] = field(default_factory=list)  # engines it was sent to
    got_output: bool = False  # an engine produced something for it
    migrations: int = 0  # times it moved on after losing its engine (migration.py)
    session: bool = False  # a streaming-input session: bound to its engine, never migrated
    span: Any = None  # the request's trace span, if traced
    # The engine messages whose outputs wait in ``queue``: left once written out.
    rounds: list[OutputsRound] = field(default_factory=list)

    def leave_rounds(self) -> None:
        for outputs_round in self.rounds:
            outputs_round.leave()
        self.rounds.clear()
