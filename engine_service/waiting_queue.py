"""The scheduler's waiting queue: base order, plus earliest-deadline-first among deadlines.

Base order: ``fcfs`` is arrival order (a preempted request goes back to the front);
``priority`` is (priority value, arrival time), lower first.

Requests that carry a deadline compose with the base order through *slots*: such a
request holds a slot where it arrived in the base order, and when a slot reaches the
head, the waiting request with the earliest deadline among the deadline requests of
that slot's priority (all of them, under fcfs) is served in it. Deadline requests thus
reorder only among themselves; a request without a deadline is never passed by more
requests than plain fcfs / priority would let pass it, so it cannot starve behind a
stream of deadline requests. Removing a deadline request gives up the latest slot of
its priority, keeping one slot per waiting deadline request.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from engine_service.request import Request

# (priority, order, seq, request or None for a deadline slot); seq is unique, so the
# comparison never reaches the last field.
_Entry = tuple[int, float, int, Request | None]


class WaitingQueue:
    """Requests not running. ``num_tokens``: their tokens (each needs that many KV slots)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._heap: list[_Entry] = []
        # priority -> heap of (deadline, seq, request): the deadline requests of that level.
        self._edf: dict[int, list[tuple[float, int, Request]]] = {}
        self._seq = itertools.count()
        self._front = itertools.count(-1, -1)  # fcfs order of requests put back in front
        self._len = 0
        self.num_tokens = 0

    def _level(self, request: Request) -> int:
        return request.priority if self.policy == "priority" else 0

    def add(self, request: Request, front: bool = False) -> None:
        seq = next(self._seq)
        level = self._level(request)
        if self.policy == "priority":
            order: float = request.arrival_time
        else:
            order = next(self._front) if front else seq
        if request.deadline is None:
            heapq.heappush(self._heap, (level, order, seq, request))
        else:
            heapq.heappush(self._heap, (level, order, seq, None))
            heapq.heappush(self._edf.setdefault(level, []), (request.deadline, seq, request))
        self._len += 1
        self.num_tokens += request.num_tokens

    def peek(self) -> Request:
        level, _, _, request = self._heap[0]
        return request if request is not None else self._edf[level][0][2]

    def pop(self) -> Request:
        level, _, _, request = heapq.heappop(self._heap)
        if request is None:
            request = heapq.heappop(self._edf[level])[2]
        self._taken(request)
        return request

    def remove(self, request: Request) -> None:
        level = self._level(request)
        if request.deadline is None:
            self._heap = [e for e in self._heap if e[3] is not request]
        else:
            edf = self._edf[level]
            self._edf[level] = [e for e in edf if e[2] is not request]
            heapq.heapify(self._edf[level])
            slots = [e for e in self._heap if e[3] is None and e[0] == level]
            latest = max(slots)
            self._heap = [e for e in self._heap if e is not latest]
        heapq.heapify(self._heap)
        self._taken(request)

    def _taken(self, request: Request) -> None:
        self._len -= 1
        self.num_tokens -= request.num_tokens

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in no particular order."""
        yield from (e[3] for e in self._heap if e[3] is not None)
        for edf in self._edf.values():
            yield from (e[2] for e in edf)
