"""k8s/: every overlay renders with `kubectl kustomize`, every rendered object validates against the
Kubernetes schemas (strict: unknown fields fail) or, for the custom resources, against models
generated from their CRDs, and the manifests keep the promises the README makes (gRPC probes,
graceful termination longer than the drain, headless Services behind the coordinator's DNS
targets, a PodDisruptionBudget per pool, GPUs only in the gpu overlays)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import K8S, NAMESPACE, OVERLAYS, ROOT, by_kind, env_of, kustomize, need_module, render

# Kubernetes versions checked: the oldest we support (native gRPC probes are GA since 1.27) and
# the newest that kubernetes-validate knows.
K8S_VERSIONS = ("1.29.0", "latest")
# Kinds validated by the CRD models below instead of the Kubernetes schemas.
CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
                ("monitoring.coreos.com/v1", "PrometheusRule")}
POOLS = {"specd-target": "specdec.v1.TargetService", "specd-draft": "specdec.v1.DraftService",
         "specd-coordinator": "specdec.v1.Coordinator"}


def test_the_four_overlays_exist():
    assert OVERLAYS == ["cpu", "cpu-keda", "gpu", "gpu-keda"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_whole_stack(overlay):
    objects = render(overlay)
    assert set(by_kind(objects, "Deployment")) == set(POOLS)
    assert set(by_kind(objects, "Service")) == {"specd-target-headless", "specd-draft-headless", "specd-coordinator"}
    assert set(by_kind(objects, "PodDisruptionBudget")) == {"specd-target", "specd-draft", "specd-coordinator"}
    assert len(by_kind(objects, "ServiceMonitor")) == 1 and len(by_kind(objects, "PrometheusRule")) == 1
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == NAMESPACE, o["metadata"]["name"]


# --- Kubernetes schemas -----------------------------------------------------------------------


def _validate_k8s(obj: dict, version: str) -> None:
    kv = need_module("kubernetes_validate")
    if version == "latest":
        version = str(kv.utils.latest_version())
    kv.validate(obj, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_strictly(overlay):
    kv = need_module("kubernetes_validate")
    checked = 0
    for obj in render(overlay):
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                _validate_k8s(obj, version)
            except kv.SchemaNotFoundError:
                pytest.fail(f"{overlay}: no Kubernetes schema for {obj['apiVersion']} {obj['kind']}: "
                            "validate it as a custom resource below")
            except kv.ValidationError as exc:
                path = ".".join(map(str, exc.path))
                pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} ({version}): {path}: {exc.message}")
        checked += 1
    assert checked >= 11  # Namespace, ConfigMap, 3 Deployments, 3 Services, 3 PDBs (+ 2 HPAs)


@pytest.mark.parametrize("mutate, why", [
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinesProbe={"grpc": {"port": 1}}), "unknown field"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"].update(port="grpc"), "grpc probes take a number"),
    (lambda d: d["spec"].update(replicas="2"), "wrong type"),
    (lambda d: d["spec"].pop("selector"), "missing required field"),
])
def test_strict_validation_rejects_broken_objects(mutate, why):
    kv = need_module("kubernetes_validate")
    deployment = copy.deepcopy(by_kind(render("cpu"), "Deployment")["specd-target"])
    _validate_k8s(deployment, "latest")  # valid as rendered
    mutate(deployment)
    with pytest.raises(kv.ValidationError):
        _validate_k8s(deployment, "latest")


# --- custom resources: models generated from the KEDA and prometheus-operator CRDs ----------------


def _crd_model(obj: dict):
    if obj["kind"] == "ScaledObject":
        return need_module("cloudcoil.models.keda.v1alpha1").ScaledObject
    return getattr(need_module("cloudcoil.models.prometheus_operator.v1"), obj["kind"])


def validate_custom(obj: dict) -> None:
    """Validates `obj` against the pydantic model generated from its CRD's OpenAPI schema, strictly:
    the models ignore unknown fields and coerce types, so the object must also survive a round trip
    unchanged (an unknown or misspelt field, or a value of the wrong type, does not)."""
    assert (obj.get("apiVersion"), obj.get("kind")) in CUSTOM_KINDS, (obj.get("apiVersion"), obj.get("kind"))
    pydantic = need_module("pydantic")
    model = _crd_model(obj)
    try:
        parsed = model.model_validate(obj)
    except pydantic.ValidationError as exc:
        raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']}: {exc}") from None
    again = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    if again != obj:
        raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']} has fields its CRD does not know "
                             f"or values of the wrong type:\n  given: {obj}\n  known: {again}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_validate_against_their_crds(overlay):
    customs = [o for o in render(overlay) if (o["apiVersion"], o["kind"]) in CUSTOM_KINDS]
    kinds = sorted(o["kind"] for o in customs)
    expected = ["PrometheusRule", "ServiceMonitor"] + (["ScaledObject"] * 2 if overlay.endswith("keda") else [])
    assert kinds == sorted(expected)
    for obj in customs:
        validate_custom(obj)


def _scaled_object() -> dict:
    return copy.deepcopy(by_kind(render("cpu-keda"), "ScaledObject")["specd-target"])


@pytest.mark.parametrize("mutate", [
    lambda d: d["spec"].update(minReplicas=2),                                   # HPA's name, not KEDA's
    lambda d: d["spec"]["triggers"][0]["metadata"].update(threshold=4),          # metadata values are strings
    lambda d: d["spec"].pop("scaleTargetRef"),                                   # required
    lambda d: d["spec"]["scaleTargetRef"].update(nmae="specd-target"),
])
def test_crd_validation_rejects_broken_scaled_objects(mutate):
    obj = _scaled_object()
    validate_custom(obj)
    mutate(obj)
    with pytest.raises(AssertionError):
        validate_custom(obj)


def test_crd_validation_rejects_broken_monitoring_objects():
    objects = render("cpu")
    monitor = copy.deepcopy(by_kind(objects, "ServiceMonitor")["specd"])
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError):
        validate_custom(monitor)
    rule = copy.deepcopy(by_kind(objects, "PrometheusRule")["specd-alerts"])
    rule["spec"]["groups"] = [{"rules": [{"alert": "X", "expr": "up == 0"}]}]  # a group needs a name
    with pytest.raises(AssertionError):
        validate_custom(rule)


# --- what the manifests promise ---------------------------------------------------------------


def _deployments(overlay: str) -> dict[str, dict]:
    return by_kind(render(overlay), "Deployment")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_native_grpc_probes_on_the_health_service(overlay):
    for name, deployment in _deployments(overlay).items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        assert env_of(container)["SPECD_PORT"] == str(grpc_port), name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == grpc_port, (name, probe)
            assert set(container[probe]) - {"periodSeconds", "timeoutSeconds", "failureThreshold",
                                             "successThreshold", "initialDelaySeconds"} == {"grpc"}
        assert container["readinessProbe"]["grpc"]["service"] == POOLS[name]
        # The startup probe gives model loading minutes, not seconds.
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_outlasts_prestop_and_drain(overlay):
    for name, deployment in _deployments(overlay).items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep", name
        pre_stop = float(command[1])
        drain = float(env_of(container)["SPECD_GRACE_SECONDS"])
        assert pre_stop > 0 and drain > 0
        assert pod["terminationGracePeriodSeconds"] > pre_stop + drain, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_coordinator_finds_the_pools_through_headless_services(overlay):
    objects = render(overlay)
    deployments, services = by_kind(objects, "Deployment"), by_kind(objects, "Service")
    (coordinator,) = deployments["specd-coordinator"]["spec"]["template"]["spec"]["containers"]
    args = coordinator["args"]
    for flag, pool in (("--target", "specd-target"), ("--draft", "specd-draft")):
        match = re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", args[args.index(flag) + 1])
        assert match, args
        service_name, namespace, port = match.group(1), match.group(2), int(match.group(3))
        assert namespace == NAMESPACE
        service = services[service_name]
        assert service["spec"]["clusterIP"] == "None", f"{service_name} must be headless (one A record per pod)"
        pod_template = deployments[pool]["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod_template["metadata"]["labels"].items()
        (container,) = pod_template["spec"]["containers"]
        grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert grpc["port"] == port == next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_deployment_has_one_disruption_budget(overlay):
    objects = render(overlay)
    budgets = by_kind(objects, "PodDisruptionBudget").values()
    for name, deployment in by_kind(objects, "Deployment").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, name
        assert covering[0]["spec"].get("maxUnavailable") == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_every_service_metrics_port(overlay):
    objects = render(overlay)
    (monitor,) = by_kind(objects, "ServiceMonitor").values()
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    deployments = by_kind(objects, "Deployment")
    selected = [s for s in by_kind(objects, "Service").values() if selector.items() <= s["metadata"]["labels"].items()]
    assert len(selected) == 3
    for service in selected:
        metrics = [p for p in service["spec"]["ports"] if p["name"] in ports]
        assert len(metrics) == 1, service["metadata"]["name"]
        # ... and that port is the container's SPECD_METRICS_PORT (from the specd-common ConfigMap).
        pool = next(d for d in deployments.values()
                    if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items())
        (container,) = pool["spec"]["template"]["spec"]["containers"]
        (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"
                         and o["metadata"]["name"] == container["envFrom"][0]["configMapRef"]["name"]]
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == metrics[0]["targetPort"])
        assert str(port) == config_map["data"]["SPECD_METRICS_PORT"] == str(metrics[0]["port"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_only_in_the_gpu_overlays(overlay):
    deployments = _deployments(overlay)
    gpu = overlay.startswith("gpu")
    for name, deployment in deployments.items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        limits = container["resources"].get("limits", {})
        wants_gpu = gpu and name == "specd-target"
        assert ("nvidia.com/gpu" in limits) == wants_gpu, name
        assert (env_of(container).get("SPECD_DEVICE") == "cuda") == wants_gpu, name
        assert container["image"] == ("specd:cuda" if gpu else "specd:cpu")


def test_secrets_component_mounts_the_secret_in_every_container(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize takes relative paths only, even outside the kustomization's own folder
        "resources": [os.path.relpath(K8S / "overlays" / "cpu", tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "secrets", tmp_path)]}))
    deployments = by_kind(kustomize(tmp_path), "Deployment")
    assert set(deployments) == set(POOLS)
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "specd-secrets"]
        assert volume["secret"] == {"secretName": "specd-secrets", "optional": True, "defaultMode": 0o440}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["specd-secrets"]["readOnly"] is True, name
        _validate_k8s(deployment, "latest")


def test_prometheus_rule_is_generated_from_the_alert_rule_file():
    script = ROOT / "scripts" / "gen_prometheusrule.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rules = yaml.safe_load((K8S / "prometheus" / "specd-alerts.rules.yml").read_text())
    (rule,) = by_kind(render("cpu"), "PrometheusRule").values()
    assert rule["spec"]["groups"] == (rules.get("groups") or [])
    # Every alert and recording expression is PromQL that parses.
    promql = need_module("promql_parser")
    for group in rule["spec"]["groups"]:
        for r in group.get("rules", []):
            promql.parse(r["expr"])


def test_rule_wrapper_refuses_a_file_that_is_not_a_rule_file():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_prometheusrule
    finally:
        sys.path.pop(0)
    assert "groups:\n  - name: g" in gen_prometheusrule.render("groups:\n  - name: g\n    rules: []\n")
    with pytest.raises(ValueError):
        gen_prometheusrule.render("apiVersion: v1\nkind: ConfigMap\n")


def test_manifests_are_plain_yaml_without_tabs():
    for path in sorted(Path(K8S).rglob("*.yaml")):
        text = path.read_text()
        assert "\t" not in text, path
        list(yaml.safe_load_all(text))
