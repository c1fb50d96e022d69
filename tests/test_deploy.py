"""Static checks of the container stack: Dockerfile, docker-compose.yml and deploy/ configs.

No Docker engine is needed. The compose file is read with PyYAML and every ``tandem``
command in it (and the image's CMD) is parsed with the real ``tandem`` argument parser,
under that service's environment, so ports, engine addresses, model paths and metrics
ports are resolved exactly as the service would resolve them. ``docker-compose config``
runs in addition when the binary is installed; the Python checks always run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
COLLECTOR_FILE = ROOT / "deploy" / "otel-collector.yaml"
PROMETHEUS_FILE = ROOT / "deploy" / "prometheus.yml"

FRONTEND, ENGINES = "frontend", ("engine-0", "engine-1")
COLLECTOR, JAEGER, PROMETHEUS = "otel-collector", "jaeger", "prometheus"
TANDEM_SERVICES = (FRONTEND, *ENGINES)
# --metrics-port defaults (TANDEM_METRICS_PORT overrides) per subcommand.
DEFAULT_METRICS_PORT = {"frontend": 8000, "engine": 8001}
TORCH_PIN = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


# ---- loading ------------------------------------------------------------------------------


def _load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path.name}: not a mapping"
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load_yaml(COMPOSE_FILE)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def collector() -> dict[str, Any]:
    return _load_yaml(COLLECTOR_FILE)


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    return _load_yaml(PROMETHEUS_FILE)


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


def _dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in _dockerfile_instructions():
        if keyword == "ENV":
            for item in shlex.split(rest):
                key, sep, value = item.partition("=")
                assert sep, f"use ENV KEY=VALUE, got {item!r}"
                env[key] = value
    return env


def _dockerfile_cmd() -> list[str]:
    cmds = [rest for keyword, rest in _dockerfile_instructions() if keyword == "CMD"]
    assert len(cmds) == 1, "exactly one CMD"
    cmd = json.loads(cmds[0])  # exec form, so signals reach tandem
    assert isinstance(cmd, list) and all(isinstance(a, str) for a in cmd)
    return cmd


def _dockerfile_health_probe() -> tuple[str, str]:
    """(python -c source, address) of the Dockerfile's HEALTHCHECK."""
    checks = [rest for keyword, rest in _dockerfile_instructions() if keyword == "HEALTHCHECK"]
    assert len(checks) == 1, "exactly one HEALTHCHECK"
    _, _, exec_form = checks[0].partition("CMD ")
    cmd = json.loads(exec_form)
    assert cmd[:2] == ["python", "-c"] and len(cmd) == 4, cmd
    return cmd[2], cmd[3]


# ---- resolving a tandem service's settings ---------------------------------------------------


def _subcommands() -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


@contextmanager
def _service_env(env: dict[str, Any]) -> Iterator[None]:
    """os.environ as the container sees it (for TANDEM_* / OTEL_* defaults)."""
    with mock.patch.dict(os.environ):
        for key in [k for k in os.environ if k.startswith(("TANDEM_", "OTEL_"))]:
            del os.environ[key]
        os.environ.update({k: str(v) for k, v in env.items()})
        yield


def _parse_command(command: list[str], env: dict[str, Any]) -> argparse.Namespace:
    """Parse a container command with the real CLI, defaults read from ``env``."""
    assert command[0] == "tandem", f"command must run the tandem CLI: {command}"
    assert command[1] in _subcommands(), f"unknown subcommand {command[1]!r}"
    with _service_env(env):
        try:
            return build_parser().parse_args(command[1:])
        except SystemExit as exc:  # argparse rejects an unknown flag or bad value
            raise AssertionError(f"tandem rejects {command}: exit {exc.code}") from exc


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # KEY=VALUE list form
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def _args(service: dict[str, Any]) -> argparse.Namespace:
    command = service["command"]
    assert isinstance(command, list), "use the exec (list) form for command"
    return _parse_command(command, _env(service))


def _grpc_port(service: dict[str, Any]) -> int:
    return int(_args(service).port)


def _metrics_port(service: dict[str, Any]) -> int:
    args = _args(service)
    if getattr(args, "metrics_port", None) is not None:  # --metrics-port, once the flag exists
        return int(args.metrics_port)
    env = _env(service)
    if "TANDEM_METRICS_PORT" in env:
        return int(env["TANDEM_METRICS_PORT"])
    return DEFAULT_METRICS_PORT[args.command]


def _frontend_engines(service: dict[str, Any]) -> list[str]:
    """The engine addresses the frontend connects to (--engine, else TANDEM_ENGINES)."""
    args = _args(service)
    assert args.command == "frontend"
    engines = args.engines or [e for e in _env(service).get("TANDEM_ENGINES", "").split(",") if e]
    return engines


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    assert sep and host and port.isdigit(), f"not HOST:PORT: {addr!r}"
    return host, int(port)


def _exposed_ports(service: dict[str, Any]) -> set[int]:
    ports = {int(str(p).split("/")[0]) for p in service.get("expose", [])}
    for p in service.get("ports", []):
        ports.add(int(str(p).split(":")[-1].split("/")[0]))
    return ports


def _published(service: dict[str, Any]) -> dict[int, int]:
    """host port -> container port."""
    out = {}
    for p in service.get("ports", []):
        parts = str(p).split("/")[0].split(":")
        assert len(parts) >= 2, f"publish ports as HOST:CONTAINER, got {p!r}"
        out[int(parts[-2])] = int(parts[-1])
    return out


# ---- compose: topology ----------------------------------------------------------------------


def test_services_are_the_stack(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {*TANDEM_SERVICES, COLLECTOR, JAEGER, PROMETHEUS}
    images = {services[name]["image"] for name in TANDEM_SERVICES}
    assert len(images) == 1, f"frontend and engines must share one image: {images}"
    for name in TANDEM_SERVICES:
        build = services[name]["build"]
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        assert (ROOT / context / dockerfile).resolve() == DOCKERFILE
    assert services[COLLECTOR]["image"].startswith("otel/opentelemetry-collector-contrib:")
    assert services[JAEGER]["image"].startswith("jaegertracing/")
    assert services[PROMETHEUS]["image"].startswith("prom/prometheus:")


def test_images_are_pinned(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        image = service["image"]
        _, sep, tag = image.rpartition(":")
        assert sep and "/" not in tag and tag and tag != "latest", f"{name}: pin a tag, got {image!r}"


def test_every_service_restarts(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert service.get("restart") in {"always", "unless-stopped", "on-failure"}, name


def test_tandem_commands_parse(services: dict[str, dict[str, Any]]) -> None:
    assert _args(services[FRONTEND]).command == "frontend"
    indices = []
    for name in ENGINES:
        args = _args(services[name])
        assert args.command == "engine", name
        assert args.host == "0.0.0.0", f"{name} must listen on all interfaces"
        indices.append(args.engine_index)
    assert sorted(indices) == list(range(len(ENGINES))), f"engine indices {indices}"
    assert _args(services[FRONTEND]).host == "0.0.0.0"


def test_frontend_engine_addresses_name_engines(services: dict[str, dict[str, Any]]) -> None:
    addresses = _frontend_engines(services[FRONTEND])
    assert len(addresses) == len(set(addresses)) == len(ENGINES), addresses
    seen = set()
    for addr in addresses:
        host, port = _split_addr(addr)
        assert host in services, f"{addr}: no service {host!r}"
        assert _args(services[host]).command == "engine", f"{addr}: {host} is not an engine"
        assert port == _grpc_port(services[host]), f"{addr}: {host} listens on {_grpc_port(services[host])}"
        assert port in _exposed_ports(services[host]), f"{addr}: {host} does not expose {port}"
        seen.add(host)
    assert seen == set(ENGINES)


def test_one_model_for_all(services: dict[str, dict[str, Any]]) -> None:
    """Engines and frontend load the same checkpoint (same tokenizer fingerprint)."""
    models = {_args(services[name]).model for name in TANDEM_SERVICES}
    assert len(models) == 1 and "" not in models, f"one explicit model for all: {models}"
    (model,) = models
    assert model == _dockerfile_env()["TANDEM_MODEL"]
    made = [
        shlex.split(rest) for keyword, rest in _dockerfile_instructions()
        if keyword == "RUN" and "make-model" in rest
    ]
    assert made, "the image makes the demo model at build time"
    argv = made[0][made[0].index("make-model") - 1:]
    assert argv[0] == "tandem"
    args = _parse_command(argv, {})
    assert args.out == model and args.preset == "demo"


def test_frontend_waits_for_healthy_engines(services: dict[str, dict[str, Any]]) -> None:
    depends = services[FRONTEND]["depends_on"]
    for name in ENGINES:
        assert depends[name]["condition"] == "service_healthy", name
    for name, service in services.items():
        deps = service.get("depends_on", {})
        deps = {d: {"condition": "service_started"} for d in deps} if isinstance(deps, list) else deps
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}, which has no healthcheck"


def test_healthchecks_probe_each_service_port(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    probe, dockerfile_addr = _dockerfile_health_probe()
    assert compose["x-grpc-health-probe"] == probe, "compose and Dockerfile probes differ"
    assert _split_addr(dockerfile_addr)[1] == int(_parse_command(_dockerfile_cmd(), {}).port)
    for name in TANDEM_SERVICES:
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-c", probe], name
        host, port = _split_addr(test[4])
        assert host in {"127.0.0.1", "localhost"}, name
        assert port == _grpc_port(services[name]), f"{name}: probes {port}"


def _run_probe(probe: str, addr: str) -> int:
    return subprocess.run([sys.executable, "-c", probe, addr], timeout=30, capture_output=True).returncode


def test_health_probe_reports_serving_only() -> None:
    """The probe, run for real against a grpc.health.v1 server: 0 only when SERVING."""
    probe, _ = _dockerfile_health_probe()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        addr = f"127.0.0.1:{port}"
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _run_probe(probe, addr) == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert _run_probe(probe, addr) == 0
    finally:
        server.stop(0)
    assert _run_probe(probe, addr) != 0  # nothing listening


def test_only_public_ports_are_published(services: dict[str, dict[str, Any]]) -> None:
    published = {name: _published(s) for name, s in services.items() if s.get("ports")}
    assert set(published) == {FRONTEND, JAEGER, PROMETHEUS}, published
    assert published[FRONTEND] == {50051: _grpc_port(services[FRONTEND])}
    assert published[JAEGER] == {16686: 16686}
    assert published[PROMETHEUS] == {9090: 9090}


# ---- tracing --------------------------------------------------------------------------------


def _collector_grpc_port(collector: dict[str, Any]) -> int:
    endpoint = collector["receivers"]["otlp"]["protocols"]["grpc"].get("endpoint", "0.0.0.0:4317")
    return _split_addr(endpoint)[1]


def test_services_export_traces_to_the_collector(
    services: dict[str, dict[str, Any]], collector: dict[str, Any]
) -> None:
    names = {FRONTEND: "tandem-frontend", **dict.fromkeys(ENGINES, "tandem-engine")}
    for name, service_name in names.items():
        env = _env(services[name])
        endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert endpoint.scheme == "http", f"{name}: plaintext OTLP inside the compose network"
        assert endpoint.hostname == COLLECTOR, name
        assert endpoint.port == _collector_grpc_port(collector), name
        assert endpoint.port in _exposed_ports(services[COLLECTOR])
        assert env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") == "grpc"
        assert env["OTEL_SERVICE_NAME"] == service_name, name
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_always_on", name
        assert env.get("OTEL_TRACES_EXPORTER", "otlp") == "otlp", name


def test_collector_config_is_consistent(collector: dict[str, Any]) -> None:
    svc = collector["service"]
    pipelines = svc["pipelines"]
    assert "traces" in pipelines
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for pname, pipeline in pipelines.items():
        assert pipeline.get("receivers") and pipeline.get("exporters"), pname
        for kind, names in used.items():
            for comp in pipeline.get(kind, []):
                assert comp in (collector.get(kind) or {}), f"pipeline {pname}: {kind[:-1]} {comp} undefined"
                names.add(comp)
    for kind, names in used.items():
        assert set(collector.get(kind) or {}) == names, f"{kind} defined but unused"
    for ext in svc.get("extensions", []):
        assert ext in (collector.get("extensions") or {}), f"extension {ext} undefined"
    traces = pipelines["traces"]
    assert "otlp" in traces["receivers"]
    assert "debug" in traces["exporters"]


def test_collector_exports_to_jaeger(
    services: dict[str, dict[str, Any]], collector: dict[str, Any]
) -> None:
    otlp_exporters = [
        e for e in collector["service"]["pipelines"]["traces"]["exporters"]
        if e.split("/")[0] in {"otlp", "otlp_grpc"}
    ]
    assert otlp_exporters, "traces pipeline has no OTLP/gRPC exporter"
    for name in otlp_exporters:
        conf = collector["exporters"][name]
        endpoint = conf["endpoint"]
        host, port = _split_addr(endpoint.split("://")[-1])
        assert host == JAEGER and port == 4317, f"{name} -> {endpoint}"
        assert port in _exposed_ports(services[JAEGER])
        assert conf.get("tls", {}).get("insecure") is True, "Jaeger's OTLP port is plaintext"


def test_collector_mounts_its_config(services: dict[str, dict[str, Any]]) -> None:
    _assert_mounted(services[COLLECTOR], COLLECTOR_FILE, "--config=")


def _assert_mounted(service: dict[str, Any], host_file: Path, flag: str) -> None:
    (config_arg,) = [a for a in service["command"] if a.startswith(flag)]
    container_path = config_arg[len(flag):]
    mounts = {}
    for volume in service["volumes"]:
        src, dst, *_ = str(volume).split(":")
        mounts[dst] = (ROOT / src).resolve()
    assert mounts.get(container_path) == host_file, f"{container_path} is not {host_file}"


# ---- metrics --------------------------------------------------------------------------------


def test_prometheus_scrapes_every_tandem_service(
    services: dict[str, dict[str, Any]], prometheus: dict[str, Any]
) -> None:
    scraped = set()
    for job in prometheus["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        assert job.get("scheme", "http") == "http", job["job_name"]
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = _split_addr(target)
                assert host in TANDEM_SERVICES, f"{target}: not a tandem service"
                assert port == _metrics_port(services[host]), f"{target}: metrics are on {_metrics_port(services[host])}"
                assert port in _exposed_ports(services[host]), f"{target}: {host} does not expose {port}"
                assert port != _grpc_port(services[host])
                scraped.add(host)
    assert scraped == set(TANDEM_SERVICES)
    _assert_mounted(services[PROMETHEUS], PROMETHEUS_FILE, "--config.file=")


# ---- Dockerfile -----------------------------------------------------------------------------


def test_dockerfile_installs_cpu_torch_before_the_project() -> None:
    instructions = _dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    torch_at = [i for i, r in enumerate(runs) if TORCH_PIN in r.split()]
    project_at = [i for i, r in enumerate(runs) if "pip install ." in r]
    assert torch_at and project_at, "RUN pip install torch==2.13.0 ... and RUN pip install ."
    assert torch_at[0] < project_at[0], "torch must be installed before the project"
    torch_cmd = shlex.split(runs[torch_at[0]])
    assert torch_cmd[torch_cmd.index("--index-url") + 1] == TORCH_CPU_INDEX
    assert not any("pip install -e" in r or "--editable" in r for r in runs)


def test_dockerfile_copies_what_exists_and_runs_unprivileged() -> None:
    instructions = _dockerfile_instructions()
    for keyword, rest in instructions:
        if keyword == "COPY" and not rest.startswith("--from"):
            for src in shlex.split(rest)[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: missing"
                assert not _dockerignored(src), f"COPY {src}: excluded by .dockerignore"
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1] not in {"root", "0"}, "run as a non-root user"
    cmd_at = max(i for i, (k, _) in enumerate(instructions) if k == "CMD")
    user_at = max(i for i, (k, _) in enumerate(instructions) if k == "USER")
    assert user_at < cmd_at


def _dockerignored(src: str) -> bool:
    ignored = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return src.rstrip("/") in ignored


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "node_modules"} <= ignored


def test_dockerfile_cmd_is_a_tandem_command() -> None:
    cmd = _dockerfile_cmd()
    assert cmd[0] == "tandem" and cmd[1] in _subcommands(), cmd
    args = _parse_command(cmd, {})
    assert args.host == "0.0.0.0", "the image's service must be reachable from outside"


# ---- docker-compose itself ------------------------------------------------------------------


def test_docker_compose_config_validates() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (apt-get install -y docker-compose)")
    proc = subprocess.run(
        [binary, "-f", str(COMPOSE_FILE), "config", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
