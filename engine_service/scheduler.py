"""Continuous-batching scheduler: who runs this step, and with how many tokens."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_service.admission import DeadlineScheduling, PrefillBound
from engine_service.kv_cache.manager import KVCacheManager
from engine_service.kv_transfer import KvConnector, NoConnector
from engine_service.kv_transfer.scheduling import KvTransferScheduling
from engine_service.request import PENDING_TOKEN, Request, RequestStatus
from engine_service.sessions import SessionScheduling
from engine_service.structured_output import Advance
from engine_service.waiting_queue import WaitingQueue
from tandem.protocol.outputs import ErrorCode, FinishReason, RequestError, SchedulerStats

if TYPE_CHECKING:
    from engine_service.kv_cache.block_pool import KVCacheBlock
    from engine_service.lora import LoRAManager

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput", "WaitingQueue"]


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens [num_computed_tokens, num_computed_tokens + n) run now

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's known tokens (and samples)."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler(KvTransferScheduling, SessionScheduling, DeadlineScheduling):
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        enable_chunked_prefill: bool = True,
        lora: LoRAManager | None = None,
        kv_connector: KvConnector | None = None,
    ) -> None:
        self.kv = kv_manager
        # KV transfer between engines (kv_transfer/base.py names the hooks called here).
        self.connector = kv_connector or NoConnector()
        # Requests whose KV is being loaded (WAITING_FOR_REMOTE_KV), and the blocks of
        # those that ended meanwhile: freed only once their load is over.
        self._loading: dict[str, Request] = {}
        self._orphans: dict[str, list[KVCacheBlock]] = {}
        # With LoRA on: a waiting request is admitted only once its adapter has a slot.
        self.lora = lora
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        # Streaming-input sessions between turns: their blocks are kept (evicted, and
        # recomputed on the next turn, only when running requests need the room).
        self.sessions: dict[str, Request] = {}
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self._num_preemptions = 0
        self._num_admitted = 0  # waiting -> running moves since take_num_admitted()
        # (deadline, seq, request) of every request with a deadline; finished ones are
        # dropped lazily when they reach the top.
        self._deadlines: list[tuple[float, int, Request]] = []
        self._deadline_seq = itertools.count()
        # Fed by the core with each step's tokens and time; bounds prefill times below.
        self.prefill_bound = PrefillBound(max_num_batched_tokens)
        self._shed: list[Request] = []  # dropped before prefill this step (deadline)
        # Requests ended outside a forward pass (aborts, expired deadlines, sheds, hook
        # failures) since take_ended(): the next outputs report them.
        self._ended: list[Request] = []
        # Called at the top of schedule(); each returns the requests it ended (e.g. the
        # structured-output room's failed constraints).
        self.pre_schedule_hooks: list[Callable[[Scheduler], list[Request]]] = []
        # Per-step token counts for IterationStats (taken and reset by the core).
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        # time.monotonic() at the start of the current schedule(): the time stamp of the
        # scheduling events (first scheduled, preemption, prefill chunk start) of this step.
        self._step_start = time.monotonic()

    # ---- request lifecycle -------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.deadline is not None:
            heapq.heappush(
                self._deadlines, (request.deadline, next(self._deadline_seq), request)
            )

    def finish_requests(
        self, request_ids: list[str], reason: FinishReason, error: RequestError | None = None
    ) -> list[Request]:
        """End requests in any state (abort; ``error`` with FinishReason.ERROR) and free
        their blocks; unknown ids are ignored."""
        done = []
        now = time.monotonic()
        for rid in request_ids:
            session = self.sessions.pop(rid, None)
            if session is not None:  # between turns: the session ends
                self.kv.free(session)
                session.status = RequestStatus.FINISHED
                session.finish_reason = reason
                session.times.finished = now
                done.append(session)
                continue
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            self._unqueue(request)
            self._finish(request, reason, now=now, error=error)
            done.append(request)
        return done

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        stop_reason: int | None = None,
        *,
        now: float,
        error: RequestError | None = None,
    ) -> None:
        rid = request.request_id
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self._loading[rid]  # its blocks may still be written: freed when the load ends
            self.connector.cancel_load(rid)
            self._orphans[rid] = self.kv.take_blocks(request)
        else:
            hold, params = self.connector.request_finished(request, reason, self.kv.req_blocks.get(rid, []))
            if hold:  # the connector keeps the blocks for another engine
                self.kv.take_blocks(request)
                request.kv_transfer_out = params
            else:
                self.kv.free(request)
        request.times.finished = now
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.error = error
        del self.requests[rid]

    def _unqueue(self, request: Request) -> None:
        """Take a request out of the running list or the waiting queue (a loading one is
        in neither: ``_finish`` handles it)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            self.waiting.remove(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> None:
        """``finish_requests``, with the ended requests reported by the next outputs."""
        self._ended += self.finish_requests(request_ids, reason)

    @property
    def has_ended(self) -> bool:
        """Whether take_ended() has requests to report."""
        return bool(self._ended or self._shed)

    def take_ended(self) -> list[Request]:
        """Requests ended outside a forward pass since the last call, in the order they
        ended: aborts, expired deadlines, pre-schedule hooks' failures, sheds."""
        ended = self._ended + self.take_shed()
        self._ended = []
        return ended

    def take_num_admitted(self) -> int:
        """Requests moved from waiting to running since the last call."""
        n, self._num_admitted = self._num_admitted, 0
        return n

    # ---- scheduling ----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        # The one invariant: every request has num_computed_tokens <= num_tokens, and
        # a step gives some requests n more tokens to compute, within the step's token
        # budget (max_num_batched_tokens) and sequence cap (max_num_seqs). A prefill
        # chunk, a prefix-cache hit (computed tokens granted for free) and a decode
        # (n = 1) are the same move. Running requests go first; waiting ones are admitted
        # while budget, sequence slots and KV blocks allow. When blocks run out, the
        # lowest-priority running request is preempted and recomputed later.
        # Before that: expired deadlines end, then the pre-schedule hooks run.
        out = SchedulerOutput()
        self._step_start = time.monotonic()
        self._ended += self.expire(self._step_start)
        for hook in self.pre_schedule_hooks:
            self._ended += hook(self)
        self.update_kv_transfers()
        budget = self.max_num_batched_tokens
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            n = self._num_tokens_to_schedule(request, budget)
            if n <= 0:
                continue
            while not self.kv.allocate_slots(request, n):
                if self._evict_idle_session():
                    continue
                victim = self._pick_victim()
                self._preempt(victim, out)
                for entry in out.scheduled:
                    if entry.request is victim:  # give back the victim's share of this step
                        out.scheduled.remove(entry)
                        budget += entry.num_new_tokens
                        break
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, n))
                budget -= n

        if not out.preempted_ids:
            self._admit_waiting(out, budget)
        out.num_scheduled_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _num_tokens_to_schedule(self, request: Request, budget: int) -> int:
        n = request.num_tokens - request.num_computed_tokens
        # Never compute past max_model_len (the last position is max_model_len - 1).
        n = min(n, self.max_model_len - request.num_computed_tokens)
        return min(n, budget)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Passed over this step: constraint still compiling, or no LoRA slot for its adapter.
        parked: list[Request] = []
        lora_ids = {r.lora_int_id for r in self.running} if self.lora is not None else set()
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.structured is not None and not request.structured.ready:
                parked.append(self.waiting.pop())
                continue
            if request.lora_int_id and not self._lora_slot(request, lora_ids):
                if not request.is_finished:
                    parked.append(self.waiting.pop())
                continue
            hits, num_hit_tokens = [], 0
            pooling = request.pooling_params
            if request.num_computed_tokens == 0 and not (pooling and pooling.skips_prefix_cache):
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if request.num_computed_tokens == 0 and pooling is None:
                num_external = self.connector.get_num_external_tokens(request, num_hit_tokens)
                if num_external:
                    if self._start_load(request, hits, num_hit_tokens, num_external):
                        continue
                    if self._evict_idle_session():
                        continue
                    break
            n = request.num_tokens - request.num_computed_tokens - num_hit_tokens
            if self._shed_if_late(request, n):
                continue
            if not self.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(request, n, hits):
                if self._evict_idle_session():
                    continue  # look at the same request again with the room made
                break
            self._take_from_queue(request, num_hit_tokens, RequestStatus.RUNNING)
            self._num_admitted += 1
            self.running.append(request)
            lora_ids.add(request.lora_int_id)
            out.scheduled.append(ScheduledRequest(request, n))
            budget -= n
        for request in reversed(parked):  # back in their places, ahead of the rest
            self.waiting.add(request, front=True)

    def _take_from_queue(self, request: Request, num_hit_tokens: int, status: RequestStatus) -> None:
        """Pop ``request`` (the queue head), grant its ``num_hit_tokens`` prefix-cache hits
        as computed tokens, and give it ``status`` (RUNNING, or WAITING_FOR_REMOTE_KV)."""
        self.waiting.pop()
        request.num_computed_tokens += num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.status = status
        if request.times.first_scheduled is None:
            request.times.first_scheduled = self._step_start

    def _lora_slot(self, request: Request, running_ids: set[int]) -> bool:
        """Whether the adapter of ``request`` (queue head) has, or now got, a device slot.

        An adapter that can no longer be read ends the request (INVALID_ARGUMENT)."""
        assert self.lora is not None and request.lora_request is not None
        try:
            return self.lora.activate(request.lora_int_id, running_ids, request.lora_request)
        except ValueError as exc:  # InvalidRequestError: the adapter went bad since arrival
            self.waiting.pop()
            error = RequestError(ErrorCode.INVALID_ARGUMENT, str(exc))
            self._finish(request, FinishReason.ERROR, now=self._step_start, error=error)
            self._shed.append(request)
            return False

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.times.preemptions.append(self._step_start)
        request.prompt_logprobs_chunks.clear()  # recomputed with the prompt
        self._num_preemptions += 1
        out.preempted_ids.append(request.request_id)
        self.waiting.add(request, front=True)

    # ---- after the forward pass -----------------------------------------------

    def advance_in_flight(self, out: SchedulerOutput) -> None:
        """Async scheduling: count a launched step's tokens as computed before its sampled
        tokens are known, so the next step can be scheduled while it runs. Each request
        that samples gets a placeholder token (PENDING_TOKEN, ``num_pending_tokens``),
        which the next step reads from the device and ``update_after_step(...,
        advanced=True)`` replaces. Requests that ended since ``out`` was scheduled are
        left alone (what the step computed for them is dropped)."""
        for entry in out.scheduled:
            request = entry.request
            if request.status != RequestStatus.RUNNING:
                continue
            samples = entry.samples
            request.num_computed_tokens += entry.num_new_tokens
            self.kv.cache_blocks(request)  # full blocks of known tokens only
            if samples:
                request.append_output_token(PENDING_TOKEN)
                request.num_pending_tokens += 1

    def update_after_step(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        pooled: Collection[str] = (),
        advanced: bool = False,
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, apply stop checks.

        ``sampled`` maps request id -> the token sampled for it this step; ``pooled``
        holds the pooling requests whose vector this step completed (they finish with
        STOP). Returns the requests that finished this step (already removed and freed).
        ``advanced``: ``advance_in_flight(out)`` already counted the computed tokens and
        appended placeholders, which the sampled tokens now replace; requests that
        ended meanwhile are skipped.
        """
        finished = []
        now = time.monotonic()
        for entry in out.scheduled:
            request = entry.request
            times = request.times
            if advanced and self.requests.get(request.request_id) is not request:
                continue  # ended since (finished, aborted, expired, parked)
            if times.first_token is None:  # the first prefill, chunk by chunk
                times.prefill_chunks.append((self._step_start, now, entry.num_new_tokens))
            if not advanced:
                request.num_computed_tokens += entry.num_new_tokens
                self.kv.cache_blocks(request)
            if request.request_id in pooled:
                times.first_token = now
                self._num_prompt_tokens += request.num_prompt_tokens
                self.running.remove(request)
                self._finish(request, FinishReason.STOP, now=now)
                finished.append(request)
                continue
            token = sampled.get(request.request_id)
            if token is None:
                continue
            if advanced:  # the step's placeholder is the request's last token
                request.output_token_ids[-1] = request.all_token_ids[-1] = token
                request.num_pending_tokens -= 1
            else:
                request.append_output_token(token)
            self._num_generation_tokens += 1
            if times.first_token is None:
                times.first_token = now
                self._num_prompt_tokens += request.num_prompt_tokens
            reason, stop_reason = self._check_stop(request, token)
            error = None
            if request.structured is not None:
                advance = request.structured.advance(token)
                if advance is Advance.REJECTED:
                    reason, stop_reason = FinishReason.ERROR, None
                    error = RequestError(
                        ErrorCode.INTERNAL,
                        f"token {token} was sampled outside the structured-output constraint",
                    )
                elif advance is Advance.COMPLETE and reason is None:
                    reason = FinishReason.STOP  # the constraint is complete
            if reason is not None:
                self._unqueue(request)  # running; or waiting, preempted since it was launched
                if request.resumable and reason in (FinishReason.STOP, FinishReason.LENGTH):
                    self._park(request, reason, stop_reason, now)
                else:
                    self._finish(request, reason, stop_reason, now=now, error=error)
                finished.append(request)
        return finished

    def take_token_counts(self) -> tuple[int, int]:
        """(prompt tokens of requests that got their first token, tokens sampled) since
        the last call."""
        counts = (self._num_prompt_tokens, self._num_generation_tokens)
        self._num_prompt_tokens = self._num_generation_tokens = 0
        return counts

    def _check_stop(self, request: Request, token: int) -> tuple[FinishReason | None, int | None]:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                return FinishReason.STOP, None
            if token in params.stop_token_ids:
                return FinishReason.STOP, token
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH, None
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def stats(self) -> SchedulerStats:
        cache = self.kv.take_stats()
        preemptions, self._num_preemptions = self._num_preemptions, 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self._loading),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits,
            num_preemptions=preemptions,
            num_free_blocks=self.kv.pool.num_free_blocks,
            num_total_blocks=self.kv.pool.num_blocks,
        )
