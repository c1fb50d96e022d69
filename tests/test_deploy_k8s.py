"""Static checks of deploy/k8s (kustomize): schemas, and that the pieces fit together.

Every manifest is validated offline against the Kubernetes OpenAPI schemas shipped by
``kubernetes-validate`` (strict: unknown fields fail), for the oldest supported release
and the newest the package knows. Then consistency, as tests/test_deploy.py does for
compose: Services, StatefulSet, Deployment, PodDisruptionBudgets, HPA and NetworkPolicies
agree on names, labels, selectors and ports; probes hit the health port with the agreed
grpc.health.v1 service names; each container's command is parsed with the real ``tandem``
parser under the container's environment (Secrets and downward-API values filled with
placeholders), and every ``TANDEM_*`` variable must feed a real flag.
"""

from __future__ import annotations

import copy
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy_helpers import (
    ROOT,
    chain_env,
    dockerfile_stages,
    env_flag_problems,
    load_yaml,
    parse_command,
)

K8S = ROOT / "deploy" / "k8s"
README = ROOT / "deploy" / "README.md"
# Oldest release the manifests target (preStop `sleep`, the pod-index label), and the newest.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CLUSTER_DOMAIN = "svc.cluster.local"
NAMESPACED = {"ConfigMap", "Service", "StatefulSet", "Deployment", "PodDisruptionBudget",
              "HorizontalPodAutoscaler", "NetworkPolicy"}
DEFAULT_DRAIN_TIMEOUT = 30.0  # --drain-timeout's default (common.md)
COMPONENTS = {"engine": "StatefulSet", "frontend": "Deployment"}

Manifest = dict[str, Any]


# ---- loading ------------------------------------------------------------------------------


def _docs(path: Path) -> list[Manifest]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def kustomization() -> Manifest:
    return load_yaml(K8S / "kustomization.yaml")


@pytest.fixture(scope="module")
def namespace(kustomization: Manifest) -> str:
    return kustomization["namespace"]


@pytest.fixture(scope="module")
def manifests(kustomization: Manifest, namespace: str) -> list[Manifest]:
    """What `kubectl kustomize deploy/k8s` renders: the resources, namespaced, labelled."""
    allowed = {"apiVersion", "kind", "namespace", "labels", "resources"}
    assert set(kustomization) <= allowed, f"unchecked kustomize features: {set(kustomization) - allowed}"
    out = []
    for resource in kustomization["resources"]:
        for doc in _docs(K8S / resource):
            doc = copy.deepcopy(doc)
            if doc["kind"] in NAMESPACED:
                doc["metadata"]["namespace"] = namespace
            for entry in kustomization.get("labels", []):
                doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
            out.append(doc)
    return out


def _one(manifests: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = [m for m in manifests if m["kind"] == kind and name in (None, m["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def _workload(manifests: list[Manifest], component: str) -> Manifest:
    (found,) = [
        m for m in manifests if m["kind"] == COMPONENTS[component]
        and m["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    return found


def _pod_labels(workload: Manifest) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def _container(workload: Manifest) -> Manifest:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _ports(container: Manifest) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(match_labels) and all(labels.get(k) == v for k, v in match_labels.items())


def _cpu_cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _container_env(workload: Manifest, manifests: list[Manifest]) -> dict[str, str]:
    """The container's environment, with placeholders for what only the cluster knows."""
    container = _container(workload)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(_one(manifests, "ConfigMap", source["configMapRef"]["name"])["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item["valueFrom"]
        if "secretKeyRef" in ref:
            env[item["name"]] = f"secret-{ref['secretKeyRef']['name']}-{ref['secretKeyRef']['key']}"
        elif "resourceFieldRef" in ref:
            assert ref["resourceFieldRef"]["resource"] == "limits.cpu", ref
            env[item["name"]] = str(math.ceil(_cpu_cores(container["resources"]["limits"]["cpu"])))
        elif ref["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']":
            assert workload["kind"] == "StatefulSet", "only StatefulSet pods carry pod-index"
            env[item["name"]] = "0"
        else:
            env[item["name"]] = f"field-{ref['fieldRef']['fieldPath']}"
    return env


def _args(workload: Manifest, manifests: list[Manifest]) -> Any:
    return parse_command(_container(workload)["command"], _container_env(workload, manifests))


# ---- schemas and kustomize ------------------------------------------------------------------


def _all_manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_schemas(version: str) -> None:
    files = _all_manifest_files()
    assert len(files) >= 8
    for path in files:
        for doc in _docs(path):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{path.relative_to(ROOT)} {doc['kind']}: {exc.message}") from exc


def test_schema_validation_catches_mistakes(manifests: list[Manifest]) -> None:
    """The offline validator rejects a misspelt field and a wrong type."""
    broken = copy.deepcopy(_workload(manifests, "engine"))
    _container(broken)["readinesProbe"] = _container(broken).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)
    broken = copy.deepcopy(_workload(manifests, "frontend"))
    _container(broken)["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_kustomization_lists_every_manifest(kustomization: Manifest, manifests: list[Manifest]) -> None:
    listed = {(K8S / r).resolve() for r in kustomization["resources"]}
    optional = {p.resolve() for p in (K8S / "optional").glob("*.yaml")}
    assert listed | optional == {p.resolve() for p in _all_manifest_files()}
    keys = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    assert len(keys) == len(set(keys)), f"duplicate objects: {keys}"
    assert _one(manifests, "Namespace")["metadata"]["name"] == kustomization["namespace"]
    kubectl = shutil.which("kubectl")
    if kubectl is not None:  # the real kustomize, where installed: renders the same objects
        built = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stderr
        rendered = [d for d in yaml.safe_load_all(built.stdout) if d]
        assert sorted(rendered, key=str) == sorted(manifests, key=str)


# ---- workloads ------------------------------------------------------------------------------


@pytest.mark.parametrize("component", COMPONENTS)
def test_workload_selects_its_pods_and_has_its_objects(component: str, manifests: list[Manifest]) -> None:
    workload = _workload(manifests, component)
    labels = _pod_labels(workload)
    assert _selects(workload["spec"]["selector"]["matchLabels"], labels)
    other = _pod_labels(_workload(manifests, "frontend" if component == "engine" else "engine"))
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        selecting = [m for m in manifests if m["kind"] == kind and _selects(
            m["spec"]["selector"]["matchLabels"] if kind == "PodDisruptionBudget"
            else m["spec"]["podSelector"]["matchLabels"], labels)]
        assert len(selecting) == 1, f"{component}: {len(selecting)} {kind}"
        selector = selecting[0]["spec"].get("selector") or selecting[0]["spec"]["podSelector"]
        assert not _selects(selector["matchLabels"], other), f"{kind} also selects the other pods"


@pytest.mark.parametrize("component", COMPONENTS)
def test_container_ports_are_the_commands_ports(component: str, manifests: list[Manifest]) -> None:
    workload = _workload(manifests, component)
    container, args = _container(workload), _args(workload, manifests)
    assert args.command == component and args.host == "0.0.0.0"
    ports = _ports(container)
    http = {"http"} if component == "frontend" else set()  # the OpenAI-compatible API
    assert set(ports) == {"grpc", "health", "metrics", *http}, ports
    assert ports["grpc"] == args.port
    if http:
        assert ports["http"] == args.http_port
    assert ports["metrics"] == args.metrics_port
    env = _container_env(workload, manifests)
    assert ports["health"] == int(env["TANDEM_HEALTH_PORT"]) != ports["grpc"]
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]


@pytest.mark.parametrize("component", COMPONENTS)
def test_probes_use_grpc_health_on_the_health_port(component: str, manifests: list[Manifest]) -> None:
    """Native gRPC probes (the kubelet cannot do TLS: hence the plaintext health port)."""
    container = _container(_workload(manifests, component))
    health_port = _ports(container)["health"]
    wanted = {"startupProbe": "liveness", "livenessProbe": "liveness", "readinessProbe": "readiness"}
    for probe, service in wanted.items():
        assert container[probe]["grpc"] == {"port": health_port, "service": service}, f"{component} {probe}"


@pytest.mark.parametrize("component", COMPONENTS)
def test_grace_period_outlasts_the_drain(component: str, manifests: list[Manifest]) -> None:
    workload = _workload(manifests, component)
    env = _container_env(workload, manifests)
    drain = float(env.get("TANDEM_DRAIN_TIMEOUT", DEFAULT_DRAIN_TIMEOUT))
    pre_stop = _container(workload).get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + drain, f"{component}: {grace}s <= preStop {pre_stop}s + drain {drain}s"


@pytest.mark.parametrize("component", COMPONENTS)
def test_tandem_environment_feeds_real_flags(component: str, manifests: list[Manifest]) -> None:
    workload = _workload(manifests, component)
    problems = env_flag_problems(_container(workload)["command"], _container_env(workload, manifests))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("component", COMPONENTS)
def test_pods_run_unprivileged_with_resources(component: str, manifests: list[Manifest]) -> None:
    workload = _workload(manifests, component)
    pod = workload["spec"]["template"]["spec"]
    useradd = [r for r in dockerfile_stages()["base"].args("RUN") if "useradd" in r]
    image_uid = int(useradd[0].split("--uid")[1].split()[0])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == image_uid
    assert pod["automountServiceAccountToken"] is False
    container = _container(workload)
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]


def test_images_and_model_match_the_dockerfile_targets(manifests: list[Manifest]) -> None:
    compose = load_yaml(ROOT / "docker-compose.yml")["services"]
    stages = dockerfile_stages()
    for component, compose_name in (("engine", "engine-0"), ("frontend", "frontend")):
        workload = _workload(manifests, component)
        assert _container(workload)["image"] == compose[compose_name]["image"], component
        assert compose[compose_name]["build"]["target"] == component
        assert _args(workload, manifests).model == chain_env(stages, component)["TANDEM_MODEL"]


def test_engines_get_their_ordinal_as_index(manifests: list[Manifest]) -> None:
    engine = _workload(manifests, "engine")
    (index,) = [e for e in _container(engine)["env"] if e["name"] == "TANDEM_ENGINE_INDEX"]
    assert index["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert "--engine-index" not in _container(engine)["command"]


# ---- services and discovery -----------------------------------------------------------------


def _service_for(manifests: list[Manifest], component: str) -> Manifest:
    labels = _pod_labels(_workload(manifests, component))
    (service,) = [m for m in manifests if m["kind"] == "Service" and _selects(m["spec"]["selector"], labels)]
    return service


@pytest.mark.parametrize("component", COMPONENTS)
def test_services_target_the_containers_ports(component: str, manifests: list[Manifest]) -> None:
    ports = _ports(_container(_workload(manifests, component)))
    service = _service_for(manifests, component)
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports, f"{service['metadata']['name']}: no container port {port['targetPort']}"
        # Same number outside and in: a headless Service's DNS answer is the pods' addresses.
        assert port["port"] == ports[port["targetPort"]], port
    assert "health" not in {p["targetPort"] for p in service["spec"]["ports"]}


def test_frontend_resolves_the_headless_engine_service(manifests: list[Manifest], namespace: str) -> None:
    engine = _workload(manifests, "engine")
    headless = _service_for(manifests, "engine")
    assert headless["spec"]["clusterIP"] == "None"
    assert engine["spec"]["serviceName"] == headless["metadata"]["name"]
    assert not headless["spec"].get("publishNotReadyAddresses", False), "draining engines must leave DNS"
    engines = _args(_workload(manifests, "frontend"), manifests).engines
    assert engines == [
        f"dns:///{headless['metadata']['name']}.{namespace}.{CLUSTER_DOMAIN}:{_args(engine, manifests).port}"
    ]


# ---- TLS, tokens, telemetry -----------------------------------------------------------------


def _secret_files(workload: Manifest) -> dict[str, tuple[str, str]]:
    """Mounted file path -> (Secret name, key), for the default secret key projection."""
    pod = workload["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    out = {}
    for mount in _container(workload)["volumeMounts"]:
        if mount["name"] in secrets:
            assert mount.get("readOnly") is True, mount
            for key in ("tls.crt", "tls.key", "ca.crt"):
                out[f"{mount['mountPath']}/{key}"] = (secrets[mount["name"]], key)
    return out


TLS_ENV = {
    "engine": ("TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CA"),
    "frontend": ("TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_ENGINE_TLS_CA",
                 "TANDEM_ENGINE_TLS_CERT", "TANDEM_ENGINE_TLS_KEY"),
}


@pytest.mark.parametrize("component", COMPONENTS)
def test_tls_files_come_from_secrets(component: str, manifests: list[Manifest]) -> None:
    workload = _workload(manifests, component)
    env, files = _container_env(workload, manifests), _secret_files(workload)
    readme = README.read_text()
    for name in TLS_ENV[component]:
        assert env[name] in files, f"{component}: {name}={env[name]} is not a mounted Secret file"
        secret, key = files[env[name]]
        assert f"secret generic {secret}" in readme or f"secret tls {secret}" in readme, \
            f"deploy/README.md does not say how to create {secret}"
        assert key in readme
    # The engine's server certificate and the frontend's client certificate share a CA.
    engine_env = _container_env(_workload(manifests, "engine"), manifests)
    assert engine_env["TANDEM_TLS_CA"].endswith("ca.crt") and env.get("TANDEM_TLS_CA") in (None, engine_env["TANDEM_TLS_CA"])


def test_tokens_come_from_one_secret(manifests: list[Manifest]) -> None:
    readme = README.read_text()
    refs = {}
    for component in COMPONENTS:
        for item in _container(_workload(manifests, component))["env"]:
            if item["name"] in {"TANDEM_ENGINE_TOKEN", "TANDEM_ADMIN_TOKEN"}:
                assert "value" not in item, f"{component}: {item['name']} must come from a Secret"
                ref = item["valueFrom"]["secretKeyRef"]
                refs.setdefault(item["name"], set()).add((ref["name"], ref["key"]))
    assert set(refs) == {"TANDEM_ENGINE_TOKEN", "TANDEM_ADMIN_TOKEN"}
    for name, found in refs.items():
        assert len(found) == 1, f"{name}: frontends and engines must read the same Secret key: {found}"
        ((secret, key),) = found
        assert f"secret generic {secret}" in readme and f"--from-literal={key}=" in readme, name


@pytest.mark.parametrize("component", COMPONENTS)
def test_telemetry_as_in_compose(component: str, manifests: list[Manifest]) -> None:
    compose = load_yaml(ROOT / "docker-compose.yml")
    compose_env = {k: str(v) for k, v in compose["x-otel-env"].items()}
    env = _container_env(_workload(manifests, component), manifests)
    for key, value in compose_env.items():
        if key != "OTEL_EXPORTER_OTLP_ENDPOINT":  # the collector's address differs
            assert env[key] == value, f"{component}: {key}"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://")
    assert env["OTEL_SERVICE_NAME"] == f"tandem-{component}"


# ---- disruption, scaling, network -----------------------------------------------------------


def test_disruption_budgets_leave_pods_serving(manifests: list[Manifest]) -> None:
    for component in COMPONENTS:
        workload = _workload(manifests, component)
        (pdb,) = [m for m in manifests if m["kind"] == "PodDisruptionBudget"
                  and _selects(m["spec"]["selector"]["matchLabels"], _pod_labels(workload))]
        assert pdb["spec"]["maxUnavailable"] < workload["spec"]["replicas"], component


def test_hpas_scale_existing_workloads_on_requested_cpu(manifests: list[Manifest]) -> None:
    optional = [d for p in sorted((K8S / "optional").glob("*.yaml")) for d in _docs(p)]
    hpas = [m for m in [*manifests, *optional] if m["kind"] == "HorizontalPodAutoscaler"]
    scaled = set()
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        target = _one(manifests, ref["kind"], ref["name"])
        assert ref["apiVersion"] == target["apiVersion"]
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        for metric in hpa["spec"]["metrics"]:
            resource = metric["resource"]["name"]
            assert resource in _container(target)["resources"]["requests"], "Utilization needs a request"
        scaled.add(target["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])
    assert "frontend" in scaled
    in_base = {m["spec"]["scaleTargetRef"]["name"] for m in manifests if m["kind"] == "HorizontalPodAutoscaler"}
    assert _workload(manifests, "frontend")["metadata"]["name"] in in_base


def _policy_for(manifests: list[Manifest], component: str) -> Manifest:
    labels = _pod_labels(_workload(manifests, component))
    (policy,) = [m for m in manifests if m["kind"] == "NetworkPolicy"
                 and _selects(m["spec"]["podSelector"]["matchLabels"], labels)]
    return policy


def _rules_for_port(policy: Manifest, port: str) -> list[Manifest]:
    return [r for r in policy["spec"]["ingress"] if any(p["port"] == port for p in r["ports"])]


def test_only_frontends_reach_the_engines(manifests: list[Manifest]) -> None:
    policy = _policy_for(manifests, "engine")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    engine_ports = _ports(_container(_workload(manifests, "engine")))
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "an engine rule without `from` opens it to everyone"
        for port in rule["ports"]:
            assert port["port"] in engine_ports and port["protocol"] == "TCP", port
    (grpc_rule,) = _rules_for_port(policy, "grpc")
    frontend_labels = _pod_labels(_workload(manifests, "frontend"))
    for peer in grpc_rule["from"]:
        assert set(peer) == {"podSelector"}, f"frontends of this namespace only: {peer}"
        assert peer["podSelector"]["matchLabels"] == frontend_labels
    (metrics_rule,) = _rules_for_port(policy, "metrics")
    assert all(p["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
               for p in metrics_rule["from"])


def test_clients_reach_the_frontends(manifests: list[Manifest]) -> None:
    policy = _policy_for(manifests, "frontend")
    frontend_ports = _ports(_container(_workload(manifests, "frontend")))
    (grpc_rule,) = _rules_for_port(policy, "grpc")
    assert "from" not in grpc_rule, "clients come from anywhere"
    (http_rule,) = _rules_for_port(policy, "http")
    assert "from" not in http_rule, "clients come from anywhere"
    (metrics_rule,) = _rules_for_port(policy, "metrics")
    assert metrics_rule["from"]
    for rule in policy["spec"]["ingress"]:
        assert all(p["port"] in frontend_ports for p in rule["ports"])


# ---- optional: SMG as a second front door ----------------------------------------------------


def test_optional_smg_reaches_every_engine_replica(manifests: list[Manifest], namespace: str) -> None:
    """deploy/k8s/optional/smg.yaml: one worker URL per engine replica, by the StatefulSet
    pods' stable names under the headless Service, on the engines' gRPC port; its network
    policy lets exactly the SMG pods into that port; it mounts the frontends' client cert."""
    docs = _docs(K8S / "optional" / "smg.yaml")
    deployment = _one(docs, "Deployment", "tandem-smg")
    engine = _workload(manifests, "engine")
    headless = _service_for(manifests, "engine")
    argv = _container(deployment)["command"]
    assert argv[:2] == ["smg", "launch"] and argv[argv.index("--backend") + 1] == "vllm"
    urls = argv[argv.index("--worker-urls") + 1 :]
    port = _args(engine, manifests).port
    host = f"{headless['metadata']['name']}.{namespace}.{CLUSTER_DOMAIN}"
    assert urls == [
        f"grpc://{engine['metadata']['name']}-{i}.{host}:{port}" for i in range(engine["spec"]["replicas"])
    ]
    policy = _one(docs, "NetworkPolicy")
    assert _selects(policy["spec"]["podSelector"]["matchLabels"], _pod_labels(engine))
    (rule,) = policy["spec"]["ingress"]
    assert _selects(rule["from"][0]["podSelector"]["matchLabels"], _pod_labels(deployment))
    assert [p["port"] for p in rule["ports"]] == ["grpc"]
    frontend_secrets = set(_secret_files(_workload(manifests, "frontend")).values())
    smg_secrets = set(_secret_files(deployment).values())
    assert smg_secrets and smg_secrets <= frontend_secrets
