"""An engine's clients and what they are sent: ``ClientOutputs``, one per servicer.

It holds the connected clients (frontend streams and in-process readers), which client
owns each accepted request, and the streaming-input sessions between turns. Each step's
outputs are split by owning client and sent in order within each frontend's output
window; the steps made while a frontend is behind go out merged into one message. Runs
on the servicer's event loop only (engine_service/servicer.py builds and drives it);
admission, utility calls and the drain stay with the servicer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.protocol import convert
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    TokenColumns,
    UnmergeableError,
    merge_steps,
)
from tandem.v1 import engine_pb2

# Finish reasons that end a streaming-input session's turn, not the session.
_TURN_ENDS = (FinishReason.STOP, FinishReason.LENGTH)

# What a client's outbox carries: tandem.v1 messages (a frontend stream) or domain steps
# (a local reader); None ends the stream.
Outgoing = engine_pb2.EngineCoreOutputs | EngineCoreOutputs | None


@dataclass
class Client:
    """One connected frontend stream, or (``local``) an in-process reader such as one
    VllmEngine call: a local client's outbox gets the domain ``EngineCoreOutputs`` of
    its requests instead of tandem.v1 messages, and no drain notices (its adds are
    refused while draining all the same)."""

    client_id: int
    outbox: asyncio.Queue[Outgoing] = field(default_factory=asyncio.Queue)
    request_ids: set[str] = field(default_factory=set)
    local: bool = False
    # Flow control (Hello.output_window): at most ``window`` messages unacknowledged;
    # the steps made meanwhile wait in ``pending`` and go out merged. 0: none.
    window: int = 0
    in_flight: int = 0
    pending: list[EngineCoreOutputs] = field(default_factory=list)


class ClientOutputs:
    """The registry of clients and request owners, and the sending to them.

    Invariants: ``owner`` maps every accepted request that has not ended (a session:
    until the session ends, not each turn) to its client's id; a registered client's
    ``request_ids`` are exactly the ids ``owner`` maps to it; ``idle_sessions`` is the
    part of ``resumable`` between turns.
    """

    def __init__(self) -> None:
        self.clients: dict[int, Client] = {}
        self.owner: dict[str, int] = {}  # request id -> client id
        # Streaming-input sessions: their turns end without ending them (owner kept);
        # ``idle_sessions`` are between turns, waiting for the next add or an abort.
        self.resumable: set[str] = set()
        self.idle_sessions: set[str] = set()
        self._client_ids = itertools.count()

    # ---- clients and ownership ------------------------------------------------------

    def open(self, local: bool = False) -> Client:
        """A new registered client."""
        client = Client(next(self._client_ids), local=local)
        self.clients[client.client_id] = client
        return client

    def close(self, client: Client) -> list[str]:
        """Unregister ``client`` and disown what it still runs; returns those request
        ids, for the caller to abort (idempotent: a second call returns none)."""
        self.clients.pop(client.client_id, None)
        ids = [rid for rid in client.request_ids if self.owner.get(rid) == client.client_id]
        client.request_ids.clear()
        for rid in ids:
            del self.owner[rid]
        return ids

    def get(self, client_id: int) -> Client | None:
        return self.clients.get(client_id)

    def owner_client(self, request_id: str) -> Client | None:
        cid = self.owner.get(request_id)
        return None if cid is None else self.clients.get(cid)

    def owned_by(self, client: Client, request_ids: Iterable[str]) -> list[str]:
        """Those of ``request_ids`` that ``client`` owns, in the given order."""
        return [rid for rid in request_ids if self.owner.get(rid) == client.client_id]

    def is_taken(self, client: Client, request_id: str, resumable: bool) -> bool:
        """Whether ``request_id`` already runs, so that an add of it is refused; a
        session between turns takes its next turn (``resumable``) from its own client."""
        if request_id not in self.owner:
            return False
        next_turn = (
            resumable and request_id in self.idle_sessions and self.owner[request_id] == client.client_id
        )
        return not next_turn

    def adopt(self, client: Client, request_id: str, resumable: bool) -> None:
        """Record an admitted request (or a session's next turn) as ``client``'s."""
        if resumable:
            self.resumable.add(request_id)
            self.idle_sessions.discard(request_id)
        self.owner[request_id] = client.client_id
        client.request_ids.add(request_id)

    def disown_all(self) -> list[tuple[str, Client | None]]:
        """Forget every owned request; returns each with its client (None: gone)."""
        left = [(rid, self.clients.get(cid)) for rid, cid in self.owner.items()]
        self.owner.clear()
        for rid, client in left:
            if client is not None:
                client.request_ids.discard(rid)
        return left

    # ---- a step's outputs -----------------------------------------------------------

    def dispatch(self, outs: EngineCoreOutputs, draining: bool) -> None:
        """Split one step's request outputs by owning client and forget the requests
        that ended; every frontend gets the stats, a local reader only steps with
        outputs. ``draining``: what each message says. ``outs`` carries no utility
        output (the servicer answers those)."""
        per_client: dict[int, list[EngineCoreOutput]] = {cid: [] for cid in self.clients}
        for out in outs.outputs:
            cid = self.owner.get(out.request_id)
            if cid is None:
                continue
            if cid in per_client:
                per_client[cid].append(out)
            if out.finished:
                if out.request_id in self.resumable and out.finish_reason in _TURN_ENDS:
                    self.idle_sessions.add(out.request_id)  # the session goes on
                    continue
                self.resumable.discard(out.request_id)
                self.idle_sessions.discard(out.request_id)
                del self.owner[out.request_id]
                if cid in self.clients:
                    self.clients[cid].request_ids.discard(out.request_id)
        columns = self._columns_by_client(outs.token_columns)
        for cid, outputs in per_client.items():
            step = EngineCoreOutputs(
                engine_index=outs.engine_index,
                outputs=outputs,
                scheduler_stats=outs.scheduler_stats,
                timestamp=outs.timestamp,
                finished_requests={o.request_id for o in outputs if o.finished} or None,
                draining=draining,
                token_columns=columns.get(cid),
            )
            client = self.clients[cid]
            if client.local:
                if outputs or step.token_columns is not None:
                    client.outbox.put_nowait(step)
            elif client.window and (client.pending or client.in_flight >= client.window):
                client.pending.append(step)  # the frontend is behind: merged later
            else:
                self._put(client, convert.engine_core_outputs_to_proto(step))

    def _columns_by_client(self, cols: TokenColumns | None) -> dict[int, TokenColumns]:
        """Each connected client's share of the step's column outputs (none of which
        finished, so no bookkeeping); requests without a live owner are dropped."""
        if not cols:
            return {}
        owners = list(map(self.owner.get, cols.request_ids))
        first = owners[0]
        if owners.count(first) == len(owners):  # one client owns all: the usual case
            return {first: cols} if first in self.clients else {}
        return {
            cid: cols.select([o == cid for o in owners])
            for cid in self.clients
            if cid in owners
        }

    # ---- messages outside the step flow ---------------------------------------------

    def send_now(self, client: Client, msg: engine_pb2.EngineCoreOutputs | None) -> None:
        """A message outside the step flow (utility answer, drain, refusal, end of
        stream): whatever is held back goes first. None ends the stream."""
        self._flush(client, force=True)
        if msg is None:
            client.outbox.put_nowait(None)
        else:
            self._put(client, msg)

    def send_step(self, client: Client, step: EngineCoreOutputs) -> None:
        """A domain step outside the step flow (a refusal): as it is to a local
        reader, as a tandem.v1 message (``send_now``) to a frontend."""
        if client.local:
            client.outbox.put_nowait(step)
        else:
            self.send_now(client, convert.engine_core_outputs_to_proto(step))

    def broadcast(self, msg: engine_pb2.EngineCoreOutputs) -> None:
        """``msg`` to every frontend stream (local readers get no notices)."""
        for client in self.clients.values():
            if not client.local:
                self.send_now(client, msg)

    def end_streams(self) -> None:
        """End every client's stream, after what is held back for it."""
        for client in self.clients.values():
            self.send_now(client, None)

    def acknowledged(self, client: Client, count: int) -> None:
        """The frontend read ``count`` messages: send what its window now allows."""
        client.in_flight = max(0, client.in_flight - count)
        self._flush(client)

    # ---- sending to a frontend: in order, within its output window -----------------

    def _put(self, client: Client, msg: engine_pb2.EngineCoreOutputs) -> None:
        if client.window:
            client.in_flight += 1
        client.outbox.put_nowait(msg)

    def _flush(self, client: Client, force: bool = False) -> None:
        """Send the steps held back for ``client``, merged into one message where they
        can be (``force``: even beyond its window, before a message that must follow them)."""
        if not client.pending or (not force and client.in_flight >= client.window):
            return
        steps, client.pending = client.pending, []
        with contextlib.suppress(UnmergeableError):  # else each step as it was
            steps = [merge_steps(steps)]
        for step in steps:
            self._put(client, convert.engine_core_outputs_to_proto(step))
