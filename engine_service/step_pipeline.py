"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are read.

On a GPU the host work of a step (schedule, inputs, outputs, stop checks) otherwise
leaves the device idle between forwards. Here a step is launched (``ModelRunner.launch``)
and its sampled tokens stay on the device; the scheduler counts them as computed with a
placeholder each (``Scheduler.advance_in_flight``), so the next step can be scheduled and
launched at once, reading those tokens on the device. Only then are the earlier step's
tokens read back and its stop checks applied (``update_after_step(..., advanced=True)``):
outputs come one step later, token for token the same. A request that stopped was already
launched once more; that token is dropped.

A step with anything that needs the previous tokens on the host (``ModelRunner.
pipelinable``: penalties, structured output, logprobs, pooling, LoRA, tensor parallelism)
first waits for the step in flight and then runs as before.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from engine_service.model_runner import InFlight
from engine_service.request import RequestStatus
from engine_service.scheduler import SchedulerOutput
from tandem.protocol.outputs import EngineCoreOutputs

if TYPE_CHECKING:
    from engine_service.core import EngineCore


class StepPipeline:
    """At most one step in flight; ``step`` returns one step's outputs per call."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._in_flight: tuple[SchedulerOutput, InFlight] | None = None
        # Outputs of steps completed by an earlier call (one call may complete two).
        self._ready: deque[EngineCoreOutputs] = deque()

    @property
    def busy(self) -> bool:
        """A step is in flight or its outputs wait to be returned."""
        return self._in_flight is not None or bool(self._ready)

    def step(self) -> EngineCoreOutputs:
        if self._ready:
            return self._ready.popleft()
        core, scheduler = self.core, self.core.scheduler
        sched = scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        pipelinable = not sched.is_empty and core.runner.pipelinable(sched)
        overlap = previous is not None and pipelinable
        if previous is not None and not overlap:  # the new step needs its tokens first
            self._complete(*previous)
            # what stopped there was scheduled once more: not run
            sched.scheduled = [e for e in sched.scheduled if e.request.status == RequestStatus.RUNNING]
            sched.num_scheduled_tokens = sum(e.num_new_tokens for e in sched.scheduled)
        if sched.is_empty:
            if previous is None:
                self._ready.append(core.run_step(sched))  # idle: the core's waits
        elif pipelinable:
            with core.observer.execute(sched):
                launched = core.runner.launch(sched, previous[1] if overlap else None)
            if overlap:
                self._complete(*previous)  # while the new step runs on the device
            scheduler.advance_in_flight(sched)
            self._in_flight = (sched, launched)
        else:
            self._ready.append(core.run_step(sched))
        return self._ready.popleft() if self._ready else core.empty_outputs()

    def _complete(self, sched: SchedulerOutput, launched: InFlight) -> None:
        """Read a launched step's tokens, apply them, queue its outputs."""
        scheduler = self.core.scheduler
        result = launched.wait()
        alive = {
            e.request.request_id for e in sched.scheduled
            if scheduler.requests.get(e.request.request_id) is e.request
        }
        result.sampled = {rid: t for rid, t in result.sampled.items() if rid in alive}
        finished = scheduler.update_after_step(sched, result.sampled, advanced=True)
        self._ready.append(self.core.make_outputs(sched, result, finished))
