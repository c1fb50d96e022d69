"""A busy-loop thread around EngineCore, fed and drained through queues.

I/O threads (gRPC servicers) never touch the core: they put inputs on ``inputs`` and
read ``EngineCoreOutputs`` from ``outputs``. The loop thread alone drives the core:
drain inputs -> step -> put outputs, blocking on the input queue while idle.

The loop thread also builds the core (model load, KV-cache allocation, warm-up), so
every torch op of the process runs on one thread. That matters on CPU: each thread
that enters an OpenMP region gets its own libgomp thread team, which outlives it; once
a process has more OpenMP threads than cores, libgomp stops spinning between parallel
regions and puts its threads to sleep almost at once, and every region then pays
futex wake-ups: a model loaded on another thread slows serving (benchmarks/NOTES.md).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import enum
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_service.admission import RequestRejected
from engine_service.core import EngineCore
from engine_service.cpu import release_free_memory
from tandem.protocol.outputs import (
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    RequestError,
    UtilityOutput,
)
from tandem.protocol.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

# Seconds without work after which the loop gives the heap's free pages back to the OS.
IDLE_RELEASE_S = 1.0
# While idle, how often the loop asks the core whether it can still run (a
# tensor-parallel worker may die between steps).
HEALTH_POLL_S = 1.0


class InputType(enum.Enum):
    ADD = enum.auto()
    ABORT = enum.auto()
    UTILITY = enum.auto()
    SHUTDOWN = enum.auto()
    WAKE = enum.auto()  # no payload: run the idle housekeeping (core.idle_tick) now


@dataclass
class UtilityCall:
    call_id: int
    method: str
    args: tuple[Any, ...] = ()
    client_index: int = 0


@dataclass
class EngineDead:
    """Put on the output queue once, when the core failed and the loop stopped."""

    message: str


# Utility methods a client may call by name (vLLM's names), each taking the core and
# positional args.
UTILITY_METHODS: dict[str, Callable[..., Any]] = {
    "reset_prefix_cache": lambda core: core.reset_prefix_cache(),
    "num_unfinished_requests": lambda core: core.scheduler.num_unfinished,
    "is_idle": lambda core: not core.has_unfinished_requests(),
    "sleep": lambda core, level=1: core.sleep(level),
    "wake_up": lambda core: core.wake_up(),
    "is_sleeping": lambda core: core.is_sleeping(),
    "kv_cache_bytes": lambda core: core.kv_cache_bytes,
    "start_profile": lambda core: core.profiler.start(),
    "stop_profile": lambda core: core.profiler.stop(),
    "get_supported_tasks": lambda core: list(core.supported_tasks),
    "check_health": lambda core: core.check_health(),  # answered: the step thread is alive
    # LoRA adapters, as vLLM names them (InvalidRequestError -> a failure message).
    "add_lora": lambda core, lora_request: core.add_lora(lora_request),
    "remove_lora": lambda core, lora_id: core.remove_lora(int(lora_id)),
    "list_loras": lambda core: core.list_loras(),
    "lora_requests": lambda core: core.lora_requests(),  # Tandem's: the full LoRARequests
    "pin_lora": lambda core, lora_id: core.pin_lora(int(lora_id)),
}
# What collective_rpc may run on every worker of an engine: read-only or maintenance
# methods, never one that takes arbitrary code.
COLLECTIVE_RPC_METHODS = frozenset(
    {"reset_prefix_cache", "num_unfinished_requests", "is_idle", "is_sleeping", "kv_cache_bytes",
     "get_supported_tasks", "check_health"}
)


def _collective_rpc(core: EngineCore, method: str, *args: Any) -> list[Any]:
    """vLLM's collective_rpc: ``method`` on every worker of this engine, one result each
    (one worker today; tensor parallelism adds ranks)."""
    if method not in COLLECTIVE_RPC_METHODS:
        raise ValueError(
            f"collective_rpc method {method!r} is not allowed; allowed: {sorted(COLLECTIVE_RPC_METHODS)}"
        )
    return [UTILITY_METHODS[method](core, *args)]


UTILITY_METHODS["collective_rpc"] = _collective_rpc


def _idle_tick(core: EngineCore) -> None:
    """The core's housekeeping while idle (held KV transfers), where it has one."""
    tick = getattr(core, "idle_tick", None)
    if tick is not None:
        tick()


class EngineCoreLoop:
    """``make_core`` runs first on the loop thread; ``started`` resolves to its core."""

    def __init__(self, make_core: Callable[[], EngineCore]) -> None:
        self._make_core = make_core
        self.started: concurrent.futures.Future[EngineCore] = concurrent.futures.Future()
        self.inputs: queue.Queue[tuple[InputType, Any]] = queue.Queue()
        self.outputs: queue.Queue[EngineCoreOutputs | EngineDead] = queue.Queue()
        # The thread runs in a copy of the creator's context, so start-up spans nest.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="engine-core", daemon=True
        )
        self.dead: EngineDead | None = None
        # Where outputs go (``set_output_sink``); None: the ``outputs`` queue.
        self._sink: Callable[[EngineCoreOutputs | EngineDead], None] | None = None
        # Liveness for the watchdog (engine_service/watchdog.py): time.monotonic() of
        # the loop's last iteration, and whether it had unfinished requests then. An
        # idle loop blocks on ``inputs`` without beating; only a busy one must beat.
        self.heartbeat = time.monotonic()
        self.busy = False
        self._released = False  # the heap's free pages were given back since the last step

    def start(self) -> None:
        self._thread.start()

    def set_output_sink(self, sink: Callable[[EngineCoreOutputs | EngineDead], None]) -> None:
        """From now on the loop thread hands each output to ``sink`` (which must not block:
        e.g. a ``call_soon_threadsafe``) instead of the ``outputs`` queue, so no reader
        thread wakes in between. Whatever the queue already held goes to ``sink`` first.
        Set it before the first request."""
        self._sink = sink
        while True:
            try:
                sink(self.outputs.get_nowait())
            except queue.Empty:
                return

    def _emit(self, item: EngineCoreOutputs | EngineDead) -> None:
        sink = self._sink
        if sink is None:
            self.outputs.put(item)
        else:
            sink(item)

    # ---- called from I/O threads ---------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self.inputs.put((InputType.ADD, request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.inputs.put((InputType.ABORT, list(request_ids)))

    def call_utility(self, call: UtilityCall) -> None:
        self.inputs.put((InputType.UTILITY, call))

    def wake(self) -> None:
        """From any thread: an idle loop runs its housekeeping soon (a KV transfer was
        pulled or loaded)."""
        self.inputs.put((InputType.WAKE, None))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self.inputs.put((InputType.SHUTDOWN, None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    # ---- the loop thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            core = self._make_core()
        except BaseException as exc:  # start-up failed: the starter gets the error
            self.started.set_exception(exc)
            return
        connector = getattr(core, "kv_connector", None)  # test doubles of the core have none
        if connector is not None:
            connector.set_wake(self.wake)
        self.started.set_result(core)
        try:
            self._loop(core)
        except Exception as exc:  # the core is broken: report and stop
            logger.error("engine core failed:\n%s", traceback.format_exc())
            self.dead = EngineDead(f"engine core failed: {type(exc).__name__}: {exc}")
            self._emit(self.dead)
        finally:
            core.shutdown()

    def _loop(self, core: EngineCore) -> None:
        """Drain inputs and step until SHUTDOWN; raises when the core fails."""
        while True:
            block = not core.has_unfinished_requests()
            if not self._drain_inputs(core, block):
                return
            self._beat(core)
            if core.has_unfinished_requests():
                self._released = False
                self._emit(core.step())
                self._beat(core)  # before it may block: an idle loop is not busy
            else:
                _idle_tick(core)
                idle = core.take_ended_outputs()
                if idle is not None:
                    self._emit(idle)

    def _beat(self, core: EngineCore) -> None:
        self.busy = core.has_unfinished_requests()
        self.heartbeat = time.monotonic()

    def _drain_inputs(self, core: EngineCore, block: bool) -> bool:
        """Apply every queued input; wait for one first if ``block``. False on shutdown.

        Idle for ``IDLE_RELEASE_S`` after work: the heap's free pages go back to the OS."""
        try:
            if block and not self._released:
                try:
                    item = self.inputs.get(timeout=IDLE_RELEASE_S)
                except queue.Empty:
                    self._released = True
                    release_free_memory()
                    item = self._wait_input(core)
            else:
                item = self._wait_input(core) if block else self.inputs.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, payload = item
            if kind is InputType.SHUTDOWN:
                return False
            self._apply(core, kind, payload)
            try:
                item = self.inputs.get_nowait()
            except queue.Empty:
                return True

    def _wait_input(self, core: EngineCore) -> tuple[InputType, Any]:
        """Block for the next input, checking the core's health every HEALTH_POLL_S."""
        while True:
            try:
                return self.inputs.get(timeout=HEALTH_POLL_S)
            except queue.Empty:
                core.check_health()
                _idle_tick(core)

    def _apply(self, core: EngineCore, kind: InputType, payload: Any) -> None:
        if kind is InputType.ADD:
            try:
                core.admit_request(payload)
            except InvalidRequestError as exc:
                # Services validate before enqueueing; this is the last line of defence.
                logger.warning("rejected request %s: %s", payload.request_id, exc)
                self._reject(core, payload, RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)))
            except RequestRejected as exc:
                self._reject(core, payload, exc.error)
        elif kind is InputType.ABORT:
            core.abort_requests(payload)
        elif kind is InputType.UTILITY:
            self._emit(
                EngineCoreOutputs(engine_index=core.engine_index, utility_output=self._call(core, payload))
            )

    def _reject(self, core: EngineCore, request: EngineCoreRequest, error: RequestError) -> None:
        self._emit(EngineCoreOutputs.refusal(core.engine_index, request.request_id, error))

    @staticmethod
    def _call(core: EngineCore, call: UtilityCall) -> UtilityOutput:
        method = UTILITY_METHODS.get(call.method)
        if method is None:
            return UtilityOutput(call.call_id, failure_message=f"unknown utility method {call.method!r}")
        try:
            return UtilityOutput(call.call_id, result=method(core, *call.args))
        except Exception as exc:
            return UtilityOutput(call.call_id, failure_message=f"{type(exc).__name__}: {exc}")
