"""Process fixtures for the end-to-end tests: engines and frontends as real subprocesses.

``start_stack`` starts N ``tandem engine`` processes and one ``tandem frontend`` on free
localhost ports, waits until each reports SERVING through grpc.health.v1, and always
stops them again (SIGTERM, then SIGKILL), also when start-up fails. Every child also
gets SIGKILL from the kernel if the test process dies (PR_SET_PDEATHSIG), and an
atexit hook kills any child still running, so no run leaks processes.

Test modules load this file with ``pytest_plugins = ["tests.e2e_helpers"]`` so that the
session-scoped ``e2e_stack`` (2 engines + frontend on the tiny Llama) is shared by all
of them. (PYTEST_DONT_REWRITE: the test modules import it before pytest loads it as a
plugin; it raises its own errors instead of using assert.)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.protocol import convert
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams
from tandem.v1 import engine_pb2, engine_pb2_grpc, frontend_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent

# Small enough for 2 shared cores: one torch thread, a ~2400-block KV cache.
ENGINE_ARGS: tuple[str, ...] = (
    "--max-model-len", "1024",
    "--kv-cache-memory-bytes", "20000000",
    "--num-threads", "1",
)
START_TIMEOUT = 120.0  # seconds a process may take to report SERVING (busy CI cores)
# Every child gets this admin token (TANDEM_ADMIN_TOKEN), so tests can call admin RPCs
# (ResetPrefixCache, PauseGeneration) on the public ports with ADMIN_METADATA.
ADMIN_TOKEN = "e2e-admin-token"
ADMIN_METADATA = (("authorization", f"Bearer {ADMIN_TOKEN}"),)

_children: list[subprocess.Popen[bytes]] = []


def _kill_leftovers() -> None:
    for proc in _children:
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)


atexit.register(_kill_leftovers)


# Children are started through this launcher rather than with a preexec_fn: fork()
# with preexec_fn runs gRPC's fork handlers in a process whose gRPC threads are busy,
# and the launcher keeps the spawn a plain posix_spawn. PR_SET_PDEATHSIG survives exec.
_LAUNCHER = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    sys.exit(1)  # the test process is already gone
os.execv(sys.argv[2], sys.argv[2:])
"""


def launch(
    argv: Sequence[str], env: Mapping[str, str] | None = None, **popen_kwargs: object
) -> subprocess.Popen[bytes]:
    """Popen ``argv`` so that it gets SIGKILL when this process dies; ``env`` adds to
    (or overrides) the child's environment."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *argv],
        stdin=subprocess.DEVNULL,
        cwd=REPO_ROOT,
        env={**child_env(), **(env or {})},
        **popen_kwargs,  # type: ignore[call-overload]
    )
    _children.append(proc)
    return proc


def free_port() -> int:
    """A localhost TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_ports(engines: int = 1, attempts: int = 50) -> tuple[int, int]:
    """(frontend port, engine base port) for ``tandem serve`` from one range of free ports:
    the frontend at base, its admin listener at base + 1 (serve's default), the engines
    from base + 2. Ports picked one at a time can land on each other's + 1."""
    for _ in range(attempts):
        base = free_port()
        try:
            for port in range(base + 1, base + 2 + engines):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base, base + 2
    raise RuntimeError(f"no {engines + 2} consecutive free ports")


def tandem_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", *args]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        TANDEM_ADMIN_TOKEN=ADMIN_TOKEN,
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


@dataclass
class ServiceProcess:
    """One ``tandem`` subprocess, its address and its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    address: str
    log_path: Path

    @classmethod
    def spawn(
        cls,
        name: str,
        args: Sequence[str],
        address: str,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
    ) -> ServiceProcess:
        log_path = log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = launch(tandem_command(*args), env=env, stdout=log, stderr=subprocess.STDOUT)
        return cls(name, proc, address, log_path)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 3000) -> str:
        return self.log()[-chars:]

    def health(self, service: str = "", timeout: float = 2.0) -> int | None:
        """The health status (health_pb2 enum value), or None if nothing answers."""
        with grpc.insecure_channel(self.address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout
                )
            except grpc.RpcError:
                return None
            return reply.status

    def wait_health(self, wanted: int, timeout: float = START_TIMEOUT) -> None:
        """Poll health until it reports ``wanted``; fail early if the process exits."""
        deadline = time.monotonic() + timeout
        while True:
            if self.health() == wanted:
                return
            if not self.alive:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before reporting "
                    f"{health_pb2.HealthCheckResponse.ServingStatus.Name(wanted)}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name} at {self.address} did not report "
                    f"{health_pb2.HealthCheckResponse.ServingStatus.Name(wanted)} "
                    f"within {timeout:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def wait_serving(self, timeout: float = START_TIMEOUT) -> None:
        self.wait_health(health_pb2.HealthCheckResponse.SERVING, timeout)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit within ``timeout``."""
        if self.alive:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.alive:
            self.proc.kill()
        self.proc.wait(timeout=10)


def spawn_python(code: str, *args: str) -> subprocess.Popen[bytes]:
    """A Python child running ``code`` (stdout and stderr piped), killed with us if we die."""
    return launch([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def start_engine(
    model_dir: str,
    index: int,
    log_dir: Path,
    engine_args: Sequence[str] = ENGINE_ARGS,
    *,
    metrics_port: int = 0,
    env: Mapping[str, str] | None = None,
) -> ServiceProcess:
    """An engine on a free port; ``metrics_port`` 0 (the default) keeps /metrics off, so
    parallel stacks never fight over the default metrics ports."""
    port = free_port()
    args = [
        "engine", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
        "--engine-index", str(index), "--metrics-port", str(metrics_port), *engine_args,
    ]
    return ServiceProcess.spawn(f"engine{index}", args, f"127.0.0.1:{port}", log_dir, env)


def start_frontend(
    model_dir: str,
    engine_addresses: Sequence[str],
    log_dir: Path,
    connect_timeout: float = START_TIMEOUT,
    name: str = "frontend",
    *,
    metrics_port: int = 0,
    env: Mapping[str, str] | None = None,
    http_port: int = 0,
) -> ServiceProcess:
    """A frontend on a free port; /metrics and the HTTP API are off unless their ports are given."""
    port = free_port()
    args = ["frontend", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--connect-timeout", str(connect_timeout), "--metrics-port", str(metrics_port),
            "--http-port", str(http_port)]
    for address in engine_addresses:
        args += ["--engine", address]
    return ServiceProcess.spawn(name, args, f"127.0.0.1:{port}", log_dir, env)


@dataclass
class Stack:
    """Engines plus one frontend, all SERVING."""

    model_dir: str
    engines: list[ServiceProcess]
    frontend: ServiceProcess
    started_at: float = field(default_factory=time.monotonic)
    _channels: list[grpc.Channel] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.frontend.address

    def generation_stub(self) -> frontend_pb2_grpc.GenerationStub:
        channel = grpc.insecure_channel(self.address)
        self._channels.append(channel)
        return frontend_pb2_grpc.GenerationStub(channel)

    def engine_infos(self, timeout: float = 10.0) -> list[engine_pb2.GetEngineInfoResponse]:
        """GetEngineInfo of every live engine (the ones that still run)."""
        infos = []
        for engine in self.engines:
            if not engine.alive:
                continue
            with grpc.insecure_channel(engine.address) as channel:
                infos.append(
                    engine_pb2_grpc.EngineCoreStub(channel).GetEngineInfo(
                        engine_pb2.GetEngineInfoRequest(), timeout=timeout
                    )
                )
        return infos

    def wait_engines_idle(self, timeout: float = 30.0) -> list[engine_pb2.GetEngineInfoResponse]:
        """Poll until every live engine runs and queues nothing and has every KV block free."""
        deadline = time.monotonic() + timeout
        while True:
            infos = self.engine_infos()
            if all(
                i.num_running_reqs == 0 and i.num_waiting_reqs == 0 and i.num_free_blocks == i.num_kv_blocks
                for i in infos
            ):
                return infos
            if time.monotonic() > deadline:
                shown = [
                    (i.engine_index, i.num_running_reqs, i.num_waiting_reqs, i.num_free_blocks, i.num_kv_blocks)
                    for i in infos
                ]
                raise AssertionError(
                    f"engines not idle after {timeout:.0f}s (index, running, waiting, free, total): {shown}"
                )
            time.sleep(0.1)

    def reset_prefix_caches(self) -> None:
        """Empty every live engine's prefix cache (engines must be idle)."""
        for engine in self.engines:
            if engine.alive:
                with grpc.insecure_channel(engine.address) as channel:
                    reply = engine_pb2_grpc.EngineCoreStub(channel).ResetPrefixCache(
                        engine_pb2.ResetPrefixCacheRequest(), timeout=30, metadata=ADMIN_METADATA
                    )
                if not reply.success:
                    raise RuntimeError(f"{engine.name} could not reset its prefix cache")

    def stop(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        for proc in (self.frontend, *self.engines):
            with contextlib.suppress(Exception):
                proc.stop()


def engine_cached_tokens(address: str, prompt_token_ids: Sequence[int], timeout: float = 60.0) -> int:
    """Send one 1-token request straight to an engine (its own Stream, as a second
    frontend would) and return how many prompt tokens its prefix cache served: a
    probe of which KV blocks earlier requests on that engine computed."""
    request_id = f"probe-{uuid.uuid4().hex[:8]}"
    request = EngineCoreRequest(
        request_id, list(prompt_token_ids), SamplingParams(max_tokens=1, temperature=0.0)
    )
    done = threading.Event()

    def inputs() -> Iterator[engine_pb2.EngineCoreInput]:
        yield convert.hello_input(99)
        yield convert.add_input(request)
        done.wait(timeout)  # closing the input side would end the stream

    with grpc.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineCoreStub(channel).Stream(inputs(), timeout=timeout)
        try:
            for msg in call:
                for out in msg.outputs:
                    if out.request_id == request_id and out.finish_reason:
                        return out.num_cached_tokens
        finally:
            done.set()
            call.cancel()
    raise RuntimeError(f"the engine at {address} ended the stream without finishing the probe")


@contextlib.contextmanager
def start_stack(
    model_dir: str,
    num_engines: int,
    log_dir: Path,
    engine_args: Sequence[str] = ENGINE_ARGS,
    http_port: int = 0,
) -> Iterator[Stack]:
    """Start engines and frontend together (the frontend waits for the engines itself)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[ServiceProcess] = []
    try:
        engines = []
        for i in range(num_engines):
            engines.append(start_engine(model_dir, i, log_dir, engine_args))
            started.append(engines[-1])
        frontend = start_frontend(model_dir, [e.address for e in engines], log_dir, http_port=http_port)
        started.append(frontend)
        for proc in started:
            proc.wait_serving()
        stack = Stack(model_dir, engines, frontend)
    except BaseException:
        for proc in reversed(started):
            with contextlib.suppress(Exception):
                proc.stop(timeout=5)
        raise
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def e2e_stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The shared stack: 2 engines + a frontend on the tiny Llama."""
    with start_stack(tiny_llama_dir, 2, tmp_path_factory.mktemp("e2e_stack_logs")) as stack:
        yield stack


def live_children(pid: int, *, skip_resource_tracker: bool = False) -> list[int]:
    """Live (non-zombie) processes whose parent is ``pid`` (read from /proc);
    ``skip_resource_tracker``: but multiprocessing's resource tracker, which the first
    spawned process starts and which lives as long as its parent."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) != pid or state == "Z":
                continue
            if skip_resource_tracker and b"resource_tracker" in Path(f"/proc/{entry}/cmdline").read_bytes():
                continue
        except OSError:
            continue
        found.append(int(entry))
    return found
