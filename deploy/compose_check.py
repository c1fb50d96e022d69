#!/usr/bin/env python3
"""The docker-compose stack, built and run for real (``make compose-check``).

Builds both images (Dockerfile targets ``engine`` and ``frontend``), brings up the Tandem
services of docker-compose.yml (frontend + two engines; the observability profile stays off
unless ``--profile observability``), waits for their healthchecks, and then checks:

- a ``Generate`` streamed through the published gRPC port, and an OpenAI streaming
  completion through the published HTTP port;
- the frontend image holds no torch and is at most a third of the engine image's size;
- every container runs as a non-root user (its configured user and every process in it);
- engine kill under load: streams are running on both engines, one engine's processes are
  SIGKILLed (a crash, not a ``docker stop``); every stream completes on the other engine
  (the frontend's ``tandem:request_migrations`` counter counts them), docker restarts the
  container (``restart: unless-stopped``) and the frontend places requests on it again;
- drain: ``compose stop`` with streams in flight; every stream completes and every
  container exits 0;
- with ``--disaggregated``, the ``disaggregated`` profile too (a producer engine, a
  consumer engine, a ``--disaggregated`` frontend on 50052): greedy streams through it give
  the default stack's tokens, and the consumer pulled their KV from the producer over the
  compose network (its ``tandem:kv_transfer_loads{outcome="ok"}`` and received bytes);

then prints image sizes and times to healthy, and tears the stack down (``compose down``).

It needs a Docker engine: it starts ``dockerd`` itself when none answers and it can (root,
``dockerd`` installed), and otherwise prints one line with ``skip`` and why, and exits 0.
No other line it prints contains that word. Exit status 1: a check failed.

Machine-specific inputs, as flags or environment variables (nothing here is hard-coded):

  --base-image / TANDEM_BASE_IMAGE            the Dockerfile's BASE_IMAGE (default
                                              python:3.11-slim)
  --build-network / TANDEM_BUILD_NETWORK      `docker build --network` (e.g. host)
  --ca-bundle / TANDEM_BUILD_CA_BUNDLE        a PEM file of extra CAs for the build
                                              (deploy/build-ca/)
  --wheels / TANDEM_BUILD_WHEELS              a directory of wheels for the build
                                              (deploy/wheels/), e.g. torch's CPU wheel
  --index-url / TANDEM_PIP_INDEX_URL          PIP_INDEX_URL in the build
  --extra-index-url / TANDEM_PIP_EXTRA_INDEX_URL
  --torch-index-url / TANDEM_TORCH_INDEX_URL  TORCH_INDEX_URL ("" = no separate index)
  --dockerd-args / TANDEM_DOCKERD_ARGS        flags for a dockerd this script starts
                                              (default: tried plain, then with
                                              --storage-driver=vfs --iptables=false)

The build context is a temporary copy of the sources (with the CA bundle and the wheels
added there), so the working tree is not touched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
FRONTEND, ENGINES = "frontend", ("engine-0", "engine-1")
SERVICES = (FRONTEND, *ENGINES)
# The disaggregated profile: frontend, producer, consumer.
DISAGG_FRONTEND, PRODUCER, CONSUMER = "frontend-disaggregated", "engine-prefill", "engine-decode"
# What the build context needs (the Dockerfile's COPY sources), copied to a temporary dir.
CONTEXT_FILES = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md")
CONTEXT_DIRS = ("engine_service", "frontend_service", "kernels", "tandem", "deploy/build-ca",
                "deploy/wheels")
FALLBACK_DOCKERD_ARGS = ["--storage-driver=vfs", "--iptables=false"]
MAX_FRONTEND_SHARE = 1 / 3  # frontend image size / engine image size


class CheckFailed(Exception):
    pass


def log(msg: str) -> None:
    print(f"compose-check: {msg}", flush=True)


def skip(reason: str) -> None:
    print(f"compose-check: skip: {reason}", flush=True)
    raise SystemExit(0)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)
    log(f"ok: {what}")


# ---- settings --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-image", default=env("TANDEM_BASE_IMAGE") or None,
                   help="BASE_IMAGE build argument (env TANDEM_BASE_IMAGE; default: the Dockerfile's)")
    p.add_argument("--build-network", default=env("TANDEM_BUILD_NETWORK") or None,
                   help="docker build --network (env TANDEM_BUILD_NETWORK)")
    p.add_argument("--ca-bundle", default=env("TANDEM_BUILD_CA_BUNDLE") or None,
                   help="PEM file of extra CA certificates for the build (env TANDEM_BUILD_CA_BUNDLE)")
    p.add_argument("--wheels", default=env("TANDEM_BUILD_WHEELS") or None,
                   help="directory of wheels for the build's pip (env TANDEM_BUILD_WHEELS)")
    p.add_argument("--index-url", default=env("TANDEM_PIP_INDEX_URL") or None,
                   help="PIP_INDEX_URL build argument (env TANDEM_PIP_INDEX_URL)")
    p.add_argument("--extra-index-url", default=env("TANDEM_PIP_EXTRA_INDEX_URL") or None,
                   help="PIP_EXTRA_INDEX_URL build argument (env TANDEM_PIP_EXTRA_INDEX_URL)")
    p.add_argument("--torch-index-url", default=env("TANDEM_TORCH_INDEX_URL"),
                   help="TORCH_INDEX_URL build argument, '' for none (env TANDEM_TORCH_INDEX_URL)")
    p.add_argument("--dockerd-args", default=env("TANDEM_DOCKERD_ARGS"),
                   help="flags for a dockerd started here (env TANDEM_DOCKERD_ARGS)")
    p.add_argument("--no-build", action="store_true", help="use the images as they are")
    p.add_argument("--project", default="tandem-check", help="compose project name")
    p.add_argument("--profile", action="append", default=[],
                   help="compose profile to enable as well (e.g. observability); repeatable")
    p.add_argument("--healthy-timeout", type=float, default=600.0,
                   help="seconds to wait for the services to turn healthy")
    p.add_argument("--streams", type=int, default=6, help="concurrent streams in the kill and drain checks")
    p.add_argument("--keep-up", action="store_true", help="leave the stack running at the end")
    p.add_argument("--disaggregated", action="store_true",
                   help="also start the disaggregated profile and check it (tokens, KV pulled)")
    return p.parse_args(argv)


def build_args(args: argparse.Namespace) -> list[str]:
    """`docker build` flags for the machine-specific inputs (the build context's extra
    files are added by :func:`build_context`)."""
    out: list[str] = []
    if args.build_network:
        out += ["--network", args.build_network]
    for name, value in (("BASE_IMAGE", args.base_image), ("PIP_INDEX_URL", args.index_url),
                        ("PIP_EXTRA_INDEX_URL", args.extra_index_url),
                        ("TORCH_INDEX_URL", args.torch_index_url)):
        if value is not None:
            out += ["--build-arg", f"{name}={value}"]
    return out


@contextlib.contextmanager
def build_context(args: argparse.Namespace) -> Iterator[Path]:
    """A temporary copy of what the Dockerfile copies, plus the CA bundle and the wheels."""
    with tempfile.TemporaryDirectory(prefix="tandem-build-") as tmp:
        ctx = Path(tmp)
        for name in CONTEXT_FILES:
            shutil.copy2(ROOT / name, ctx / name)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        for name in CONTEXT_DIRS:
            shutil.copytree(ROOT / name, ctx / name, ignore=ignore)
        if args.ca_bundle:
            shutil.copy2(args.ca_bundle, ctx / "deploy/build-ca/compose-check-extra.crt")
        if args.wheels:
            wheels = sorted(Path(args.wheels).glob("*.whl"))
            if not wheels:
                raise CheckFailed(f"--wheels {args.wheels}: no *.whl there")
            for wheel in wheels:
                dest = ctx / "deploy/wheels" / wheel.name
                try:
                    os.link(wheel, dest)
                except OSError:
                    shutil.copy2(wheel, dest)
        yield ctx


# ---- docker ----------------------------------------------------------------------------------


def run(cmd: Sequence[str], *, check_rc: bool = True, timeout: float | None = 600,
        capture: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=capture, text=True, timeout=timeout)
    if check_rc and proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "")[-3000:] if capture else ""
        raise CheckFailed(f"{shlex.join(cmd)} exited {proc.returncode}\n{tail}")
    return proc


def docker_answers() -> bool:
    try:
        return run(["docker", "info", "--format", "{{.ServerVersion}}"], check_rc=False,
                   timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def ensure_docker(args: argparse.Namespace) -> None:
    """A Docker engine that answers, started here where none does; skip where none can run."""
    if shutil.which("docker") is None:
        skip("no docker CLI on PATH (apt-get install docker.io)")
    if docker_answers():
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        skip("no Docker engine answers and dockerd is not installed (apt-get install docker.io)")
    if os.geteuid() != 0:
        skip("no Docker engine answers and starting dockerd needs root")
    attempts = [shlex.split(args.dockerd_args)] if args.dockerd_args is not None else [[], FALLBACK_DOCKERD_ARGS]
    for extra in attempts:
        log_path = Path(tempfile.gettempdir()) / "tandem-compose-check-dockerd.log"
        cmd = [dockerd, *extra]
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            if docker_answers():
                log(f"started `{shlex.join(cmd)}` (pid {proc.pid}, log {log_path}); it keeps running")
                return
            time.sleep(1)
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        log(f"`{shlex.join(cmd)}` did not come up (see {log_path})")
    skip("no Docker engine answers and dockerd could not be started here")


def compose_cmd() -> list[str] | None:
    """`docker compose` (v2 plugin) or `docker-compose` (v1 or v2 standalone)."""
    if run(["docker", "compose", "version"], check_rc=False, timeout=30).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def image_size(image: str) -> int:
    return int(run(["docker", "image", "inspect", "-f", "{{.Size}}", image]).stdout.strip())


def inspect(container: str) -> dict[str, Any]:
    return json.loads(run(["docker", "inspect", container]).stdout)[0]


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


# ---- the stack -------------------------------------------------------------------------------


@dataclass
class Stack:
    compose: list[str]
    project: str
    profiles: list[str]
    config: dict[str, Any] = field(default_factory=dict)

    def cmd(self, *words: str) -> list[str]:
        out = [*self.compose, "-f", str(COMPOSE_FILE), "-p", self.project]
        for profile in self.profiles:
            out += ["--profile", profile]
        return [*out, *words]

    def container(self, service: str) -> str:
        ids = run(self.cmd("ps", "-q", service)).stdout.split()
        if len(ids) != 1:
            raise CheckFailed(f"{service}: {len(ids)} containers")
        return ids[0]

    def image(self, service: str) -> str:
        return self.config["services"][service]["image"]

    def published(self, service: str, container_port: int) -> int:
        for spec in self.config["services"][service].get("ports", []):
            parts = str(spec).split("/")[0].split(":")
            if int(parts[-1]) == container_port:
                return int(parts[-2])
        raise CheckFailed(f"{service} does not publish {container_port}")

    def wait_healthy(self, services: Sequence[str], start: float, timeout: float) -> dict[str, float]:
        healthy: dict[str, float] = {}
        deadline = start + timeout
        while len(healthy) < len(services):
            for service in services:
                if service in healthy:
                    continue
                with contextlib.suppress(CheckFailed):
                    state = inspect(self.container(service))["State"]
                    if state.get("Health", {}).get("Status") == "healthy":
                        healthy[service] = time.monotonic() - start
            if time.monotonic() > deadline:
                missing = sorted(set(services) - set(healthy))
                raise CheckFailed(f"not healthy after {timeout:.0f} s: {missing}\n{self.logs(missing)}")
            time.sleep(1)
        return healthy

    def logs(self, services: Sequence[str], tail: int = 40) -> str:
        proc = run(self.cmd("logs", "--no-color", "--tail", str(tail), *services), check_rc=False)
        return proc.stdout[-6000:]


# ---- clients ---------------------------------------------------------------------------------


def grpc_modules() -> tuple[Any, Any, Any, Any]:
    sys.path.insert(0, str(ROOT))
    import grpc

    from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

    return grpc, common_pb2, frontend_pb2, frontend_pb2_grpc


@dataclass
class StreamResult:
    index: int
    tokens: int = 0
    ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""
    error: str = ""
    first_token_at: float | None = None
    done_at: float | None = None


class Streams:
    """``n`` concurrent Generate streams of ``max_tokens`` tokens each (greedy, no EOS)."""

    def __init__(self, target: str, n: int, max_tokens: int, api_key: str | None, tag: str,
                 context: str = "") -> None:
        self.grpc, self.common, self.fe, self.fe_grpc = grpc_modules()
        self.channel = self.grpc.insecure_channel(target)
        self.stub = self.fe_grpc.GenerationStub(self.channel)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        self.max_tokens = max_tokens
        self.context = context  # put before each stream's prompt
        self.started_at = time.monotonic()
        self.results = [StreamResult(i) for i in range(n)]
        self.threads = [threading.Thread(target=self._run, args=(r, tag), daemon=True) for r in self.results]

    def start(self) -> Streams:
        self.started_at = time.monotonic()
        for t in self.threads:
            t.start()
        return self

    def _run(self, result: StreamResult, tag: str) -> None:
        params = self.common.SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True,
                                            output_kind=self.common.OUTPUT_KIND_DELTA)
        request = self.fe.GenerateRequest(prompt=f"{self.context}Stream {result.index} of the {tag} check:",
                                          sampling_params=params, request_id=f"{tag}-{result.index}")
        try:
            for response in self.stub.Generate(request, metadata=self.metadata, timeout=600):
                for out in response.outputs:
                    result.tokens += len(out.token_ids)
                    result.ids.extend(out.token_ids)
                    if out.finish_reason:
                        result.finish_reason = out.finish_reason
                if result.tokens and result.first_token_at is None:
                    result.first_token_at = time.monotonic()
                if response.finished:
                    result.finished = True
        except self.grpc.RpcError as exc:
            result.error = f"{exc.code().name}: {exc.details()}"
        result.done_at = time.monotonic()

    def wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(r.first_token_at is None and not r.error for r in self.results):
            if time.monotonic() > deadline:
                raise CheckFailed(f"streams did not start within {timeout:.0f} s")
            time.sleep(0.05)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.channel.close()

    def complete(self) -> list[StreamResult]:
        return [r for r in self.results
                if r.finished and not r.error and r.tokens == self.max_tokens and r.finish_reason == "length"]

    def summary(self) -> str:
        bad = [r for r in self.results if r not in self.complete()]
        text = f"{len(self.complete())}/{len(self.results)} streams completed ({self.max_tokens} tokens each"
        ends = [r.done_at for r in self.results if r.done_at is not None]
        if ends:
            text += f", the last after {max(ends) - self.started_at:.1f} s"
        text += ")"
        if bad:
            text += "; incomplete: " + ", ".join(
                f"#{r.index} {r.tokens} tokens {r.finish_reason or '-'} {r.error}".strip() for r in bad)
        return text


def engine_states(http_base: str) -> dict[str, tuple[bool, int]]:
    """engine service name -> (the frontend's stream to it is up, the frontend's requests in
    flight on it), from the frontend's /metrics (tandem:engine_healthy,
    tandem:engine_in_flight_requests; admin RPCs need a token, metrics do not)."""
    text = metrics_text(http_base)
    healthy = {a.rpartition(":")[0]: v == 1 for a, v in samples(text, "tandem:engine_healthy", "address")}
    flight = {a.rpartition(":")[0]: int(v) for a, v in samples(text, "tandem:engine_in_flight_requests", "address")}
    return {name: (healthy.get(name, False), flight.get(name, 0)) for name in healthy}


def metrics_text(http_base: str) -> str:
    with urllib.request.urlopen(f"{http_base}/metrics", timeout=10) as r:
        return r.read().decode()


def samples(text: str, name: str, label: str) -> list[tuple[str, float]]:
    """(value of ``label``, sample value) of each sample of metric ``name``."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})?\s+(\S+)", line)
        if m and m.group(1) == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.append((labels.get(label, ""), float(m.group(3))))
    return out


def metric(http_base: str, name: str) -> float:
    """Sum of a metric's samples on the frontend's /metrics."""
    return sum(v for _, v in samples(metrics_text(http_base), name, ""))


# ---- the checks ------------------------------------------------------------------------------


def engine_metric(stack: Stack, service: str, name: str, label: str, value: str) -> float:
    """A sample of an engine's /metrics, read inside its container (8001 is not published)."""
    probe = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8001/metrics', timeout=10).read().decode())"
    text = run(["docker", "exec", stack.container(service), "python", "-c", probe]).stdout
    return sum(v for lv, v in samples(text, name, label) if lv == value)


def check_disaggregated(stack: Stack, api_key: str | None, n: int) -> dict[str, Any]:
    """Greedy streams through the disaggregated frontend: the default stack's tokens, and
    their KV pulled by the consumer from the producer."""
    before_ok = engine_metric(stack, CONSUMER, "tandem:kv_transfer_loads_total", "outcome", "ok")
    before_bytes = engine_metric(stack, CONSUMER, "tandem:kv_transfer_bytes_total", "direction", "received")
    runs = {}
    # Several KV blocks of prompt: a consumer pulls whole blocks only (a prompt inside one
    # block is computed where it decodes).
    context = " ".join(f"Sentence {i} of a longer prompt, so that its KV fills blocks." for i in range(12)) + "\n"
    for service in (FRONTEND, DISAGG_FRONTEND):
        target = f"127.0.0.1:{stack.published(service, 50051)}"
        streams = Streams(target, n, 32, api_key, "disaggregated", context).start()
        streams.join(300)
        check(len(streams.complete()) == n, f"through {service}: {streams.summary()}")
        runs[service] = [r.ids for r in streams.results]
    same = sum(a == b for a, b in zip(runs[FRONTEND], runs[DISAGG_FRONTEND], strict=True))
    check(same == n, f"{same}/{n} streams through {DISAGG_FRONTEND} have the default stack's token ids")
    loads = engine_metric(stack, CONSUMER, "tandem:kv_transfer_loads_total", "outcome", "ok") - before_ok
    received = engine_metric(stack, CONSUMER, "tandem:kv_transfer_bytes_total", "direction", "received") - before_bytes
    failed = engine_metric(stack, CONSUMER, "tandem:kv_transfer_loads_total", "outcome", "failed")
    served = engine_metric(stack, PRODUCER, "tandem:kv_transfer_pulls_served_total", "", "")
    check(loads >= 1 and received > 0,
          f"{CONSUMER} pulled KV from {PRODUCER}: {loads:.0f} loads ok, {received / 1e6:.2f} MB received, "
          f"{failed:.0f} failed; {PRODUCER} served {served:.0f} pulls")
    return {"streams": n, "loads": loads, "bytes": received, "failed": failed}


def check_images(stack: Stack) -> dict[str, int]:
    sizes = {"frontend": image_size(stack.image(FRONTEND)), "engine": image_size(stack.image(ENGINES[0]))}
    probe = "import importlib.util as u; print(u.find_spec('torch') is None)"
    out = run(["docker", "run", "--rm", stack.image(FRONTEND), "python", "-c", probe]).stdout.strip()
    check(out == "True", "the frontend image holds no torch")
    share = sizes["frontend"] / sizes["engine"]
    check(share <= MAX_FRONTEND_SHARE,
          f"frontend image {gb(sizes['frontend'])} is {share:.0%} of the engine image's "
          f"{gb(sizes['engine'])} (at most {MAX_FRONTEND_SHARE:.0%})")
    return sizes


def check_non_root(stack: Stack, services: Sequence[str] = SERVICES) -> None:
    for service in services:
        cid = stack.container(service)
        user = inspect(cid)["Config"]["User"]
        rows = run(["docker", "top", cid, "-eo", "pid,uid"]).stdout.splitlines()[1:]
        uids = [row.split()[1] for row in rows if row.strip()]
        check(user not in {"", "root", "0"} and uids and all(u not in {"0", "root"} for u in uids),
              f"{service} runs as user {user!r} (process uids {sorted(set(uids))})")


def check_generate(target: str, api_key: str | None) -> None:
    streams = Streams(target, 1, 24, api_key, "generate").start()
    streams.join(120)
    check(len(streams.complete()) == 1, f"Generate streamed through {target}: {streams.summary()}")


def check_openai(http_base: str, api_key: str | None) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{http_base}/v1", api_key=api_key or "none", timeout=120)
    model = client.models.list().data[0].id
    chunks, text = 0, ""
    for chunk in client.completions.create(model=model, prompt="Hello", max_tokens=16, stream=True,
                                           temperature=0):
        chunks += 1
        text += chunk.choices[0].text if chunk.choices else ""
    check(chunks > 1 and text, f"OpenAI streaming completion through {http_base}: {chunks} chunks, "
          f"{len(text)} characters, model {model!r}")


def max_model_len(http_base: str, api_key: str | None) -> int:
    request = urllib.request.Request(f"{http_base}/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=10) as r:
        return int(json.loads(r.read())["data"][0]["max_model_len"])


def calibrate(target: str, api_key: str | None, n: int, max_tokens: int,
              seconds: float = 10.0) -> tuple[int, int]:
    """(streams, max_tokens) for concurrent streams that run for about ``seconds`` here, as
    measured after a warm-up: streams must still run when the engine is killed or the stop
    begins, and end within the drain timeout (30 s). Where even ``max_tokens`` tokens would
    take under half of ``seconds`` (a fast machine), the streams are doubled, up to 4 n."""
    limit = 4 * n
    while True:
        rate = 0.0
        for tokens in (32, 128):  # the first: warm-up
            probe = Streams(target, n, tokens, api_key, "calibrate").start()
            probe.join(300)
            if len(probe.complete()) != n:
                raise CheckFailed(f"calibration: {probe.summary()}")
            rate = tokens / (max(r.done_at or 0 for r in probe.results) - probe.started_at)
        log(f"calibration: {n} streams at {rate:.0f} tokens/s each")
        if max_tokens / rate >= seconds / 2 or 2 * n > limit:
            return n, max(256, min(max_tokens, int(seconds * rate)))
        n *= 2


def check_engine_kill(stack: Stack, target: str, http_base: str, api_key: str | None,
                      n: int, max_tokens: int) -> dict[str, Any]:
    migrated_before = metric(http_base, "tandem:request_migrations_total")
    containers = {e: stack.container(e) for e in ENGINES}  # before the streams: compose is slow
    restart_counts = {e: inspect(c)["RestartCount"] for e, c in containers.items()}
    streams = Streams(target, n, max_tokens, api_key, "kill").start()
    streams.wait_started(120)
    states = engine_states(http_base)
    victim = max(ENGINES, key=lambda e: states.get(e, (False, 0))[1])
    on_victim = states[victim][1]
    check(on_victim > 0 and all(states.get(e, (False, 0))[0] for e in ENGINES),
          f"streams on the engines before the kill (healthy, in flight): {states}")
    cid, restarts = containers[victim], restart_counts[victim]
    killed_at = time.monotonic()
    # SIGKILL to every process but the container's init, like the OOM killer: the init then
    # exits 137 and docker restarts the container (a `docker kill` or `stop` would count as
    # stopped by hand: no restart).
    run(["docker", "exec", "-u", "0", cid, "sh", "-c", "kill -9 -1"], check_rc=False)
    streams.join(600)
    after_kill = [r for r in streams.results if (r.done_at or 0) > killed_at]
    check(len(streams.complete()) == n, f"engine kill ({victim}, {on_victim} of {n} streams on it): "
          f"{streams.summary()}")
    check(len(after_kill) == n, f"all {n} streams were still running at the kill")
    migrations = metric(http_base, "tandem:request_migrations_total") - migrated_before
    check(migrations >= on_victim, f"tandem:request_migrations_total rose by {migrations:.0f} "
          f"(>= the {on_victim} streams of {victim})")
    # docker restarts it; it turns healthy and the frontend serves from it again.
    deadline = time.monotonic() + 600
    while True:
        info = inspect(cid)
        healthy = info["State"].get("Health", {}).get("Status") == "healthy"
        state = engine_states(http_base).get(victim, (False, 0))[0]
        if info["RestartCount"] > restarts and healthy and state:
            break
        if time.monotonic() > deadline:
            raise CheckFailed(f"{victim} did not rejoin: restarts {info['RestartCount']}, "
                              f"health {info['State'].get('Health', {}).get('Status')}, frontend's stream up: {state}\n"
                              f"{stack.logs([victim])}")
        time.sleep(0.5)
    rejoined_s = time.monotonic() - killed_at
    check(True, f"{victim} restarted by docker (restart count {info['RestartCount']}), healthy, and "
          f"the frontend's stream to it up again {rejoined_s:.1f} s after the kill")
    after = Streams(target, n, 64, api_key, "rejoin").start()
    seen_on_victim = 0
    while any(t.is_alive() for t in after.threads):
        seen_on_victim = max(seen_on_victim, engine_states(http_base).get(victim, (False, 0))[1])
        time.sleep(0.05)
    after.join(60)
    check(len(after.complete()) == n and seen_on_victim > 0,
          f"after the rejoin: {after.summary()}, up to {seen_on_victim} on {victim}")
    return {"victim": victim, "on_victim": on_victim, "streams": n, "completed": len(streams.complete()),
            "migrations": migrations, "rejoined_s": rejoined_s}


def check_drain(stack: Stack, target: str, api_key: str | None, n: int, max_tokens: int) -> dict[str, Any]:
    containers = {s: stack.container(s) for s in SERVICES}  # before the streams: compose is slow
    streams = Streams(target, n, max_tokens, api_key, "drain").start()
    streams.wait_started(120)
    t0 = time.monotonic()
    stop = run(stack.cmd("stop"), check_rc=False, timeout=300)
    stop_s = time.monotonic() - t0
    streams.join(60)
    check(stop.returncode == 0, f"compose stop exited {stop.returncode}")
    unfinished_at_stop = sum(1 for r in streams.results if (r.done_at or 0) > t0)
    check(len(streams.complete()) == n, f"drain: {streams.summary()}")
    check(unfinished_at_stop == n, f"all {n} streams were in flight when the stop began")
    codes = {s: inspect(c)["State"]["ExitCode"] for s, c in containers.items()}
    check(all(code == 0 for code in codes.values()), f"every container exited 0 after its drain: {codes}")
    return {"streams": n, "completed": len(streams.complete()), "stop_s": stop_s,
            "last_stream_done_s": max(r.done_at or t0 for r in streams.results) - t0}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_docker(args)
    compose = compose_cmd()
    if compose is None:
        skip("a Docker engine runs but no compose is installed (`docker compose` plugin or "
             "docker-compose: apt-get install docker-compose)")
    import yaml

    profiles = list(args.profile) + (["disaggregated"] if args.disaggregated else [])
    services = SERVICES + ((DISAGG_FRONTEND, PRODUCER, CONSUMER) if args.disaggregated else ())
    stack = Stack(compose, args.project, profiles, yaml.safe_load(COMPOSE_FILE.read_text()))
    api_key = os.environ.get("TANDEM_API_KEY") or None
    timings: dict[str, float] = {}
    results: dict[str, Any] = {}
    try:
        if not args.no_build:
            with build_context(args) as ctx:
                for target, service in (("engine", ENGINES[0]), ("frontend", FRONTEND)):
                    t0 = time.monotonic()
                    cmd = ["docker", "build", "--target", target, "-t", stack.image(service),
                           *build_args(args), str(ctx)]
                    build_log = Path(tempfile.gettempdir()) / f"tandem-compose-check-build-{target}.log"
                    log(f"building: {shlex.join(cmd)} (output: {build_log})")
                    with open(build_log, "w") as out:
                        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
                    if rc != 0:
                        tail = build_log.read_text()[-6000:]
                        raise CheckFailed(f"docker build --target {target} exited {rc}:\n{tail}")
                    timings[f"build {target}"] = time.monotonic() - t0
                    log(f"built {stack.image(service)} in {timings[f'build {target}']:.0f} s")
        sizes = check_images(stack)
        run(stack.cmd("down", "--remove-orphans"), check_rc=False)
        t0 = time.monotonic()
        run(stack.cmd("up", "-d", "--no-build"), timeout=900)
        healthy = stack.wait_healthy(services, t0, args.healthy_timeout)
        for service, s in healthy.items():
            log(f"{service} healthy {s:.1f} s after `compose up`")
        check_non_root(stack, services)
        target = f"127.0.0.1:{stack.published(FRONTEND, 50051)}"
        http_base = f"http://127.0.0.1:{stack.published(FRONTEND, 8080)}"
        check_generate(target, api_key)
        check_openai(http_base, api_key)
        if args.disaggregated:
            results["disaggregated"] = check_disaggregated(stack, api_key, args.streams)
        n, max_tokens = calibrate(target, api_key, args.streams, max_model_len(http_base, api_key) - 64)
        log(f"{n} streams of {max_tokens} tokens each for the kill and drain checks")
        results["kill"] = check_engine_kill(stack, target, http_base, api_key, n, max_tokens)
        results["drain"] = check_drain(stack, target, api_key, n, max_tokens)
    except CheckFailed as exc:
        log(f"FAILED: {exc}")
        return 1
    finally:
        if not args.keep_up:
            run(stack.cmd("down", "--remove-orphans"), check_rc=False, timeout=300)
    kill, drain = results["kill"], results["drain"]
    log("summary:")
    log(f"  images: frontend {gb(sizes['frontend'])}, engine {gb(sizes['engine'])} "
        f"(frontend/engine {sizes['frontend'] / sizes['engine']:.0%})")
    for name, s in timings.items():
        log(f"  {name}: {s:.0f} s")
    log("  time to healthy after `compose up`: "
        + ", ".join(f"{svc} {s:.1f} s" for svc, s in healthy.items()))
    log(f"  engine kill: {kill['victim']} SIGKILLed with {kill['on_victim']} of {kill['streams']} streams "
        f"on it; {kill['completed']}/{kill['streams']} completed, {kill['migrations']:.0f} migrations; "
        f"restarted and serving again after {kill['rejoined_s']:.1f} s")
    log(f"  drain: `compose stop` with {drain['streams']} streams in flight: {drain['completed']}/"
        f"{drain['streams']} completed (the last {drain['last_stream_done_s']:.1f} s after the stop "
        f"began); stop took {drain['stop_s']:.1f} s; every container exited 0")
    if "disaggregated" in results:
        d = results["disaggregated"]
        log(f"  disaggregated: {d['streams']} streams with the default stack's tokens; the consumer "
            f"loaded {d['loads']:.0f} transfers, {d['bytes'] / 1e6:.2f} MB ({d['failed']:.0f} failed)")
    log("passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
