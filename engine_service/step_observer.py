"""The step observer: each forward pass's duration and the scheduler's counts feed the
engine's two rate estimates, the prefill bound (deadline shedding, admission.py) and
the waiting queue's drain rate (RESOURCE_EXHAUSTED retry hints); on CPU the thread
governor sizes the intra-op team to the CPUs the engine actually gets."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
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

    @contextmanager
    def execute(self, sched: SchedulerOutput) -> Iterator[None]:
        """Around the forward pass of ``sched``: observed when it returns (a pass that
        raised is not a rate sample)."""
        start = time.monotonic()
        yield
        now = time.monotonic()
        scheduler = self.scheduler
        if sched.scheduled:
            self.steps += 1
            self.scheduled_reqs += len(sched.scheduled)
            self.scheduled_tokens += sched.num_scheduled_tokens
        scheduler.prefill_bound.observe(sched.num_scheduled_tokens, now - start)
        self.drain_rate.observe(now, scheduler.take_num_admitted(), len(scheduler.waiting))
        if self.governor is not None:
            self.governor.observe()
