"""Engine admission control: bounds on the waiting queue, and the retry hint.

A request is refused at arrival (RESOURCE_EXHAUSTED, never queued) when either bound
would be crossed:

* ``max_pending_requests``: requests in the waiting queue (preempted ones included).
* ``max_pending_tokens``: tokens of the waiting requests (each needs that many KV slots
  once it runs) plus the newcomer's prompt. Set to a multiple of the KV cache's token
  capacity, it refuses work the cache could not start on for several full turnovers,
  whatever the request count. A newcomer that finds the waiting queue empty always
  passes this check: validation already guarantees one request fits the cache.

The retry hint is the expected wait for the waiting queue to shrink by one: the
inverse of an EWMA of the rate at which requests leave it for the running batch,
measured only while the queue is non-empty (an idle engine has no drain rate).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_service.request import Request, RequestStatus
from engine_service.scheduler_hooks import SchedulerFeature, Verdict
from tandem.drain_rate import DrainRate
from tandem.protocol.outputs import ErrorCode, FinishReason, RequestError

if TYPE_CHECKING:
    from engine_service.kv_cache.manager import KVBlocks
    from engine_service.request_lifecycle import RequestLifecycle

__all__ = ["AdmissionController", "AdmissionLimits", "Deadlines", "DrainRate", "RequestRejected"]


class RequestRejected(Exception):
    """The engine ended a request at arrival; ``error`` is the status to report."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds on the waiting queue; 0 disables a bound."""

    max_pending_requests: int = 0
    max_pending_tokens: int = 0


class AdmissionController:
    """Decides whether a new request may join the waiting queue."""

    def __init__(self, limits: AdmissionLimits, drain_rate: DrainRate | None = None) -> None:
        self.limits = limits
        self.drain_rate = drain_rate if drain_rate is not None else DrainRate()

    def check(self, num_waiting: int, waiting_tokens: int, num_new_tokens: int) -> None:
        """Raise RequestRejected(RESOURCE_EXHAUSTED) when admitting would cross a bound."""
        limits = self.limits
        if limits.max_pending_requests and num_waiting >= limits.max_pending_requests:
            self._reject(
                f"the engine's waiting queue is full ({num_waiting} requests, "
                f"max_pending_requests={limits.max_pending_requests})"
            )
        if (
            limits.max_pending_tokens
            and num_waiting
            and waiting_tokens + num_new_tokens > limits.max_pending_tokens
        ):
            self._reject(
                f"the engine's waiting queue holds {waiting_tokens} tokens; "
                f"{num_new_tokens} more would exceed max_pending_tokens="
                f"{limits.max_pending_tokens} (max_pending_kv_multiple x the KV cache)"
            )

    def _reject(self, message: str) -> None:
        raise RequestRejected(
            RequestError(
                ErrorCode.RESOURCE_EXHAUSTED,
                message,
                retry_after_ms=self.drain_rate.retry_after_ms(),
            )
        )


def deadline_error(message: str) -> RequestError:
    """The DEADLINE_EXCEEDED error a request ends with."""
    return RequestError(ErrorCode.DEADLINE_EXCEEDED, message)


class PrefillBound:
    """A lower bound on how long a prefill of ``n`` tokens takes, from measured steps.

    A prefill of ``n`` tokens needs at least ``ceil(n / max_num_batched_tokens)`` steps,
    each no faster than the fastest step seen, and no more tokens per second than the
    best step managed: the bound is the larger of the two. Both records decay by
    ``decay`` per step toward the current speed, so a machine that got slower (other
    load, longer contexts) is not judged by an old best. Shedding a request whose
    remaining time is below this bound drops only requests that cannot make it.
    """

    def __init__(self, max_num_batched_tokens: int, decay: float = 0.99) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decay = decay
        self.fastest_step: float | None = None  # seconds
        self.peak_rate: float | None = None  # tokens per second

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step that computed ``num_tokens`` tokens in ``seconds``."""
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        if self.fastest_step is None or self.peak_rate is None:
            self.fastest_step, self.peak_rate = seconds, rate
            return
        self.fastest_step = min(seconds, self.fastest_step / self.decay)
        self.peak_rate = max(rate, self.peak_rate * self.decay)

    def seconds(self, num_tokens: int) -> float:
        """At least this long to prefill ``num_tokens`` tokens (0.0 before any step)."""
        if self.fastest_step is None or self.peak_rate is None or num_tokens <= 0:
            return 0.0
        steps = -(-num_tokens // self.max_num_batched_tokens)
        return max(steps * self.fastest_step, num_tokens / self.peak_rate)


class Deadlines(SchedulerFeature):
    """Requests whose deadline passed end with DEADLINE_EXCEEDED, waiting, running or
    idle (``expire``, before each schedule), and a waiting request whose fastest
    possible prefill would end after its deadline is shed before it starts (``place``)."""

    def __init__(self, lifecycle: RequestLifecycle, prefill_bound: PrefillBound) -> None:
        self.lifecycle = lifecycle
        self.prefill_bound = prefill_bound
        # (deadline, seq, request) of every request with a deadline; ended ones are
        # dropped lazily when they reach the top.
        self._heap: list[tuple[float, int, Request]] = []
        self._seq = itertools.count()

    def added(self, request: Request) -> None:
        if request.deadline is not None:
            heapq.heappush(self._heap, (request.deadline, next(self._seq), request))

    def before_schedule(self, now: float) -> None:
        self.expire(now)

    def expire(self, now: float) -> list[Request]:
        """End every request whose deadline is at or before ``now``, waiting, running or
        idle, with FinishReason.ERROR and DEADLINE_EXCEEDED; their blocks are free on
        return. Returns them."""
        expired = []
        while self._heap and self._heap[0][0] <= now:
            _, _, request = heapq.heappop(self._heap)
            if request.is_finished:
                continue
            if request.status == RequestStatus.IDLE:
                message = "the session's deadline passed"
            else:
                where = "running" if request.status == RequestStatus.RUNNING else "waiting"
                message = (
                    f"the request's deadline passed while it was {where} "
                    f"({request.num_output_tokens} tokens generated)"
                )
            self.lifecycle.finish(request, FinishReason.ERROR, now, error=deadline_error(message))
            expired.append(request)
        return expired

    def place(self, request: Request, hit: KVBlocks, num_new_tokens: int, now: float) -> Verdict:
        """Shed the queue head if even the fastest prefill of its ``num_new_tokens``
        uncomputed tokens would end after its deadline."""
        if request.deadline is None:
            return Verdict.ADMIT
        left = request.deadline - now
        need = self.prefill_bound.seconds(num_new_tokens)
        if left >= need:
            return Verdict.ADMIT
        error = deadline_error(
            f"shed before prefill: {max(left, 0.0) * 1000:.0f} ms left to the deadline, "
            f"a prefill of {num_new_tokens} tokens takes at least {need * 1000:.0f} ms here"
        )
        self.lifecycle.finish(request, FinishReason.ERROR, now, error=error)
        return Verdict.TAKEN
