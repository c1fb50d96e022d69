"""The engine's step, in its two modes, chosen once at start-up:

- ``SyncStep``: schedule -> execute -> update -> emit, one step per call.
- ``AsyncStep`` (async scheduling, with ``AsyncScheduler``): step N+1 is scheduled and
  launched on the device before step N's tokens are read back, so the host work of a
  step (schedule, inputs, outputs, stop checks) overlaps the device's forward. A step
  with anything that reads the previous tokens on the host (``ModelRunner.
  pipelinable``: penalties, structured output, logprobs, pooling, LoRA, tensor
  parallelism, drafts to verify) first completes the step in flight and then runs to
  the end; so does a step in which a request may draft (speculative decoding).

``Execution`` is what both share: the runner, the step observer timing each forward,
the idle waits of a step with nothing to run, and tensor parallelism's failure rule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine_service.batch import InFlight, RunnerOutput
from engine_service.distributed.executor import TensorParallelExecutor, WorkerDiedError

if TYPE_CHECKING:
    from engine_service.async_scheduler import AsyncScheduler
    from engine_service.model_runner import ModelRunner
    from engine_service.scheduler import Scheduler, SchedulerOutput
    from engine_service.step_observer import StepObserver
    from engine_service.step_outputs import StepOutputs
    from tandem.protocol.outputs import EngineCoreOutputs


class Execution:
    def __init__(
        self,
        runner: ModelRunner,
        observer: StepObserver,
        idle_waits: Sequence[Callable[[], None]],
        executor: TensorParallelExecutor | None = None,
    ) -> None:
        """``idle_waits``: called for a step with nothing to run (each waits briefly for
        work on its way: a constraint compiling, a KV load); ``executor``: with tensor
        parallelism, a failed forward leaves the ranks out of step and ends the engine."""
        self.runner = runner
        self.observer = observer
        self.idle_waits = idle_waits
        self.executor = executor

    def run(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run ``sched`` to the end (its tokens on the host)."""
        if sched.is_empty:
            for wait in self.idle_waits:
                wait()
            result = RunnerOutput()
        elif self.executor is None:
            result = self.runner.execute(sched)
        else:
            try:
                result = self.runner.execute(sched)
            except WorkerDiedError:
                raise
            except Exception as exc:  # the ranks are out of step now: the engine is done
                raise self.executor.fail(exc) from exc
        self.observer.observe(sched, result.forward_seconds)
        return result

    def launch(self, sched: SchedulerOutput, previous: InFlight | None) -> InFlight:
        """Queue ``sched`` on the device (``ModelRunner.launch``); ``complete`` reads it."""
        return self.runner.launch(sched, previous)

    def complete(self, sched: SchedulerOutput, launched: InFlight) -> RunnerOutput:
        result = launched.wait()
        self.observer.observe(sched, result.forward_seconds)
        return result


class SyncStep:
    def __init__(self, scheduler: Scheduler, execution: Execution, outputs: StepOutputs) -> None:
        self.scheduler = scheduler
        self.execution = execution
        self.outputs = outputs

    @property
    def busy(self) -> bool:
        """Work launched whose outputs are not out yet (never, here)."""
        return False

    def step(self) -> EngineCoreOutputs:
        sched = self.scheduler.schedule()
        result = self.execution.run(sched)
        self.scheduler.update_after_step(sched, result.sampled, result.pooled, result.accepted)
        return self.outputs.make(sched, result)


class AsyncStep:
    """At most one step in flight; ``step`` returns one step's outputs per call (an empty
    one after a call that only launched work)."""

    def __init__(self, scheduler: AsyncScheduler, execution: Execution, outputs: StepOutputs) -> None:
        self.scheduler = scheduler
        self.execution = execution
        self.outputs = outputs
        self._in_flight: tuple[SchedulerOutput, InFlight] | None = None
        # Outputs of steps completed by an earlier call (one call may complete two).
        self._ready: deque[EngineCoreOutputs] = deque()

    @property
    def busy(self) -> bool:
        """A step is in flight or its outputs wait to be returned."""
        return self._in_flight is not None or bool(self._ready)

    def step(self) -> EngineCoreOutputs:
        if not self._ready:
            speculator = self.scheduler.speculator
            if speculator is not None and speculator.may_draft(self.scheduler.lifecycle.running):
                self._complete_in_flight()  # drafts follow the tokens still in flight
            sched = self.scheduler.schedule()  # counted as computed, placeholders for its tokens
            pipelinable = self.execution.runner.pipelinable(sched)
            if not pipelinable:
                self._complete_in_flight()  # this step reads their tokens on the host
                sched = self.scheduler.without_ended(sched)
            self._complete_in_flight(then=self._launch(sched, pipelinable))  # the previous, while this runs
        return self._ready.popleft() if self._ready else self.outputs.empty()

    def _launch(self, sched: SchedulerOutput, pipelinable: bool) -> tuple[SchedulerOutput, InFlight] | None:
        """``sched`` on the device, taking the in-flight step's tokens there; a step that
        cannot be pipelined runs to the end now (None)."""
        if pipelinable:
            previous = self._in_flight[1] if self._in_flight is not None else None
            return sched, self.execution.launch(sched, previous)
        if not (sched.is_empty and self._ready):  # an empty step after a completed one: nothing to say
            self._emit(sched, self.execution.run(sched))
        return None

    def _complete_in_flight(self, then: tuple[SchedulerOutput, InFlight] | None = None) -> None:
        """Read the step in flight's tokens, apply and emit them; ``then`` is in flight next."""
        if self._in_flight is not None:
            sched, launched = self._in_flight
            self._emit(sched, self.execution.complete(sched, launched))
        self._in_flight = then

    def _emit(self, sched: SchedulerOutput, result: RunnerOutput) -> None:
        # Entries whose request ended since they were scheduled: their tokens are dropped.
        live = {e.request.request_id for e in sched.scheduled if self.scheduler.current(e)}
        result.sampled = {rid: t for rid, t in result.sampled.items() if rid in live}
        result.accepted = {rid: a for rid, a in result.accepted.items() if rid in live}
        self.scheduler.update_after_step(sched, result.sampled, result.pooled, result.accepted)
        self._ready.append(self.outputs.make(sched, result))
