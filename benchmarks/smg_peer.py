"""SMG (the ``smg`` wheel's gateway, ``pip install smg``) in front of Tandem engines, which
it drives over vllm.grpc.engine.VllmEngine: a peer for tests/test_smg_e2e.py and
benchmarks/smg_serving.py."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT = 120.0  # seconds for SMG to register, probe and activate every worker


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def smg_executable() -> str | None:
    """The ``smg`` console script next to this interpreter (or on PATH); None: not installed."""
    beside = Path(sys.executable).parent / "smg"
    if beside.is_file():
        return str(beside)
    return shutil.which("smg")


@dataclass
class SmgGateway:
    """One ``smg launch --backend vllm`` process over ``worker_urls``."""

    proc: subprocess.Popen[bytes]
    base_url: str  # http://host:port
    log_path: Path
    num_workers: int
    prometheus_port: int

    @classmethod
    def launch(
        cls, model_dir: str, engine_addresses: Sequence[str], log_dir: Path, policy: str = "cache_aware",
        extra_args: Sequence[str] = (), spawn: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen,
    ) -> SmgGateway:
        """``spawn``: how to start the process (tests pass one that kills it with them)."""
        exe = smg_executable()
        if exe is None:
            raise FileNotFoundError("the smg wheel is not installed (pip install smg)")
        port, prometheus_port = free_port(), free_port()
        args = [
            exe, "launch", "--backend", "vllm", "--model-path", model_dir,
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--policy", policy, "--log-level", "warn",
            "--worker-urls", *[f"grpc://{a}" for a in engine_addresses], *extra_args,
        ]
        log_path = log_dir / "smg.log"
        with open(log_path, "wb") as log:
            proc = spawn(args, stdout=log, stderr=subprocess.STDOUT)
        return cls(proc, f"http://127.0.0.1:{port}", log_path, len(engine_addresses), prometheus_port)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def workers(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.base_url}/workers", timeout=5) as reply:
            return json.loads(reply.read())["workers"]

    def kv_batches_applied(self) -> dict[str, float]:
        """Worker URL -> KV-event batches SMG has applied to its prefix index."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.prometheus_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name == "smg_kv_event_apply_seconds":
                for sample in family.samples:
                    if sample.name.endswith("_count"):
                        counts[sample.labels["worker"]] = sample.value
        return counts

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Until every worker is registered, healthy and ready (SMG probes the engines'
        grpc.health.v1, then VllmEngine/HealthCheck, GetModelInfo and the tokenizer)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                ready = [w for w in self.workers() if w.get("is_healthy") and w.get("status") == "ready"]
                if len(ready) == self.num_workers:
                    return
            except (OSError, urllib.error.URLError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg not ready within {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.3)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
