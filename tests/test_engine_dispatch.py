"""The engine servicer's split of one step's outputs among its clients (no model runs)."""

from __future__ import annotations

import asyncio
from typing import Any

from engine_service.client_outputs import Client
from engine_service.servicer import EngineServicer
from tandem.protocol import convert
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
    TokenColumns,
)


def _servicer(model_dir: str, owners: dict[str, int], local: set[int]) -> EngineServicer:
    servicer = EngineServicer(model_dir)
    for cid in sorted(set(owners.values()) | local):
        servicer.outputs.clients[cid] = Client(cid, local=cid in local)
    for rid, cid in owners.items():
        servicer.outputs.owner[rid] = cid
        servicer.outputs.clients[cid].request_ids.add(rid)
    return servicer


def _received(queue: asyncio.Queue[Any]) -> EngineCoreOutputs:
    item = queue.get_nowait()
    assert queue.empty()
    if isinstance(item, EngineCoreOutputs):
        return item
    return convert.engine_core_outputs_from_proto(item)


def test_columns_are_split_by_owner_and_unowned_ones_dropped(tiny_llama_dir: str) -> None:
    owners = {"a0": 0, "b0": 1, "a1": 0, "c0": 2, "b1": 1, "b2": 1}
    servicer = _servicer(tiny_llama_dir, owners, local={2})
    columns = TokenColumns(
        ["a0", "b0", "gone", "a1", "c0", "b1"], [10, 11, 12, 13, 14, 15], None, [0, 4, 0, 0, 8, 0]
    )
    done = EngineCoreOutput("b2", [], finish_reason=FinishReason.ABORT)
    stats = SchedulerStats(num_running_reqs=5)
    step = EngineCoreOutputs(outputs=[done], token_columns=columns, scheduler_stats=stats)
    servicer.outputs.dispatch(step, draining=False)

    first, second, local = (_received(servicer.outputs.clients[cid].outbox) for cid in (0, 1, 2))
    assert first.token_columns == TokenColumns(["a0", "a1"], [10, 13])
    assert first.outputs == [] and first.scheduler_stats == stats
    assert second.token_columns == TokenColumns(["b0", "b1"], [11, 15], None, [4, 0])
    assert second.outputs == [done] and second.finished_requests == {"b2"}
    assert local.token_columns == TokenColumns(["c0"], [14], None, [8])
    # Only the finished request was forgotten; column outputs never finish one.
    assert "b2" not in servicer.outputs.owner and servicer.outputs.clients[1].request_ids == {"b0", "b1"}
    assert set(servicer.outputs.owner) == {"a0", "b0", "a1", "c0", "b1"}


def test_one_owner_gets_the_columns_as_they_are(tiny_llama_dir: str) -> None:
    servicer = _servicer(tiny_llama_dir, {"x": 3, "y": 3}, local={3})
    columns = TokenColumns(["y", "x"], [1, 2, 3], [2, 1])
    servicer.outputs.dispatch(EngineCoreOutputs(token_columns=columns), draining=False)
    assert _received(servicer.outputs.clients[3].outbox).token_columns is columns


def test_a_step_for_nobody_sends_no_columns(tiny_llama_dir: str) -> None:
    servicer = _servicer(tiny_llama_dir, {"mine": 0}, local=set())
    columns = TokenColumns(["other", "gone"], [1, 2])
    servicer.outputs.dispatch(EngineCoreOutputs(token_columns=columns), draining=False)
    step = _received(servicer.outputs.clients[0].outbox)  # remote clients get the stats every step
    assert step.token_columns is None and step.outputs == []


def test_empty_columns_send_nothing(tiny_llama_dir: str) -> None:
    servicer = _servicer(tiny_llama_dir, {"mine": 0}, local={0})
    servicer.outputs.dispatch(EngineCoreOutputs(token_columns=TokenColumns([], [])), draining=False)
    assert servicer.outputs.clients[0].outbox.empty()  # a local client gets only steps with outputs
