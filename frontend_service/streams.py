"""The frontend's per-request routing state: one ``Stream`` per user request, the
``StreamTable`` of the live ones, and ``send`` (a stream's engine requests onto an engine).

Every component of AsyncLLM that starts, moves or ends a request (generation, pooling,
sessions, migration, disaggregation, control) works on the one ``StreamTable`` it is
given; no component keeps its own copy of which request runs where.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from frontend_service.admission import deadline_exceeded
from frontend_service.engine_client import EngineConnection, OutputsRound
from frontend_service.outputs import RequestOutput
from tandem.protocol.outputs import EngineCoreRequest, TokenColumns

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from frontend_service.output_processor import OutputProcessor


def request_ids(request_id: str | None) -> tuple[str, str]:
    """(the caller's id, made up when None; the engine-side id). Engine-side ids stay
    unique even if two clients pick the same request id."""
    user_id = request_id or uuid.uuid4().hex
    return user_id, f"{user_id}-{uuid.uuid4().hex[:8]}"


def user_id_of(internal_id: str) -> str:
    """The caller's id of an engine-side id made by ``request_ids``."""
    return internal_id.rsplit("-", 1)[0]


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
    span: Span | None = None  # the request's trace span, if traced
    # The engine messages whose outputs wait in ``queue``: left once written out.
    rounds: list[OutputsRound] = field(default_factory=list)

    def leave_rounds(self) -> None:
        for outputs_round in self.rounds:
            outputs_round.leave()
        self.rounds.clear()


def send(
    stream: Stream, engine: EngineConnection, requests: Sequence[EngineCoreRequest] | None = None
) -> None:
    """Place the stream's engine requests (or ``requests``: continuations of some of
    them) on ``engine``, with the time left; RequestFailedError (DEADLINE_EXCEEDED) when
    none is."""
    left = None
    if stream.deadline is not None:
        left = stream.deadline - time.monotonic()
        if left <= 0:
            raise deadline_exceeded("the deadline passed before the request reached an engine")
    stream.tried.append(engine)
    for req in stream.requests if requests is None else requests:
        req.timeout_s = left
        engine.add_request(req)


class StreamTable:
    """The live streams, by internal request id and by engine request id.

    Invariants: each engine request id of a tracked stream maps to that stream's
    internal id; ``moved`` holds engine request ids of tracked streams that were placed
    again on another engine (outputs for them from any other engine are stale: aborted
    there), and ``untrack`` drops them.
    """

    def __init__(self, output_processor: OutputProcessor) -> None:
        """``output_processor``: where ``fail`` ends a stream's text state."""
        self._output_processor = output_processor
        self.by_id: dict[str, Stream] = {}  # internal request id -> stream
        self._owner: dict[str, str] = {}  # engine request id -> internal request id
        self.moved: set[str] = set()

    def track(self, internal_id: str, stream: Stream) -> None:
        """Route the engine outputs of ``stream``'s engine requests to it."""
        self.by_id[internal_id] = stream
        for rid in stream.engine_request_ids:
            self._owner[rid] = internal_id

    def untrack(self, internal_id: str, stream: Stream) -> None:
        self.by_id.pop(internal_id, None)
        for rid in stream.engine_request_ids:
            self._owner.pop(rid, None)
            self.moved.discard(rid)

    def find(self, engine_request_id: str) -> tuple[str, Stream] | None:
        """(internal id, stream) of the stream an engine request belongs to."""
        internal_id = self._owner.get(engine_request_id, "")
        stream = self.by_id.get(internal_id)
        return None if stream is None else (internal_id, stream)

    def stream_of(self, engine_request_id: str) -> Stream | None:
        return self.by_id.get(self._owner.get(engine_request_id, ""))

    def mark_moved(self, stream: Stream) -> None:
        """``stream`` now runs elsewhere: its old engine's late outputs are stale."""
        self.moved.update(stream.engine_request_ids)

    def is_stale(self, engine_request_id: str, engine: EngineConnection) -> bool:
        """An output of a moved request from an engine that no longer runs it."""
        return engine_request_id in self.moved and not self._runs_on(engine_request_id, engine)

    def drop_stale_columns(self, engine: EngineConnection, columns: TokenColumns) -> TokenColumns | None:
        """The column outputs minus stale ones (None: nothing left)."""
        moved = self.moved
        keep = [rid not in moved or self._runs_on(rid, engine) for rid in columns.request_ids]
        if all(keep):
            return columns
        return columns.select(keep) if any(keep) else None

    def _runs_on(self, engine_request_id: str, engine: EngineConnection) -> bool:
        stream = self.stream_of(engine_request_id)
        return stream is not None and stream.engine is engine

    def unfinished(self) -> list[tuple[str, Stream]]:
        return [(internal_id, s) for internal_id, s in self.by_id.items() if not s.finished]

    @property
    def num_unfinished(self) -> int:
        return sum(1 for s in self.by_id.values() if not s.finished)

    def fail(self, internal_id: str, stream: Stream, exc: BaseException) -> None:
        """End ``stream`` with ``exc`` for its caller; its engine requests are aborted."""
        result = self._output_processor.abort_requests([internal_id])
        stream.engine.abort(result.reqs_to_abort or stream.engine_request_ids)
        stream.finished = True
        stream.queue.put_nowait(exc)
