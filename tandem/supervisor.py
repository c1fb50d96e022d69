"""Engine processes under ``tandem serve``: started, watched, restarted, stopped.

Each engine runs in its own process group (a Ctrl-C in the terminal reaches only
``serve``, which shuts the stack down in order) and dies with ``serve`` even when that is
SIGKILLed (``tandem.parent_death``). An engine that exits during start-up ends ``serve``
with its last error line; one that is alive and loading its model is waited for; one
that exits while serving is restarted on the same port after an exponential back-off.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.errors import EngineStartError
from tandem.health import LIVENESS
from tandem.parent_death import guarded

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # how often exits and health are checked
_ERROR_PREFIX = "tandem: error: "


@dataclass(frozen=True)
class RestartPolicy:
    """Back-off between restarts of one engine: ``initial_s``, doubled after each restart
    up to ``max_s``; back to ``initial_s`` once an engine has run ``reset_after_s``."""

    initial_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"restart back-off must satisfy 0 < initial <= max, got {self.initial_s}, {self.max_s}")


class EngineProcess:
    """One engine subprocess; its stderr is forwarded line by line and its tail kept."""

    def __init__(
        self, index: int, address: str, argv: Sequence[str], env: Mapping[str, str], kind: str = "engine"
    ) -> None:
        self.kind = kind  # "engine", or "frontend" for serve's extra frontend processes
        self.index = index
        self.address = address  # HOST:PORT it serves on
        self.argv = list(argv)
        self.env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0  # time.monotonic() of the last start
        self._tail: collections.deque[str] = collections.deque(maxlen=20)

    def start(self) -> None:
        self._tail.clear()
        self.proc = subprocess.Popen(
            guarded(self.argv), env=self.env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
            process_group=0,
        )
        self.started_at = time.monotonic()
        threading.Thread(target=self._forward, args=(self.proc,), daemon=True,
                         name=f"engine-{self.index}-stderr").start()
        logger.info("%s %d started (pid %d) on %s", self.kind, self.index, self.proc.pid, self.address)

    def _forward(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None  # set by start()
        for raw in proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                self._tail.append(line)
            sys.stderr.write(f"[{self.kind} {self.index}] {line}\n")
            sys.stderr.flush()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def returncode(self) -> int | None:
        """None while running (or never started)."""
        return self.proc.poll() if self.proc is not None else None

    def exit_reason(self, code: int) -> str:
        """How the engine ended: the signal that killed it, or its code and last stderr
        line (its error, without the CLI's prefix)."""
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
            return f"killed by signal {-code}"
        line = self._tail[-1].removeprefix(_ERROR_PREFIX) if self._tail else "(no output)"
        return f"exited with code {code}: {line}"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the engine and anything it started (its process group)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


class Health(enum.Enum):
    """What a process's grpc.health.v1 says during start-up."""

    SERVING = "serving"  # ready
    ALIVE = "alive"  # answers, liveness SERVING, not ready yet: loading its model, say
    SILENT = "silent"  # no answer (not listening yet), or not alive


async def health_of(address: str, timeout: float = 2.0) -> Health:
    """Readiness ("") first, then liveness, of the process at ``address``."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            ready = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            if ready.status == health_pb2.HealthCheckResponse.SERVING:
                return Health.SERVING
            live = await stub.Check(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=timeout)
        except grpc.aio.AioRpcError:
            return Health.SILENT
    return Health.ALIVE if live.status == health_pb2.HealthCheckResponse.SERVING else Health.SILENT


class EngineSupervisor:
    """Starts the engines, waits for them, restarts the ones that die, stops them all."""

    def __init__(self, engines: Sequence[EngineProcess], policy: RestartPolicy) -> None:
        self.engines = list(engines)
        self.policy = policy
        self._stopping = False

    def start(self) -> None:
        for engine in self.engines:
            engine.start()

    async def wait_serving(self, timeout: float, load_timeout: float = 0.0) -> None:
        """Return once every engine is SERVING; raise EngineStartError as soon as one exits.

        ``timeout`` bounds the wait for an engine that does not answer at all (from its
        start, or from its last answer); one that answers alive and not ready (loading its
        model) is waited for up to ``load_timeout`` seconds from its first such answer
        (0: no bound). EngineStartError when either runs out.
        """
        start = time.monotonic()
        last_answer = {e.index: start for e in self.engines}  # moved on by each ALIVE answer
        loading_since: dict[int, float] = {}
        pending = list(self.engines)
        while pending:
            for engine in list(pending):
                code = engine.returncode()
                if code is not None:
                    raise EngineStartError(
                        f"{engine.kind} {engine.index} {engine.exit_reason(code)} (during start-up)"
                    )
                state = await health_of(engine.address)
                now = time.monotonic()
                name = f"{engine.kind} {engine.index} ({engine.address})"
                if state is Health.SERVING:
                    pending.remove(engine)
                elif state is Health.ALIVE:
                    last_answer[engine.index] = now
                    since = loading_since.setdefault(engine.index, now)
                    if load_timeout and now - since > load_timeout:
                        raise EngineStartError(
                            f"{name} alive but not SERVING after {now - since:.0f} s of loading "
                            f"(--load-timeout {load_timeout:g})"
                        )
                elif now - last_answer[engine.index] > timeout:
                    raise EngineStartError(f"{name} did not answer within {timeout:g} s (--connect-timeout)")
            if pending:
                await asyncio.sleep(_POLL_S)

    async def watch(self) -> None:
        """Restart engines that exit while serving, until ``stop``; runs forever."""
        delays = {e.index: self.policy.initial_s for e in self.engines}
        restarting: set[int] = set()
        tasks: set[asyncio.Task[None]] = set()

        async def restart(engine: EngineProcess, code: int, delay: float) -> None:
            logger.warning("%s %d (pid %s) %s; restarting it in %.1f s",
                           engine.kind, engine.index, engine.pid, engine.exit_reason(code), delay)
            await asyncio.sleep(delay)
            if not self._stopping:
                engine.start()
            restarting.discard(engine.index)

        while True:
            for engine in self.engines:
                code = engine.returncode()
                if code is None or engine.index in restarting or self._stopping:
                    continue
                if time.monotonic() - engine.started_at >= self.policy.reset_after_s:
                    delays[engine.index] = self.policy.initial_s
                delay = delays[engine.index]
                delays[engine.index] = min(delay * 2, self.policy.max_s)
                restarting.add(engine.index)
                task = asyncio.create_task(restart(engine, code, delay))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(_POLL_S)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM every engine (each drains), wait up to ``grace_s``, then SIGKILL."""
        self._stopping = True
        logger.info("stopping %d engine(s): SIGTERM, then SIGKILL after %.0f s", len(self.engines), grace_s)
        for engine in self.engines:
            engine.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(e.returncode() is None for e in self.engines):
            await asyncio.sleep(_POLL_S)
        self.kill()

    def kill(self) -> None:
        """SIGKILL whatever is left (also each engine's own children)."""
        self._stopping = True
        for engine in self.engines:
            if engine.returncode() is None:
                logger.warning("%s %d (pid %s) did not exit in time; killing it", engine.kind, engine.index, engine.pid)
            engine.kill_group()
