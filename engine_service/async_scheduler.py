"""Async scheduling's scheduler: step N+1 is scheduled while step N still runs.

``schedule`` counts each scheduled request's tokens as computed at once, and a request
that samples gets an output placeholder (``Request.num_output_placeholders``), not a
token: the next ``schedule`` sees it as a token left to compute, and the runner takes
that input token from the device (the step in flight sampled it). ``update_after_step``
turns placeholders into the sampled tokens and applies the stop checks, one step
later; outputs are token for token those of ``Scheduler``. Entries of requests that
ended since they were scheduled (finished, or a session turn that ended) are skipped:
what the step computed for them is dropped.

Speculative decoding: drafts follow a request's known tokens, so a request drafts only
without a placeholder; ``AsyncStep`` completes the step in flight before scheduling one
in which a request may draft (``Speculator.may_draft``), and a step with drafts runs to
the end (it is not pipelinable). Its verified entries are settled as ``Scheduler``'s.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from engine_service.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = ["AsyncScheduler"]


class AsyncScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        for entry in out.scheduled:
            request = entry.request
            request.num_computed_tokens += entry.num_new_tokens
            self.kv.cache_blocks(request)  # full blocks of known tokens only
            if entry.samples:
                request.num_output_placeholders += 1
        return out

    def current(self, entry: ScheduledRequest) -> bool:
        """Whether ``entry`` still applies: its request neither ended nor moved to
        another session turn since it was scheduled."""
        return self.lifecycle.is_current(entry.request) and entry.turn == entry.request.turn

    def without_ended(self, out: SchedulerOutput) -> SchedulerOutput:
        """``out`` less the entries that no longer apply (a step not launched yet)."""
        kept = [e for e in out.scheduled if self.current(e)]
        return SchedulerOutput(kept, sum(e.num_new_tokens for e in kept), out.preempted_ids)

    def update_after_step(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        pooled: Collection[str] = (),
        accepted: dict[str, list[int]] | None = None,
    ) -> None:
        now = time.monotonic()
        for entry in out.scheduled:
            request = entry.request
            if not self.current(entry):
                continue
            if entry.spec_token_ids:  # what schedule() counted is settled by the verification
                request.num_computed_tokens -= entry.num_new_tokens
                request.num_output_placeholders -= 1
                self._update_verified(entry, sampled, accepted or {}, now)
                continue
            if self._pooled_or_chunk(entry, pooled, now):
                continue
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.num_output_placeholders -= 1
            request.append_output_token(token)
            self._after_token(request, token, now)
            if not self.lifecycle.is_current(request):  # ended: later steps' placeholders go
                request.num_output_placeholders = 0
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
