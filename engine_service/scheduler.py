"""Continuous-batching scheduler: who runs this step, and with how many tokens.

The scheduler decides; the ``RequestLifecycle`` (request_lifecycle.py) carries out
every status and queue change; the ``KVCacheManager`` is the only KV it sees; features
(deadlines, sessions, KV transfer, LoRA slots, structured output) join through the
hooks of scheduler_hooks.py. ``AsyncScheduler`` (async_scheduler.py) is the variant
for async scheduling, chosen once at start-up.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_service.admission import Deadlines, PrefillBound
from engine_service.kv_cache.manager import NO_BLOCKS, KVBlocks, KVCacheManager
from engine_service.kv_transfer.scheduling import KvTransfer
from engine_service.request import Request, RequestStatus
from engine_service.request_lifecycle import RequestLifecycle
from engine_service.scheduler_hooks import SchedulerFeature, Stop, Verdict
from engine_service.sessions import SessionEviction
from engine_service.structured_output.scheduling import StructuredOutputs
from tandem.protocol.outputs import FinishReason, RequestError, SchedulerStats

if TYPE_CHECKING:
    from engine_service.kv_transfer import KvConnector
    from engine_service.lora import LoRAManager
    from engine_service.spec_decode.speculator import Speculator
    from engine_service.structured_output import StructuredOutputManager
    from tandem.protocol.sampling_params import SamplingParams

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # requests in one step
    max_num_batched_tokens: int  # tokens in one step (the token budget)
    max_model_len: int  # tokens of one request, prompt and output
    policy: str = "fcfs"  # "fcfs" or "priority" (waiting_queue.py)
    enable_chunked_prefill: bool = True  # False: a prompt runs whole or waits


@dataclass
class ScheduledRequest:
    """``request`` computes tokens ``[start, start + num_new_tokens)`` this step; with
    ``spec_token_ids`` (speculative decoding) the last ``len(spec_token_ids)`` of them are
    drafts after its known tokens, verified this step (spec_decode/rejection.py)."""

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    start: int = field(init=False)  # num_computed_tokens when scheduled
    samples: bool = field(init=False)  # the step reaches the end of the known tokens: it samples
    turn: int = field(init=False)  # the request's session turn when scheduled
    # With drafts: the tokens the step appended to the request (set by update_after_step).
    new_token_ids: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        r = self.request
        self.start = r.num_computed_tokens
        known = self.num_new_tokens - len(self.spec_token_ids)
        self.samples = self.start + known == r.num_tokens + r.num_output_placeholders
        self.turn = r.turn

    @property
    def num_outputs_before(self) -> int:
        """Output tokens the request has before the one this step samples (placeholders
        of steps in flight counted): the sampled token's output position (with drafts:
        that of the first verified row; draft row j samples position + j)."""
        return self.start + self.num_new_tokens - len(self.spec_token_ids) - self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
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
        structured: StructuredOutputManager | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """``lora``: with LoRA on, a waiting request is admitted once its adapter has a
        slot; ``kv_connector``: moves KV between engines (kv_transfer/base.py);
        ``structured``: compiles constraints (a constrained request waits for its own);
        ``speculator``: speculative decoding's drafts (spec_decode/speculator.py)."""
        self.config = SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, max_model_len, policy, enable_chunked_prefill
        )
        self.kv = kv_manager
        self.kv_transfer = KvTransfer(kv_manager, kv_connector)
        self.speculator = speculator
        self.lifecycle = RequestLifecycle(policy, self._release)
        self.kv_transfer.bind(self.lifecycle)
        if speculator is not None:
            speculator.bind(self.lifecycle, max_model_len)
        # Fed by the step observer with each step's tokens and time; bounds prefill times.
        self.prefill_bound = PrefillBound(max_num_batched_tokens)
        self.deadlines = Deadlines(self.lifecycle, self.prefill_bound)
        self.session_eviction = SessionEviction(self.lifecycle, kv_manager)
        # In hook order: a constraint still compiling or an adapter without a slot
        # passes the head over before anything else looks at it; a KV load takes it
        # before a deadline judges its prefill.
        self.features: list[SchedulerFeature] = [
            StructuredOutputs(self.lifecycle, structured),
            *_lora_slots(self.lifecycle, lora),
            self.kv_transfer,
            self.deadlines,
            self.session_eviction,
            *([] if speculator is None else [speculator]),
        ]
        # Per-step token counts for IterationStats (taken and reset by the core).
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        # time.monotonic() at the start of the current schedule(): the time stamp of the
        # scheduling events (first scheduled, preemption, prefill chunk start) of this step.
        self._step_start = time.monotonic()

    def _release(self, request: Request, reason: FinishReason) -> None:
        """A request ended: its KV (and its speculation state) go."""
        self.kv_transfer.release(request, reason)
        if self.speculator is not None:
            self.speculator.ended(request)

    # ---- requests ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.lifecycle.add(request)
        for feature in self.features:
            feature.added(request)

    def finish_requests(
        self, request_ids: Iterable[str], reason: FinishReason, error: RequestError | None = None
    ) -> list[Request]:
        """End requests in any state, idle sessions included (abort; ``error`` with
        FinishReason.ERROR), their blocks free on return; unknown ids are ignored. The
        next outputs report them (``take_ended``)."""
        lifecycle, done, now = self.lifecycle, [], time.monotonic()
        for rid in request_ids:
            request = lifecycle.requests.get(rid) or lifecycle.sessions.get(rid)
            if request is not None:
                lifecycle.finish(request, reason, now, error=error)
                done.append(request)
        return done

    def abort(self, request_ids: Iterable[str]) -> None:
        self.finish_requests(request_ids, FinishReason.ABORT)

    def resume(self, request_id: str, new_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue an idle session's next turn (its history plus ``new_token_ids``)."""
        request = self.lifecycle.sessions[request_id]
        request.resume(new_token_ids, params, time.monotonic())
        self.lifecycle.resume(request)
        return request

    def take_ended(self) -> list[Request]:
        """Requests that finished or ended a session turn since the last call, in order."""
        return self.lifecycle.take_ended()

    @property
    def has_ended(self) -> bool:
        return self.lifecycle.has_ended

    # ---- what others may read ------------------------------------------------------------

    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished requests by id (read only)."""
        return self.lifecycle.requests

    @property
    def num_unfinished(self) -> int:
        return len(self.lifecycle.requests)

    @property
    def num_running(self) -> int:
        return len(self.lifecycle.running)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue (preempted ones included)."""
        return len(self.lifecycle.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens of the requests in the waiting queue."""
        return self.lifecycle.waiting.num_tokens

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is unfinished here (an idle session is not)."""
        return request_id in self.lifecycle.requests

    def has_session(self, request_id: str) -> bool:
        """Whether ``request_id`` is a streaming-input session between turns."""
        return request_id in self.lifecycle.sessions

    def session_num_tokens(self, request_id: str) -> int:
        """Tokens an idle session holds (its history)."""
        return self.lifecycle.sessions[request_id].num_tokens

    def running_lora_ids(self) -> set[int]:
        """Adapter ids of the running requests (0: the base model)."""
        return {r.lora_int_id for r in self.lifecycle.running}

    def take_num_admitted(self) -> int:
        """Requests moved from waiting to running since the last call."""
        return self.lifecycle.take_num_admitted()

    def idle_tick(self) -> None:
        """While no step runs: the features' news (held KV transfers pulled or expired
        give their blocks back; loads that ended requeue their requests)."""
        self.kv_transfer.before_schedule(time.monotonic())

    def drop_kv_transfers(self) -> None:
        """Free every held transfer's blocks now (before the KV cache is released)."""
        self.kv_transfer.drop_held()

    # ---- scheduling ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        # The one invariant: every request has num_computed_tokens <= num_tokens (plus
        # async scheduling's placeholders), and a step gives some requests n more tokens
        # to compute, within the step's token budget (max_num_batched_tokens) and
        # sequence cap (max_num_seqs). A prefill chunk, a prefix-cache hit (computed
        # tokens granted for free) and a decode (n = 1) are the same move. Running
        # requests go first; waiting ones are admitted while budget, sequence slots and
        # KV blocks allow. When blocks run out, the lowest-priority running request is
        # preempted and recomputed later. Before that, the features' before_schedule.
        # Speculative decoding keeps it: a decode's drafts are n more tokens computed
        # after its known one, and update_after_step takes the rejected ones back.
        out = SchedulerOutput()
        now = self._step_start = time.monotonic()
        for feature in self.features:
            feature.before_schedule(now)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_ids:
            self._admit_waiting(out, budget)
        out.num_scheduled_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        running = self.lifecycle.running
        for request in list(running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            n = min(self._num_uncomputed(request), budget)
            if n <= 0:
                continue
            drafts = self._drafts(request, n, budget)
            while not self.kv.allocate_slots(request, n + len(drafts)):
                if drafts:
                    drafts = []  # short of blocks: a plain decode first
                    continue
                if self._make_room():
                    continue
                victim = self._pick_victim()
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, n + len(drafts), drafts))
                budget -= n + len(drafts)
        return budget

    def _drafts(self, request: Request, n: int, budget: int) -> list[int]:
        """The speculator's drafts for a decode of ``request`` (``n == 1``), else []."""
        if self.speculator is None or n != 1:
            return []
        return self.speculator.drafts(request, len(self.lifecycle.running), budget, self.config.max_model_len)

    def _num_uncomputed(self, request: Request) -> int:
        """Tokens left to compute, never past max_model_len (the last position is
        max_model_len - 1)."""
        end = min(request.num_tokens + request.num_output_placeholders, self.config.max_model_len)
        return end - request.num_computed_tokens

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        lifecycle, config, now = self.lifecycle, self.config, self._step_start
        passed_over: list[Request] = []
        while len(lifecycle.waiting) and budget > 0 and len(lifecycle.running) < config.max_num_seqs:
            request = lifecycle.waiting.peek()
            verdict = self._gate(request, now)
            if verdict is Verdict.DEFER:
                passed_over.append(lifecycle.pass_over())
                continue
            if verdict is Verdict.TAKEN:
                continue
            hit = self.kv.get_computed_blocks(request) if self._looks_up_prefix(request) else NO_BLOCKS
            n = self._num_uncomputed(request) - hit.num_tokens
            verdict = self._place(request, hit, n, now)
            if verdict is Verdict.TAKEN:
                continue
            if verdict is Verdict.NO_ROOM:
                if self._make_room():
                    continue  # the same head again, with the room made
                break
            if not config.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(request, n, hit):
                if self._make_room():
                    continue
                break
            lifecycle.admit(request, hit.num_tokens, now)
            out.scheduled.append(ScheduledRequest(request, n))
            budget -= n
        lifecycle.put_back(passed_over)

    def _gate(self, request: Request, now: float) -> Verdict:
        """The first feature's ``gate`` verdict other than ADMIT, else ADMIT."""
        for feature in self.features:
            verdict = feature.gate(request, now)
            if verdict is not Verdict.ADMIT:
                return verdict
        return Verdict.ADMIT

    def _place(self, request: Request, hit: KVBlocks, num_new_tokens: int, now: float) -> Verdict:
        """The first feature's ``place`` verdict other than ADMIT, else ADMIT."""
        for feature in self.features:
            verdict = feature.place(request, hit, num_new_tokens, now)
            if verdict is not Verdict.ADMIT:
                return verdict
        return Verdict.ADMIT

    @staticmethod
    def _looks_up_prefix(request: Request) -> bool:
        pooling = request.pooling_params
        return request.num_computed_tokens == 0 and not (pooling and pooling.skips_prefix_cache)

    def _make_room(self) -> bool:
        return any(feature.make_room() for feature in self.features)

    def _pick_victim(self) -> Request:
        running = self.lifecycle.running
        if self.config.policy == "priority":
            return max(running, key=lambda r: (r.priority, r.arrival_time))
        return running[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> int:
        """Preempt ``request``; returns the budget it gives back (its share of ``out``)."""
        self.kv.free(request)
        self.lifecycle.preempt(request, self._step_start)
        out.preempted_ids.append(request.request_id)
        for entry in out.scheduled:
            if entry.request is request:
                out.scheduled.remove(entry)
                return entry.num_new_tokens
        return 0

    # ---- after the forward pass ------------------------------------------------------------

    def update_after_step(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        pooled: Collection[str] = (),
        accepted: dict[str, list[int]] | None = None,
    ) -> None:
        """Advance computed tokens, append sampled tokens, apply stop checks.

        ``sampled`` maps request id -> the token sampled for it this step; ``pooled``
        holds the pooling requests whose vector this step completed (they finish with
        STOP); ``accepted``: request id -> its drafts accepted this step (appended before
        its sampled token; the rejected drafts' positions are not computed). Requests that
        end are released and reported by ``take_ended``.
        """
        now = time.monotonic()
        for entry in out.scheduled:
            request = entry.request
            if entry.spec_token_ids:
                self._update_verified(entry, sampled, accepted or {}, now)
                continue
            request.num_computed_tokens += entry.num_new_tokens
            self.kv.cache_blocks(request)
            if self._pooled_or_chunk(entry, pooled, now):
                continue
            token = sampled.get(request.request_id)
            if token is not None:
                request.append_output_token(token)
                self._after_token(request, token, now)

    def _update_verified(
        self, entry: ScheduledRequest, sampled: dict[str, int], accepted: dict[str, list[int]], now: float
    ) -> None:
        """A decode with drafts: its accepted drafts, then the sampled token, each through
        the stop checks (what follows a stop is dropped). Computed: the known token and the
        accepted drafts; the rejected drafts' KV slots are written again later."""
        request = entry.request
        rid = request.request_id
        token = sampled.get(rid)
        if token is None:  # not verified (the step failed for it): nothing computed
            return
        kept = accepted.get(rid, [])
        drafted = len(entry.spec_token_ids)
        request.num_computed_tokens += entry.num_new_tokens - (drafted - len(kept))
        self.kv.cache_blocks(request)  # full blocks of known tokens only (the drafts are not yet)
        if self.speculator is not None:
            self.speculator.record(request, drafted, len(kept))
        self._pooled_or_chunk(entry, (), now)  # (a decode is never a pooling request)
        for t in (*kept, token):
            request.append_output_token(t)
            entry.new_token_ids.append(t)
            self._after_token(request, t, now)
            if request.is_finished or request.status is RequestStatus.IDLE:
                break
        # A stop among the drafts: the tokens after it are not the request's.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)

    def _pooled_or_chunk(self, entry: ScheduledRequest, pooled: Collection[str], now: float) -> bool:
        """Record a first-prefill chunk's times; finish a pooling request whose vector
        this step completed (True: it is done)."""
        request = entry.request
        if request.times.first_token is None:  # the first prefill, chunk by chunk
            request.times.prefill_chunks.append((self._step_start, now, entry.num_new_tokens))
        if request.request_id not in pooled:
            return False
        request.times.first_token = now
        self._num_prompt_tokens += request.num_prompt_tokens
        self.lifecycle.finish(request, FinishReason.STOP, now)
        return True

    def _after_token(self, request: Request, token: int, now: float) -> None:
        """Count a token appended to ``request`` and end the request if it stops there."""
        self._num_generation_tokens += 1
        if request.times.first_token is None:
            request.times.first_token = now
            self._num_prompt_tokens += request.num_prompt_tokens
        stop = self._check_stop(request, token)
        for feature in self.features:
            said = feature.after_token(request, token)
            if said is not None and (said.error is not None or stop is None):
                stop = said  # a feature's error outranks a plain stop
        if stop is None:
            return
        if request.resumable and stop.reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.lifecycle.end_turn(request, stop.reason, stop.stop_reason, now)
        else:
            self.lifecycle.finish(request, stop.reason, now, stop_reason=stop.stop_reason, error=stop.error)

    def take_token_counts(self) -> tuple[int, int]:
        """(prompt tokens of requests that got their first token, tokens sampled) since
        the last call."""
        counts = (self._num_prompt_tokens, self._num_generation_tokens)
        self._num_prompt_tokens = self._num_generation_tokens = 0
        return counts

    def _check_stop(self, request: Request, token: int) -> Stop | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                return Stop(FinishReason.STOP)
            if token in params.stop_token_ids:
                return Stop(FinishReason.STOP, token)
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return Stop(FinishReason.LENGTH)
        if request.num_tokens >= self.config.max_model_len:
            return Stop(FinishReason.LENGTH)
        return None

    def stats(self) -> SchedulerStats:
        cache = self.kv.take_stats()
        lifecycle = self.lifecycle
        return SchedulerStats(
            num_running_reqs=len(lifecycle.running),
            num_waiting_reqs=len(lifecycle.waiting) + len(lifecycle.loading),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits,
            num_preemptions=lifecycle.take_num_preemptions(),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_blocks,
        )


def _lora_slots(lifecycle: RequestLifecycle, lora: LoRAManager | None) -> list[SchedulerFeature]:
    if lora is None:
        return []
    from engine_service.lora.scheduling import LoraSlots

    return [LoraSlots(lifecycle, lora)]
