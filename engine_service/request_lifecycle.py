"""The one owner of a request's status and queue membership, and of "ended" events.

The moves (any other raises ``InvalidTransition``)::

    WAITING, PREEMPTED      --admit-->          RUNNING
    WAITING, PREEMPTED      --start_loading-->  WAITING_FOR_REMOTE_KV
    WAITING_FOR_REMOTE_KV   --loaded-->         WAITING (front of the queue)
    RUNNING                 --preempt-->        PREEMPTED (front of the queue)
    RUNNING                 --end_turn-->       IDLE (a session between turns)
    IDLE                    --resume-->         WAITING
    any but FINISHED        --finish-->         FINISHED

Where each state lives: WAITING and PREEMPTED in ``waiting``, RUNNING in ``running``,
WAITING_FOR_REMOTE_KV in ``loading``, IDLE in ``sessions``; ``requests`` holds every
request of the first four (the unfinished ones). ``finish`` and ``end_turn`` record the
request as ended, with its reason on it; ``take_ended`` hands those to the step's
outputs, in the order they ended: the one way "this request ended" travels.

A request's KV blocks are not this module's: ``finish`` calls the ``release`` given at
construction (kv_transfer/scheduling.py's ``KvTransfer.release``) with the request in
the state it ended from.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_service.request import Request, RequestStatus
from engine_service.waiting_queue import WaitingQueue
from tandem.protocol.outputs import FinishReason, RequestError

S = RequestStatus
_MOVES: dict[RequestStatus, frozenset[RequestStatus]] = {
    S.WAITING: frozenset({S.RUNNING, S.WAITING_FOR_REMOTE_KV, S.FINISHED}),
    S.PREEMPTED: frozenset({S.RUNNING, S.WAITING_FOR_REMOTE_KV, S.FINISHED}),
    S.WAITING_FOR_REMOTE_KV: frozenset({S.WAITING, S.FINISHED}),
    S.RUNNING: frozenset({S.PREEMPTED, S.IDLE, S.FINISHED}),
    S.IDLE: frozenset({S.WAITING, S.FINISHED}),
    S.FINISHED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A status change the table above does not allow (a bug, never bad input)."""


class RequestLifecycle:
    """Statuses and queues of one scheduler's requests. Not thread-safe (the engine thread)."""

    def __init__(self, policy: str, release: Callable[[Request, FinishReason], None]) -> None:
        """``policy``: the waiting queue's order (waiting_queue.py); ``release``: gives
        back an ending request's KV blocks (called before its status changes)."""
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        self.sessions: dict[str, Request] = {}
        self._release = release
        self._ended: list[Request] = []
        self.num_preemptions = 0  # since take_num_preemptions()
        self.num_admitted = 0  # waiting -> running since take_num_admitted()

    @staticmethod
    def _check(request: Request, to: RequestStatus) -> None:
        if to not in _MOVES[request.status]:
            raise InvalidTransition(f"{request.request_id}: {request.status.name} -> {to.name}")

    @classmethod
    def _move(cls, request: Request, to: RequestStatus) -> None:
        cls._check(request, to)
        request.status = to

    # ---- arrival and admission ---------------------------------------------------------

    def add(self, request: Request) -> None:
        """A new request joins the waiting queue."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.status is not S.WAITING:
            raise InvalidTransition(f"{request.request_id}: a new request is {request.status.name}")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def admit(self, request: Request, num_hit_tokens: int, now: float) -> None:
        """The queue head starts running, its ``num_hit_tokens`` prefix-cache hits computed."""
        self._check(request, S.RUNNING)
        self._take_head(request, num_hit_tokens, now)
        self._move(request, S.RUNNING)
        self.running.append(request)
        self.num_admitted += 1

    def start_loading(self, request: Request, num_hit_tokens: int, now: float) -> None:
        """The queue head waits for its KV from another engine (blocks already given)."""
        self._check(request, S.WAITING_FOR_REMOTE_KV)
        self._take_head(request, num_hit_tokens, now)
        self._move(request, S.WAITING_FOR_REMOTE_KV)
        self.loading[request.request_id] = request

    def loaded(self, request_id: str) -> Request | None:
        """A load ended: the request goes back to the queue's front. None: not loading."""
        request = self.loading.pop(request_id, None)
        if request is not None:
            self._move(request, S.WAITING)
            self.waiting.add(request, front=True)
        return request

    def _take_head(self, request: Request, num_hit_tokens: int, now: float) -> None:
        if not len(self.waiting) or self.waiting.peek() is not request:
            raise InvalidTransition(f"{request.request_id}: not the waiting queue's head")
        self.waiting.pop()
        request.num_computed_tokens += num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        if request.times.first_scheduled is None:
            request.times.first_scheduled = now

    def pass_over(self) -> Request:
        """Take the queue head out for this round (``put_back`` returns it)."""
        return self.waiting.pop()

    def put_back(self, passed_over: list[Request]) -> None:
        """Requests passed over this round, back in their places ahead of the rest."""
        for request in reversed(passed_over):
            self.waiting.add(request, front=True)

    def preempt(self, request: Request, now: float) -> None:
        """A running request gives up its KV (the caller freed it) and is recomputed later."""
        self._move(request, S.PREEMPTED)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.times.preemptions.append(now)
        request.prompt_logprobs_chunks.clear()  # recomputed with the prompt
        self.num_preemptions += 1
        self.waiting.add(request, front=True)

    # ---- ends ----------------------------------------------------------------------------

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        now: float,
        *,
        stop_reason: int | None = None,
        error: RequestError | None = None,
    ) -> None:
        """End a request in any state but FINISHED: out of its queue, its KV released."""
        status = request.status
        self._check(request, S.FINISHED)
        self._release(request, reason)
        if status is S.RUNNING:
            self.running.remove(request)
        elif status is S.WAITING_FOR_REMOTE_KV:
            del self.loading[request.request_id]
        elif status is S.IDLE:
            del self.sessions[request.request_id]
        else:
            self.waiting.remove(request)
        if status is not S.IDLE:
            del self.requests[request.request_id]
        self._move(request, S.FINISHED)
        self._record_end(request, reason, stop_reason, error, now)

    def end_turn(self, request: Request, reason: FinishReason, stop_reason: int | None, now: float) -> None:
        """A running session's turn ends: blocks and computed tokens stay for the next."""
        self._check(request, S.IDLE)
        if not request.resumable:
            raise InvalidTransition(f"{request.request_id}: not a session, its turn cannot end")
        self._move(request, S.IDLE)
        self.running.remove(request)
        del self.requests[request.request_id]
        self.sessions[request.request_id] = request
        self._record_end(request, reason, stop_reason, None, now)

    def resume(self, request: Request) -> None:
        """An idle session's next turn (``Request.resume`` done) joins the waiting queue."""
        self._move(request, S.WAITING)
        del self.sessions[request.request_id]
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _record_end(
        self, request: Request, reason: FinishReason, stop_reason: int | None, error: RequestError | None, now: float
    ) -> None:
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.error = error
        request.times.finished = now
        self._ended.append(request)

    @property
    def has_ended(self) -> bool:
        return bool(self._ended)

    def take_ended(self) -> list[Request]:
        """Requests that finished or ended a turn since the last call, in that order."""
        ended, self._ended = self._ended, []
        return ended

    def is_current(self, request: Request) -> bool:
        """Whether ``request`` is unfinished here (not ended, not an idle session)."""
        return self.requests.get(request.request_id) is request

    def take_num_admitted(self) -> int:
        n, self.num_admitted = self.num_admitted, 0
        return n

    def take_num_preemptions(self) -> int:
        n, self.num_preemptions = self.num_preemptions, 0
        return n
