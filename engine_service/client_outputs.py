"""An engine's outputs to its clients: each step split by owning client (frontend
streams and in-process readers), sent in order within each frontend's output window,
the steps made while a frontend is behind merged into one message. Mixed into the
servicer (engine_service/servicer.py), on its event loop."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Status, StatusCode

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


@dataclass
class _Client:
    """One connected frontend stream, or (``local``) an in-process reader such as one
    VllmEngine call: a local client's outbox gets the domain ``EngineCoreOutputs`` of
    its requests instead of tandem.v1 messages, and no drain notices (its adds are
    refused while draining all the same)."""

    client_id: int
    outbox: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    request_ids: set[str] = field(default_factory=set)
    local: bool = False
    # Flow control (Hello.output_window): at most ``window`` messages unacknowledged;
    # the steps made meanwhile wait in ``pending`` and go out merged. 0: none.
    window: int = 0
    in_flight: int = 0
    pending: list[EngineCoreOutputs] = field(default_factory=list)


class ClientOutputs:
    """Needs the servicer's ``clients``, ``owner`` (request id -> client id),
    ``resumable`` and ``idle_sessions`` (sessions), ``pending_utility`` and
    ``_utility_spans`` (utility calls), ``draining`` and ``_note_if_drained``."""

    clients: dict[int, _Client]
    owner: dict[str, int]
    resumable: set[str]
    idle_sessions: set[str]
    pending_utility: dict[int, Any]
    _utility_spans: dict[int, Any]
    draining: bool
    _note_if_drained: Any

    def _dispatch(self, outs: EngineCoreOutputs) -> None:
        """Split one step's outputs by owning client; every client gets the stats."""
        if outs.utility_output is not None:
            span = self._utility_spans.pop(outs.utility_output.call_id, None)
            if span is not None:
                if outs.utility_output.failure_message is not None:
                    span.set_status(Status(StatusCode.ERROR, outs.utility_output.failure_message))
                span.end()
            target = self.pending_utility.pop(outs.utility_output.call_id, None)
            if isinstance(target, asyncio.Future):
                if not target.done():
                    target.set_result(outs.utility_output)
                return
            if isinstance(target, tuple) and target[0] in self.clients:
                utility = convert.utility_output_to_proto(outs.utility_output)
                utility.call_id = target[1]
                msg = engine_pb2.EngineCoreOutputs(
                    engine_index=outs.engine_index, utility_output=utility, timestamp=outs.timestamp,
                    draining=self.draining,
                )
                self._send_now(self.clients[target[0]], msg)
            return
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
                draining=self.draining,
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
        self._note_if_drained()

    # ---- sending to a frontend: in order, within its output window -----------------

    def _put(self, client: _Client, msg: engine_pb2.EngineCoreOutputs) -> None:
        if client.window:
            client.in_flight += 1
        client.outbox.put_nowait(msg)

    def _flush(self, client: _Client, force: bool = False) -> None:
        """Send the steps held back for ``client``, merged into one message where they
        can be (``force``: even beyond its window, before a message that must follow them)."""
        if not client.pending or (not force and client.in_flight >= client.window):
            return
        steps, client.pending = client.pending, []
        with contextlib.suppress(UnmergeableError):  # else each step as it was
            steps = [merge_steps(steps)]
        for step in steps:
            self._put(client, convert.engine_core_outputs_to_proto(step))

    def _send_now(self, client: _Client, msg: engine_pb2.EngineCoreOutputs | None) -> None:
        """A message outside the step flow (utility answer, drain, refusal, end of
        stream): whatever is held back goes first. None ends the stream."""
        self._flush(client, force=True)
        if msg is None:
            client.outbox.put_nowait(None)
        else:
            self._put(client, msg)

    def _acknowledged(self, client: _Client, count: int) -> None:
        client.in_flight = max(0, client.in_flight - count)
        self._flush(client)

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
