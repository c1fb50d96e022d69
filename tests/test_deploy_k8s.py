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
import re
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
    split_addr,
)

K8S = ROOT / "deploy" / "k8s"
# The optional disaggregated prefill/decode overlay (kustomize: `resources: [../k8s]`, beside
# the base because kustomize refuses an overlay inside its base's directory).
K8S_DISAGG = ROOT / "deploy" / "k8s-disaggregated"
# The optional GPU overlay: the engines on NVIDIA GPUs (the CUDA image, nvidia.com/gpu).
K8S_GPU = ROOT / "deploy" / "k8s-gpu"
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


def _render(root: Path) -> list[Manifest]:
    """What `kubectl kustomize ROOT` renders, for the kustomize features used here (others
    fail the assertion): resources (files, or directories with their own kustomization),
    namespace, metadata labels, JSON 6902 patches that add, and image overrides."""
    kustomization = load_yaml(root / "kustomization.yaml")
    allowed = {"apiVersion", "kind", "namespace", "labels", "resources", "patches", "images"}
    assert set(kustomization) <= allowed, f"unchecked kustomize features: {set(kustomization) - allowed}"
    out = []
    for resource in kustomization["resources"]:
        path = root / resource
        for doc in _render(path) if path.is_dir() else _docs(path):
            doc = copy.deepcopy(doc)
            if doc["kind"] in NAMESPACED and "namespace" in kustomization:
                doc["metadata"]["namespace"] = kustomization["namespace"]
            for entry in kustomization.get("labels", []):
                assert entry.get("includeSelectors") is False and set(entry) == {"pairs", "includeSelectors"}
                doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
            out.append(doc)
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"target", "patch"} and set(patch["target"]) == {"kind", "name"}, patch
        target = _one(out, patch["target"]["kind"], patch["target"]["name"])
        for op in yaml.safe_load(patch["patch"]):
            _json_patch_add(target, op)
    for image in kustomization.get("images", []):
        assert set(image) <= {"name", "newName", "newTag"} and "name" in image, image
        for doc in out:
            _set_image(doc, image)
    return out


def _set_image(doc: Manifest, override: dict[str, str]) -> None:
    """kustomize's `images:` entry: every container whose image is ``name`` (with any tag)
    gets ``newName`` and/or ``newTag``."""
    pod = doc.get("spec", {}).get("template", {}).get("spec", {})
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        name, _, tag = container["image"].partition(":")
        if name == override["name"]:
            container["image"] = f"{override.get('newName', name)}:{override.get('newTag', tag)}"


def _json_patch_add(doc: Any, op: dict[str, Any]) -> None:
    """RFC 6902 `add` (the only operation used): ``/a/b~1c/-`` appends to a list."""
    assert op["op"] == "add" and set(op) == {"op", "path", "value"}, op
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    for part in parents:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    if isinstance(doc, list):
        doc.insert(len(doc) if last == "-" else int(last), copy.deepcopy(op["value"]))
    else:
        doc[last] = copy.deepcopy(op["value"])


@pytest.fixture(scope="module")
def manifests() -> list[Manifest]:
    """What `kubectl kustomize deploy/k8s` renders: the resources, namespaced, labelled."""
    return _render(K8S)


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


# ---- optional: disaggregated prefill and decode (deploy/k8s-disaggregated) -------------------

KV_ROLE_LABEL = "tandem/kv-role"  # pod label: which engines the producers' policy admits
PRODUCERS = "tandem-engine-prefill"  # the overlay's producer StatefulSet
CONSUMERS = "tandem-engine"  # the base engines, turned consumers
# The objects the overlay adds to the base.
DISAGG_NEW = {("StatefulSet", PRODUCERS), ("Service", f"{PRODUCERS}-headless"),
              ("PodDisruptionBudget", PRODUCERS), ("NetworkPolicy", PRODUCERS)}
KV_ENV = ("TANDEM_KV_ROLE", "TANDEM_KV_ENGINE_ID", "TANDEM_KV_ADDRESS")


@pytest.fixture(scope="module")
def disagg() -> list[Manifest]:
    """What `kubectl kustomize deploy/k8s-disaggregated` renders."""
    return _render(K8S_DISAGG)


@pytest.fixture(scope="module")
def disagg_namespace() -> str:
    return load_yaml(K8S_DISAGG / "kustomization.yaml")["namespace"]


def _without_kv(workload: Manifest) -> Manifest:
    """The workload without its KV role: the kv-role pod label and TANDEM_KV_* variables."""
    out = copy.deepcopy(workload)
    out["spec"]["template"]["metadata"]["labels"].pop(KV_ROLE_LABEL, None)
    container = _container(out)
    container["env"] = [e for e in container["env"] if e["name"] not in KV_ENV]
    return out


def _pod_env(workload: Manifest, manifests: list[Manifest], ordinal: int) -> dict[str, str]:
    """The environment of the StatefulSet's pod ``ordinal``: its name and index filled in,
    and `$(VAR)` references expanded as the kubelet does (variables defined earlier only)."""
    env = _container_env(workload, manifests)
    defined = set(env) - {e["name"] for e in _container(workload)["env"]}  # from envFrom
    for item in _container(workload)["env"]:
        name = item["name"]
        field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field == "metadata.name":
            env[name] = f"{workload['metadata']['name']}-{ordinal}"
        elif field == "metadata.labels['apps.kubernetes.io/pod-index']":
            env[name] = str(ordinal)
        elif "value" in item:
            env[name] = re.sub(r"\$\((\w+)\)", lambda m: env[m[1]] if m[1] in defined else m[0], item["value"])
        defined.add(name)
    return env


def _headless_for(manifests: list[Manifest], workload: Manifest) -> Manifest:
    """The headless Service that is the StatefulSet's serviceName and selects its pods."""
    service = _one(manifests, "Service", workload["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", service["metadata"]["name"]
    assert _selects(service["spec"]["selector"], _pod_labels(workload))
    assert not service["spec"].get("publishNotReadyAddresses", False), "draining engines must leave DNS"
    return service


def _admits(manifests: list[Manifest], target: Manifest, source: Manifest, port: str) -> bool:
    """Whether some NetworkPolicy lets ``source``'s pods (same namespace) into ``target``'s
    pods on the named container port (network policies add up: one rule is enough)."""
    for policy in manifests:
        if policy["kind"] != "NetworkPolicy" or "Ingress" not in policy["spec"]["policyTypes"]:
            continue
        if not _selects(policy["spec"]["podSelector"]["matchLabels"], _pod_labels(target)):
            continue
        for rule in policy["spec"].get("ingress", []):
            ports_ok = not rule.get("ports") or any(p["port"] == port for p in rule["ports"])
            peers_ok = "from" not in rule or any(
                "podSelector" in peer and "namespaceSelector" not in peer
                and _selects(peer["podSelector"]["matchLabels"], _pod_labels(source))
                for peer in rule["from"]
            )
            if ports_ok and peers_ok:
                return True
    return False


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_disaggregated_overlay_validates_against_the_schemas(version: str, disagg: list[Manifest]) -> None:
    listed = {(K8S_DISAGG / r).resolve() for r in load_yaml(K8S_DISAGG / "kustomization.yaml")["resources"]}
    files = {p.resolve() for p in K8S_DISAGG.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert files and files <= listed, f"not in the overlay's kustomization: {files - listed}"
    for doc in disagg:  # rendered: the patched base objects are checked too
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{doc['kind']} {doc['metadata']['name']}: {exc.message}") from exc


def test_disaggregated_overlay_renders_as_kustomize_does(disagg: list[Manifest]) -> None:
    keys = [(m["kind"], m["metadata"]["name"]) for m in disagg]
    assert len(keys) == len(set(keys)), f"duplicate objects: {keys}"
    kubectl = shutil.which("kubectl")
    if kubectl is not None:  # the real kustomize, where installed: renders the same objects
        built = subprocess.run([kubectl, "kustomize", str(K8S_DISAGG)], capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stderr
        rendered = [d for d in yaml.safe_load_all(built.stdout) if d]
        assert sorted(rendered, key=str) == sorted(disagg, key=str)


def test_disaggregated_overlay_is_the_base_plus_the_layout(
    manifests: list[Manifest], disagg: list[Manifest]
) -> None:
    """Every base object is there, unchanged but for the engines' KV role and the frontends'
    extra flags; what is new is the producers' StatefulSet, headless Service, PDB and policy,
    each selecting the producers only."""
    base = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    overlay = {(m["kind"], m["metadata"]["name"]): m for m in disagg}
    assert set(overlay) - set(base) == DISAGG_NEW and set(base) <= set(overlay)
    changed = {key for key in base if overlay[key] != base[key]}
    assert changed == {("StatefulSet", CONSUMERS), ("Deployment", "tandem-frontend")}, changed
    assert _without_kv(overlay["StatefulSet", CONSUMERS]) == base["StatefulSet", CONSUMERS]
    frontend = copy.deepcopy(overlay["Deployment", "tandem-frontend"])
    base_command = _container(base["Deployment", "tandem-frontend"])["command"]
    extra = _container(frontend)["command"][len(base_command):]
    _container(frontend)["command"] = _container(frontend)["command"][: len(base_command)]
    assert frontend == base["Deployment", "tandem-frontend"]
    assert extra[0] == "--engine" and extra[2:] == ["--disaggregated"], extra
    producers = overlay["StatefulSet", PRODUCERS]
    consumers = overlay["StatefulSet", CONSUMERS]
    for kind, name in DISAGG_NEW - {("StatefulSet", PRODUCERS)}:
        spec = overlay[kind, name]["spec"]
        selector = spec.get("selector") or spec["podSelector"]
        selector = selector.get("matchLabels", selector)
        assert _selects(selector, _pod_labels(producers)), f"{kind} {name}"
        assert not _selects(selector, _pod_labels(consumers)), f"{kind} {name} also selects consumers"
    assert not _selects(producers["spec"]["selector"]["matchLabels"], _pod_labels(consumers))
    assert not _selects(consumers["spec"]["selector"]["matchLabels"], _pod_labels(producers))
    assert overlay["PodDisruptionBudget", PRODUCERS]["spec"]["maxUnavailable"] == 1


def test_disaggregated_producers_are_the_base_engine_pod(
    manifests: list[Manifest], disagg: list[Manifest]
) -> None:
    """Same image, command, ports, probes, TLS, tokens, resources and security as the base
    engines: only names, labels and the TANDEM_KV_* variables differ. So everything checked
    above for the engine holds for the producers, and their KV caches have the same layout
    as the consumers' (a pull between different layouts is refused)."""
    producers = _without_kv(_one(disagg, "StatefulSet", PRODUCERS))
    engine = _one(manifests, "StatefulSet", CONSUMERS)
    specs = []
    for workload in (producers, engine):
        spec = copy.deepcopy(workload["spec"]["template"]["spec"])
        for constraint in spec.get("topologySpreadConstraints", []):
            assert constraint["labelSelector"]["matchLabels"] == _pod_labels(workload)
            del constraint["labelSelector"]
        specs.append(spec)
    assert specs[0] == specs[1]
    assert producers["spec"]["template"]["metadata"]["annotations"] == engine["spec"]["template"]["metadata"]["annotations"]
    assert producers["spec"]["podManagementPolicy"] == engine["spec"]["podManagementPolicy"]


def test_disaggregated_engines_have_their_roles(disagg: list[Manifest]) -> None:
    for name, role in ((PRODUCERS, "producer"), (CONSUMERS, "consumer")):
        workload = _one(disagg, "StatefulSet", name)
        assert _pod_labels(workload)[KV_ROLE_LABEL] == role, name
        args = _args(workload, disagg)
        assert args.kv_role == role, name
        # The id plus the index (the ordinal): the pod's name, in logs and spans.
        assert args.kv_engine_id == name, name
        problems = env_flag_problems(_container(workload)["command"], _container_env(workload, disagg))
        assert not problems, "\n".join(problems)
    assert _args(_one(disagg, "StatefulSet", CONSUMERS), disagg).kv_address is None


def test_disaggregated_producers_advertise_their_pod_dns_name(
    disagg: list[Manifest], disagg_namespace: str
) -> None:
    """TANDEM_KV_ADDRESS, which consumers dial for tandem.v1.KvTransfer, is each producer
    pod's stable name under its headless Service (the serviceName), on the gRPC port."""
    producers = _one(disagg, "StatefulSet", PRODUCERS)
    service = _headless_for(disagg, producers)
    grpc_port = _ports(_container(producers))["grpc"]
    (service_port,) = [p for p in service["spec"]["ports"] if p["targetPort"] == "grpc"]
    for ordinal in range(producers["spec"]["replicas"] + 2):  # scaled up too
        args = parse_command(_container(producers)["command"], _pod_env(producers, disagg, ordinal))
        host, port = split_addr(args.kv_address)
        assert host == f"{PRODUCERS}-{ordinal}.{service['metadata']['name']}.{disagg_namespace}.{CLUSTER_DOMAIN}"
        assert port == args.port == grpc_port == service_port["port"]


def test_disaggregated_frontends_discover_both_roles(
    disagg: list[Manifest], disagg_namespace: str
) -> None:
    frontend = _workload(disagg, "frontend")
    args = _args(frontend, disagg)
    assert args.disaggregated
    problems = env_flag_problems(_container(frontend)["command"], _container_env(frontend, disagg))
    assert not problems, "\n".join(problems)
    wanted = []
    for name in (CONSUMERS, PRODUCERS):
        workload = _one(disagg, "StatefulSet", name)
        service = _headless_for(disagg, workload)
        wanted.append(f"dns:///{service['metadata']['name']}.{disagg_namespace}.{CLUSTER_DOMAIN}:{_args(workload, disagg).port}")
    assert args.engines == wanted


def test_disaggregated_network_policies_let_consumers_pull(disagg: list[Manifest]) -> None:
    """Consumers reach the producers' gRPC port (where KvTransfer is served, the port of
    TANDEM_KV_ADDRESS), frontends reach both roles; nothing else is opened: producers never
    call consumers, and every rule on the producers names who may come."""
    producers = _one(disagg, "StatefulSet", PRODUCERS)
    consumers = _one(disagg, "StatefulSet", CONSUMERS)
    frontend = _workload(disagg, "frontend")
    assert _admits(disagg, producers, consumers, "grpc")
    assert _admits(disagg, producers, frontend, "grpc") and _admits(disagg, consumers, frontend, "grpc")
    assert not _admits(disagg, consumers, producers, "grpc")
    assert not _admits(disagg, producers, consumers, "metrics") and not _admits(disagg, producers, consumers, "health")
    policy = _one(disagg, "NetworkPolicy", PRODUCERS)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    ports = _ports(_container(producers))
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "a producer rule without `from` opens it to everyone"
        assert all(p["port"] in ports and p["protocol"] == "TCP" for p in rule["ports"]), rule
    grpc_peers = [peer for rule in _rules_for_port(policy, "grpc") for peer in rule["from"]]
    for peer in grpc_peers:  # this namespace's frontends and consumers, no one else
        assert set(peer) == {"podSelector"}, peer
        assert any(_selects(peer["podSelector"]["matchLabels"], _pod_labels(w)) for w in (frontend, consumers))
        assert not _selects(peer["podSelector"]["matchLabels"], _pod_labels(producers)), peer


def test_disaggregated_pull_authenticates_as_the_code_does(disagg: list[Manifest]) -> None:
    """A consumer dials a producer with its own engine credentials (engine_service/server.py
    _kv_connector): TANDEM_ENGINE_TOKEN as x-tandem-engine-token, and with TANDEM_TLS_CA its
    TANDEM_TLS_CERT/KEY as the client certificate and TANDEM_TLS_CA as the trust root. So
    both roles read the same token and the same CA, the consumer has a certificate to present,
    and deploy/README.md says what that certificate must hold (clientAuth, the producers'
    names)."""
    producers = _one(disagg, "StatefulSet", PRODUCERS)
    consumers = _one(disagg, "StatefulSet", CONSUMERS)
    envs = [_container_env(w, disagg) for w in (producers, consumers)]
    files = [_secret_files(w) for w in (producers, consumers)]
    assert envs[0]["TANDEM_ENGINE_TOKEN"] == envs[1]["TANDEM_ENGINE_TOKEN"]  # the same Secret key
    assert envs[0]["TANDEM_TLS_CA"], "producers require client certificates (mutual TLS)"
    assert files[0][envs[0]["TANDEM_TLS_CA"]] == files[1][envs[1]["TANDEM_TLS_CA"]]
    for name in ("TANDEM_TLS_CERT", "TANDEM_TLS_KEY"):
        assert envs[1][name] in files[1], f"consumers present {name} as their client certificate"
    readme = README.read_text()
    service = _headless_for(disagg, producers)["metadata"]["name"]
    namespace = producers["metadata"]["namespace"]
    for needed in ("clientAuth", f"{service}.{namespace}.{CLUSTER_DOMAIN}", f"*.{service}.{namespace}.{CLUSTER_DOMAIN}"):
        assert needed in readme, f"deploy/README.md does not say the engine certificate needs {needed}"


# ---- optional: engines on NVIDIA GPUs (deploy/k8s-gpu) ------------------------------------------

GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource
GPU_ENV = ("TANDEM_DEVICE", "TANDEM_DTYPE")


@pytest.fixture(scope="module")
def gpu() -> list[Manifest]:
    """What `kubectl kustomize deploy/k8s-gpu` renders."""
    return _render(K8S_GPU)


def _without_gpu(workload: Manifest) -> Manifest:
    """The engine StatefulSet without what the GPU overlay adds (image tag aside)."""
    out = copy.deepcopy(workload)
    pod = out["spec"]["template"]["spec"]
    pod.pop("nodeSelector", None)
    pod.pop("tolerations", None)
    container = _container(out)
    container["env"] = [e for e in container["env"] if e["name"] not in GPU_ENV]
    for kind in ("requests", "limits"):
        container["resources"][kind].pop(GPU_RESOURCE, None)
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_gpu_overlay_validates_against_the_schemas(version: str, gpu: list[Manifest]) -> None:
    files = {p.name for p in K8S_GPU.glob("*.yaml")}
    assert files == {"kustomization.yaml"}, f"the overlay is its kustomization alone: {files}"
    for doc in gpu:  # rendered: the patched engine StatefulSet is checked too
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{doc['kind']} {doc['metadata']['name']}: {exc.message}") from exc


def test_gpu_overlay_renders_as_kustomize_does(gpu: list[Manifest]) -> None:
    keys = [(m["kind"], m["metadata"]["name"]) for m in gpu]
    assert len(keys) == len(set(keys)), f"duplicate objects: {keys}"
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlay was rendered by this file's own reader only")
    built = subprocess.run([kubectl, "kustomize", str(K8S_GPU)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    rendered = [d for d in yaml.safe_load_all(built.stdout) if d]
    assert sorted(rendered, key=str) == sorted(gpu, key=str)


def test_gpu_overlay_changes_only_the_engines(manifests: list[Manifest], gpu: list[Manifest]) -> None:
    """Every base object is there and unchanged but the engine StatefulSet, which differs only
    in its image tag, the GPU request, node placement and the device/dtype variables."""
    base = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    overlay = {(m["kind"], m["metadata"]["name"]): m for m in gpu}
    assert set(overlay) == set(base)
    changed = {key for key in base if overlay[key] != base[key]}
    assert changed == {("StatefulSet", "tandem-engine")}, changed
    engine = _without_gpu(overlay["StatefulSet", "tandem-engine"])
    assert _container(engine)["image"] != _container(base["StatefulSet", "tandem-engine"])["image"]
    _container(engine)["image"] = _container(base["StatefulSet", "tandem-engine"])["image"]
    assert engine == base["StatefulSet", "tandem-engine"]


def test_gpu_engines_ask_for_a_gpu_and_run_on_it(gpu: list[Manifest]) -> None:
    engine = _workload(gpu, "engine")
    container = _container(engine)
    resources = container["resources"]
    assert resources["limits"][GPU_RESOURCE] == "1"
    # Extended resources cannot be overcommitted: a request, where given, equals the limit.
    assert resources["requests"].get(GPU_RESOURCE, "1") == resources["limits"][GPU_RESOURCE]
    pod = engine["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    args = _args(engine, gpu)
    assert args.device == "cuda" and args.dtype == "bfloat16"
    problems = env_flag_problems(container["command"], _container_env(engine, gpu))
    assert not problems, "\n".join(problems)
    # The frontends are the base's: no GPU, the CPU image.
    frontend = _container(_workload(gpu, "frontend"))
    assert GPU_RESOURCE not in frontend["resources"].get("limits", {})


def test_gpu_engine_image_is_the_cuda_build(gpu: list[Manifest]) -> None:
    """The overlay's engine image is the one compose's `gpu` profile builds: the engine target
    with TORCH_VARIANT=cuda, a build argument the Dockerfile's engine stages take."""
    compose = load_yaml(ROOT / "docker-compose.yml")["services"]
    image = _container(_workload(gpu, "engine"))["image"]
    assert image == compose["engine-gpu"]["image"]
    assert compose["engine-gpu"]["build"]["target"] == "engine"
    assert compose["engine-gpu"]["build"]["args"]["TORCH_VARIANT"] == "cuda"
    stages = dockerfile_stages()
    assert any(a.partition("=")[0] == "TORCH_VARIANT" for a in stages["engine-build"].args("ARG"))
