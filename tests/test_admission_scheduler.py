"""Engine admission control and deadlines, on the scheduler without a model."""

from __future__ import annotations

import time

import pytest

from engine_service.admission import (
    AdmissionController,
    AdmissionLimits,
    DrainRate,
    PrefillBound,
    RequestRejected,
)
from engine_service.request import Request, RequestStatus
from engine_service.scheduler import Scheduler
from engine_service.waiting_queue import WaitingQueue
from tandem.drain_rate import MAX_RETRY_AFTER_MS
from tandem.protocol.outputs import ErrorCode, FinishReason
from tests.factories import fake_step, make_request, make_scheduler


def _with_deadline(request: Request, deadline: float | None) -> Request:
    request.deadline = deadline
    return request


def _admit(sched: Scheduler, admission: AdmissionController, request: Request) -> None:
    admission.check(len(sched.lifecycle.waiting), sched.lifecycle.waiting.num_tokens, request.num_tokens)
    sched.add_request(request)


# ---- the bounded waiting queue ----------------------------------------------------------


def test_full_waiting_queue_rejects_with_resource_exhausted_and_a_retry_hint() -> None:
    sched = make_scheduler(max_num_seqs=1)
    rate = DrainRate(window_s=0.5)
    admission = AdmissionController(AdmissionLimits(max_pending_requests=2), rate)
    _admit(sched, admission, make_request(4, max_tokens=50))
    fake_step(sched)  # the first one runs; the queue is empty again
    _admit(sched, admission, make_request(4))
    _admit(sched, admission, make_request(4))
    with pytest.raises(RequestRejected) as info:
        _admit(sched, admission, make_request(4))
    error = info.value.error
    assert error.code == ErrorCode.RESOURCE_EXHAUSTED
    assert "max_pending_requests=2" in error.message
    assert error.retry_after_ms > 0
    assert len(sched.lifecycle.waiting) == 2 and len(sched.lifecycle.running) == 1


def test_retry_hint_follows_the_measured_drain_rate() -> None:
    rate = DrainRate(window_s=0.5, alpha=1.0)
    rate.observe(10.0, 0, num_waiting=5)
    rate.observe(11.0, 4, num_waiting=3)  # 4 admitted in 1 s: one every 250 ms
    assert rate.retry_after_ms() == 250
    rate.observe(12.0, 1, num_waiting=3)  # slower: one a second
    assert rate.retry_after_ms() == 1000
    rate.observe(20.0, 0, num_waiting=3)  # nothing drains: the hint is clamped
    assert rate.retry_after_ms() == MAX_RETRY_AFTER_MS


def test_idle_time_does_not_count_as_slow_draining() -> None:
    rate = DrainRate(window_s=0.5, alpha=1.0)
    rate.observe(0.0, 0, num_waiting=2)
    rate.observe(1.0, 2, num_waiting=0)  # drained 2/s, then idle
    rate.observe(100.0, 0, num_waiting=0)
    rate.observe(100.1, 0, num_waiting=1)
    assert rate.retry_after_ms() == 500


def test_waiting_tokens_bound_rejects_only_behind_a_non_empty_queue() -> None:
    sched = make_scheduler(max_num_seqs=1)
    admission = AdmissionController(AdmissionLimits(max_pending_tokens=20))
    _admit(sched, admission, make_request(30))  # alone: always admitted
    with pytest.raises(RequestRejected) as info:
        _admit(sched, admission, make_request(4))
    assert info.value.error.code == ErrorCode.RESOURCE_EXHAUSTED
    assert "max_pending_tokens=20" in info.value.error.message
    assert sched.lifecycle.waiting.num_tokens == 30
    sched.lifecycle.waiting.pop()
    assert sched.lifecycle.waiting.num_tokens == 0


# ---- deadlines -----------------------------------------------------------------------------


def test_expired_requests_are_dropped_waiting_and_aborted_running_with_blocks_freed() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=1)
    now = time.monotonic()
    running = _with_deadline(make_request(10, max_tokens=100), now + 100)
    waiting = _with_deadline(make_request(10, max_tokens=100), now + 200)
    no_deadline = make_request(10, max_tokens=100)
    for r in (running, waiting, no_deadline):
        sched.add_request(r)
    for _ in range(3):
        fake_step(sched)
    assert running.status == RequestStatus.RUNNING and running.num_output_tokens > 0
    assert sched.kv.pool.num_free_blocks < sched.kv.pool.num_blocks

    assert sched.deadlines.expire(now + 99) == []
    expired = sched.deadlines.expire(now + 250)
    assert set(expired) == {running, waiting}
    for r in expired:
        assert r.finish_reason == FinishReason.ERROR
        assert r.error is not None and r.error.code == ErrorCode.DEADLINE_EXCEEDED
        assert r.request_id not in sched.requests
    assert "running" in running.error.message and "waiting" in waiting.error.message
    assert no_deadline in list(sched.lifecycle.waiting) or no_deadline in sched.lifecycle.running
    sched.finish_requests([no_deadline.request_id], FinishReason.ABORT)
    assert sched.num_unfinished == 0
    sched.kv.pool.check_invariants()
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks


def test_a_finished_request_does_not_expire_later() -> None:
    sched = make_scheduler()
    now = time.monotonic()
    r = _with_deadline(make_request(4, max_tokens=1), now + 10)
    sched.add_request(r)
    fake_step(sched)
    assert r.finish_reason == FinishReason.LENGTH
    assert sched.deadlines.expire(now + 20) == []


# ---- earliest deadline first ------------------------------------------------------------


def _drain(queue: WaitingQueue) -> list[str]:
    names = []
    while len(queue):
        assert queue.peek() is not None
        names.append(queue.pop().request_id)
    return names


def test_fcfs_serves_deadline_requests_earliest_first_in_their_own_slots() -> None:
    queue = WaitingQueue("fcfs")
    queue.add(make_request(2, request_id="a"))
    queue.add(_with_deadline(make_request(2, request_id="b"), 10.0))
    queue.add(_with_deadline(make_request(2, request_id="c"), 5.0))
    queue.add(make_request(2, request_id="d"))
    queue.add(_with_deadline(make_request(2, request_id="e"), 1.0))
    # Slots at positions 2, 3, 5 go to e, c, b; a and d keep their places.
    assert _drain(queue) == ["a", "e", "c", "d", "b"]
    assert queue.num_tokens == 0


def test_priority_policy_applies_edf_within_one_priority_level() -> None:
    queue = WaitingQueue("priority")
    queue.add(_with_deadline(make_request(2, priority=1, arrival=1.0, request_id="p1-late"), 9.0))
    queue.add(_with_deadline(make_request(2, priority=1, arrival=2.0, request_id="p1-soon"), 2.0))
    queue.add(_with_deadline(make_request(2, priority=0, arrival=3.0, request_id="p0-late"), 50.0))
    queue.add(make_request(2, priority=0, arrival=4.0, request_id="p0-none"))
    # A tighter deadline never jumps a priority level.
    assert _drain(queue) == ["p0-late", "p0-none", "p1-soon", "p1-late"]


def test_removing_a_deadline_request_keeps_one_slot_per_request() -> None:
    queue = WaitingQueue("fcfs")
    b = _with_deadline(make_request(2, request_id="b"), 10.0)
    queue.add(_with_deadline(make_request(2, request_id="a"), 20.0))
    queue.add(b)
    queue.add(make_request(2, request_id="c"))
    queue.remove(b)
    assert len(queue) == 2 and sorted(r.request_id for r in queue) == ["a", "c"]
    assert _drain(queue) == ["a", "c"]


def test_scheduler_admits_the_earliest_deadline_first() -> None:
    sched = make_scheduler(max_num_seqs=1)
    first = make_request(4, max_tokens=2)
    late = _with_deadline(make_request(4, max_tokens=2), 1e12)
    soon = _with_deadline(make_request(4, max_tokens=2), 1e11)
    for r in (first, late, soon):
        sched.add_request(r)
    order = []
    while sched.num_unfinished:
        out, _ = fake_step(sched)
        for s in out.scheduled:
            if s.request.request_id not in order:
                order.append(s.request.request_id)
    assert order == [first.request_id, soon.request_id, late.request_id]


# ---- shedding before prefill --------------------------------------------------------------


def test_prefill_bound_is_the_larger_of_step_count_and_peak_rate() -> None:
    bound = PrefillBound(max_num_batched_tokens=64, decay=1.0)
    assert bound.seconds(1000) == 0.0  # nothing measured: never sheds
    bound.observe(64, 0.5)  # 128 tokens/s
    bound.observe(1, 0.01)  # a fast decode step: 100 tokens/s
    assert bound.fastest_step == 0.01 and bound.peak_rate == 128.0
    assert bound.seconds(640) == pytest.approx(5.0)  # rate-bound: 640 / 128
    assert bound.seconds(10) == pytest.approx(10 / 128)


def test_a_request_that_cannot_prefill_before_its_deadline_is_shed() -> None:
    sched = make_scheduler(max_num_seqs=4)
    sched.prefill_bound.observe(64, 1.0)  # this "machine" prefills 64 tokens/s at best
    now = time.monotonic()
    hopeless = _with_deadline(make_request(32), now + 0.1)  # needs >= 0.5 s
    fine = _with_deadline(make_request(32, max_tokens=1), now + 3600)
    sched.add_request(hopeless)
    sched.add_request(fine)
    out, ended = fake_step(sched)
    assert [s.request for s in out.scheduled] == [fine]
    assert ended == [hopeless, fine]  # shed at admission; then fine's only token
    assert hopeless.finish_reason == FinishReason.ERROR
    assert hopeless.error is not None and hopeless.error.code == ErrorCode.DEADLINE_EXCEEDED
    assert "shed before prefill" in hopeless.error.message
    assert sched.take_ended() == []
    assert sched.num_unfinished == 0
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
