"""Engines and a frontend as child processes that the chaos runs can kill and restart.

Unlike ``tandem serve`` (which supervises its engines), each process here is started
and stopped by the caller, so a run can SIGKILL one engine and bring it back on the
same port as an orchestrator would. Every child gets SIGKILL from the kernel when the
process that started it dies (PR_SET_PDEATHSIG), so an interrupted run leaks nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.parent_death import guarded
from tandem.v1 import engine_pb2, engine_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
# Small enough for 2 shared cores: one torch thread, a ~2400-block KV cache.
DEFAULT_ENGINE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory-bytes", "20000000", "--num-threads", "1")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


@dataclass
class Service:
    """One ``tandem engine`` or ``tandem frontend`` process on a fixed address."""

    name: str
    args: list[str]  # the tandem CLI arguments; the same on every (re)start
    address: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Call from a long-lived thread: the kernel's parent-death signal follows the
        thread that forked, so a child started from a pool thread dies with that thread."""
        with open(self.log_path, "ab") as log:
            # Through the parent-death launcher, not a preexec_fn: a fork of this process
            # (gRPC threads busy in a test run) would run gRPC's fork handlers in the child.
            self.proc = subprocess.Popen(
                guarded([sys.executable, "-m", "tandem.cli", *self.args]),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=_child_env(),
            )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def health(self, timeout: float = 2.0) -> int | None:
        """The grpc.health.v1 status of service "", or None if nothing answers."""
        with grpc.insecure_channel(self.address) as channel:
            try:
                return health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=timeout
                ).status
            except grpc.RpcError:
                return None

    def wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.health() != SERVING:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited before SERVING:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not SERVING after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def rss_bytes(self) -> int:
        """Resident set size now (VmRSS of /proc/PID/status)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for {self.name}")

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None:
            return
        if self.alive:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class ChaosStack:
    """``num_engines`` engines and one frontend on free localhost ports."""

    model: str
    num_engines: int
    log_dir: Path
    engine_args: Sequence[str] = DEFAULT_ENGINE_ARGS
    start_timeout: float = 180.0
    engines: list[Service] = field(default_factory=list)
    frontend: Service | None = None

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.num_engines):
            port = free_port()
            args = ["engine", "--model", self.model, "--host", "127.0.0.1", "--port", str(port),
                    "--engine-index", str(i), "--metrics-port", "0", *self.engine_args]
            self.engines.append(Service(f"engine{i}", args, f"127.0.0.1:{port}", self.log_dir / f"engine{i}.log"))
        port = free_port()
        args = ["frontend", "--model", self.model, "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", "0", "--http-port", "0", "--connect-timeout", str(self.start_timeout)]
        for engine in self.engines:
            args += ["--engine", engine.address]
        self.frontend = Service("frontend", args, f"127.0.0.1:{port}", self.log_dir / "frontend.log")

    @property
    def address(self) -> str:
        assert self.frontend is not None
        return self.frontend.address

    @property
    def services(self) -> list[Service]:
        assert self.frontend is not None
        return [self.frontend, *self.engines]

    def start(self) -> ChaosStack:
        try:
            for service in self.services:
                service.start()
            for service in self.services:
                service.wait_serving(self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def restart_engine(self, index: int) -> Service:
        """Start engine ``index`` again on its address (after a kill); returns it (wait
        for its SERVING with ``wait_serving``, from any thread)."""
        engine = self.engines[index]
        engine.kill()
        engine.start()
        return engine

    def engine_info(self, index: int, timeout: float = 10.0) -> engine_pb2.GetEngineInfoResponse:
        with grpc.insecure_channel(self.engines[index].address) as channel:
            return engine_pb2_grpc.EngineCoreStub(channel).GetEngineInfo(
                engine_pb2.GetEngineInfoRequest(), timeout=timeout
            )

    def engine_load(self) -> list[tuple[int, int, int]]:
        """(running, waiting, KV blocks in use) of each live engine."""
        loads = []
        for i, engine in enumerate(self.engines):
            if engine.alive:
                info = self.engine_info(i)
                loads.append((info.num_running_reqs, info.num_waiting_reqs, info.num_kv_blocks - info.num_free_blocks))
        return loads

    def wait_idle(self, timeout: float) -> list[tuple[int, int, int]]:
        """Poll until every live engine is idle with all blocks free; the last loads seen."""
        deadline = time.monotonic() + timeout
        while True:
            loads = self.engine_load()
            if all(load == (0, 0, 0) for load in loads) or time.monotonic() > deadline:
                return loads
            time.sleep(0.1)

    def stop(self) -> None:
        for service in self.services:
            with contextlib.suppress(Exception):
                service.stop()

    def __enter__(self) -> ChaosStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
