"""The step observer: each forward pass's duration and the scheduler's counts feed the
engine's two rate estimates, the prefill bound (deadline shedding, admission.py) and
the waiting queue's drain rate (RESOURCE_EXHAUSTED retry hints); on CPU the thread
governor sizes the intra-op team to the CPUs the engine actually gets.

Both step modes call ``observe`` with the forward's own duration (``RunnerOutput.
forward_seconds``: the wall clock on CPU, CUDA events on a GPU), once the step's
results are in: under async scheduling that is when the step is completed, not when
it was queued."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_service.scheduler import Scheduler, SchedulerOutput
    from engine_service.thread_governor import ThreadGovernor
    from tandem.drain_rate import DrainRate


class StepObserver:
    def __init__(self, scheduler: Scheduler, drain_rate: DrainRate, governor: ThreadGovernor | None = None) -> None:
        self.scheduler = scheduler
        self.drain_rate = drain_rate
        self.governor = governor
        # Totals over the engine's life: steps that ran a batch, its requests and tokens.
        self.steps = self.scheduled_reqs = self.scheduled_tokens = 0

    def observe(self, sched: SchedulerOutput, forward_seconds: float) -> None:
        """A step of ``sched`` whose forward took ``forward_seconds`` (a step that raised
        is not observed)."""
        scheduler = self.scheduler
        if sched.scheduled:
            self.steps += 1
            self.scheduled_reqs += len(sched.scheduled)
            self.scheduled_tokens += sched.num_scheduled_tokens
        scheduler.prefill_bound.observe(sched.num_scheduled_tokens, forward_seconds)
        self.drain_rate.observe(time.monotonic(), scheduler.take_num_admitted(), scheduler.num_waiting)
        if self.governor is not None:
            self.governor.observe()
