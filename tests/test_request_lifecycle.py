"""The RequestLifecycle's transition table, and that it is the only writer of status."""

from __future__ import annotations

import itertools
import pathlib
import re

import pytest

from engine_service.request import Request, RequestStatus
from engine_service.request_lifecycle import _MOVES, InvalidTransition, RequestLifecycle
from tandem.protocol.outputs import FinishReason
from tests.factories import make_request

S = RequestStatus


def _lifecycle() -> tuple[RequestLifecycle, list[tuple[str, FinishReason]]]:
    released: list[tuple[str, FinishReason]] = []
    return RequestLifecycle("fcfs", lambda r, reason: released.append((r.request_id, reason))), released


def _in(lifecycle: RequestLifecycle, status: RequestStatus) -> Request:
    """A request brought to ``status`` through allowed moves only."""
    request = make_request(4)
    request.resumable = True  # a session (any request may be one)
    lifecycle.add(request)
    if status in (S.RUNNING, S.PREEMPTED, S.IDLE):
        lifecycle.admit(request, 0, 1.0)
    if status is S.PREEMPTED:
        lifecycle.preempt(request, 2.0)
    if status is S.IDLE:
        lifecycle.end_turn(request, FinishReason.STOP, None, 3.0)
    if status is S.WAITING_FOR_REMOTE_KV:
        lifecycle.start_loading(request, 0, 1.0)
    if status is S.FINISHED:
        lifecycle.finish(request, FinishReason.ABORT, 1.0)
    assert request.status is status
    return request


# Each move and the status it goes to, driven through the public methods.
_DO = {
    S.RUNNING: lambda lc, r: lc.admit(r, 0, 5.0),
    S.WAITING_FOR_REMOTE_KV: lambda lc, r: lc.start_loading(r, 0, 5.0),
    S.PREEMPTED: lambda lc, r: lc.preempt(r, 5.0),
    S.IDLE: lambda lc, r: lc.end_turn(r, FinishReason.STOP, None, 5.0),
    S.FINISHED: lambda lc, r: lc.finish(r, FinishReason.ABORT, 5.0),
}


@pytest.mark.parametrize("start,to", list(itertools.product(list(S), list(_DO))))
def test_every_move_is_allowed_exactly_when_the_table_says(start: RequestStatus, to: RequestStatus) -> None:
    lifecycle, _ = _lifecycle()
    request = _in(lifecycle, start)
    if to in _MOVES[start]:
        _DO[to](lifecycle, request)
        assert request.status is to
    else:
        with pytest.raises(InvalidTransition):
            _DO[to](lifecycle, request)
        assert request.status is start  # nothing changed


def test_queues_follow_the_status_and_ends_are_recorded_once_in_order() -> None:
    lifecycle, released = _lifecycle()
    a, b, c = make_request(4), make_request(4), make_request(4)
    for r in (a, b, c):
        lifecycle.add(r)
    lifecycle.admit(a, 0, 1.0)
    lifecycle.start_loading(b, 0, 1.0)
    assert lifecycle.running == [a] and list(lifecycle.loading) == [b.request_id] and len(lifecycle.waiting) == 1
    lifecycle.finish(b, FinishReason.ABORT, 2.0)  # mid-load
    lifecycle.finish(a, FinishReason.LENGTH, 3.0)
    assert lifecycle.take_ended() == [b, a] and lifecycle.take_ended() == []
    assert released == [(b.request_id, FinishReason.ABORT), (a.request_id, FinishReason.LENGTH)]
    assert not lifecycle.running and not lifecycle.loading and set(lifecycle.requests) == {c.request_id}
    assert a.times.finished == 3.0 and a.finish_reason is FinishReason.LENGTH


def test_a_session_turn_ends_idle_and_resumes_waiting() -> None:
    lifecycle, released = _lifecycle()
    request = _in(lifecycle, S.IDLE)
    assert lifecycle.sessions == {request.request_id: request} and not lifecycle.requests
    assert not released  # an idle session keeps its blocks
    request.resume([9], request.sampling_params, 4.0)
    lifecycle.resume(request)
    assert request.status is S.WAITING and lifecycle.waiting.peek() is request and not lifecycle.sessions


def test_only_the_head_of_the_queue_is_admitted() -> None:
    lifecycle, _ = _lifecycle()
    first, second = make_request(4), make_request(4)
    lifecycle.add(first)
    lifecycle.add(second)
    with pytest.raises(InvalidTransition):
        lifecycle.admit(second, 0, 1.0)


def test_request_status_is_assigned_in_one_module() -> None:
    root = pathlib.Path(__file__).resolve().parent.parent
    writers = {
        path.relative_to(root).as_posix()
        for package in ("engine_service", "tandem", "frontend_service")
        for path in (root / package).rglob("*.py")
        if re.search(r"\.status\s*=[^=]", path.read_text())
    }
    assert writers == {"engine_service/request_lifecycle.py"}
