"""Autoscaling: the HPAs ask for metrics that the Prometheus Adapter rules define from series the
services really export; the KEDA ScaledObjects query those series in PromQL that parses; the two
pools scale on different signals; the autoscaler, not the manifest, owns the replica counts."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy.conftest import K8S, NAMESPACE, OVERLAYS, by_kind, need_module, render

ADAPTER_VALUES = K8S / "prometheus-adapter" / "values.yaml"
HPA_OVERLAYS = [o for o in OVERLAYS if not o.endswith("keda")]
KEDA_OVERLAYS = [o for o in OVERLAYS if o.endswith("keda")]
POOLS = ("specd-target", "specd-draft")


def _adapter_rules() -> list[dict]:
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert values["rules"]["default"] is False  # only specd's rules: no surprise metric names
    return values["rules"]["custom"]


def _series_names(promql_text: str) -> set[str]:
    """The metric names a PromQL expression selects (via the parser, so it must parse)."""
    promql = need_module("promql_parser")
    names: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, promql.VectorSelector):
            names.add(node.name)
            return
        for attr in ("expr", "lhs", "rhs", "param", "args", "vector_selector"):
            child = getattr(node, attr, None)
            if child is None:
                continue
            for c in (child if isinstance(child, list) else [child]):
                if isinstance(c, promql.Expr):
                    walk(c)

    walk(promql.parse(promql_text))
    return names


def _adapter_query(template: str) -> str:
    """An adapter metricsQuery with its Go template filled in as the adapter would for one pod."""
    return (template.replace("<<.Series>>", "specd_x").replace("<<.LabelMatchers>>", 'namespace="specd",pod=~"p-.*"')
            .replace("<<.GroupBy>>", "pod"))


def test_adapter_rules_map_exported_series_to_pod_metrics(exported_metrics):
    rules = _adapter_rules()
    assert len(rules) >= 4
    for rule in rules:
        (series,) = _series_names(rule["seriesQuery"])
        assert series in exported_metrics, f"{series}: not a series specd exports ({sorted(exported_metrics)})"
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert re.fullmatch(rule["name"]["matches"], series), rule["name"]
        for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert placeholder in rule["metricsQuery"], (placeholder, rule["metricsQuery"])
        assert _series_names(_adapter_query(rule["metricsQuery"])) == {"specd_x"}


def _adapter_metric_names() -> dict[str, str]:
    """Pod metric name the adapter serves -> the series it comes from."""
    out = {}
    for rule in _adapter_rules():
        (series,) = _series_names(rule["seriesQuery"])
        out[re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${", "\\g<").replace("}", ">"), series)] = series
    return out


@pytest.mark.parametrize("overlay", HPA_OVERLAYS)
def test_hpas_scale_each_pool_on_adapter_metrics(overlay):
    objects = render(overlay)
    hpas = by_kind(objects, "HorizontalPodAutoscaler")
    deployments = by_kind(objects, "Deployment")
    served = _adapter_metric_names()
    assert not by_kind(objects, "ScaledObject")
    assert set(hpas) == set(POOLS)
    signals = {}
    for name, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) == ("Deployment", name) and name in deployments
        assert 1 < hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        metrics = hpa["spec"]["metrics"]
        assert metrics and all(m["type"] == "Pods" for m in metrics)
        names = {m["pods"]["metric"]["name"] for m in metrics}
        assert names <= set(served), f"{name}: {names - set(served)} not served by the adapter rules"
        signals[name] = {served[n] for n in names}
        assert all(m["pods"]["target"]["type"] == "AverageValue" for m in metrics)
        # Scale-down is slow: a removed replica drains its sessions first.
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 120
    assert signals["specd-target"] & signals["specd-draft"] == set()
    assert signals["specd-target"] <= {"specd_target_queue_depth", "specd_target_sessions_open"}
    assert all(s.startswith("specd_draft_") for s in signals["specd-draft"])


@pytest.mark.parametrize("overlay", KEDA_OVERLAYS)
def test_scaled_objects_scale_each_pool_on_prometheus_queries(overlay, exported_metrics):
    objects = render(overlay)
    scaled = by_kind(objects, "ScaledObject")
    deployments = by_kind(objects, "Deployment")
    assert not by_kind(objects, "HorizontalPodAutoscaler")  # KEDA makes its own; never two on one Deployment
    assert set(scaled) == set(POOLS)
    signals = {}
    for name, obj in scaled.items():
        ref = obj["spec"]["scaleTargetRef"]
        assert ref["name"] == name and ref.get("kind", "Deployment") == "Deployment" and name in deployments
        assert 1 < obj["spec"]["minReplicaCount"] < obj["spec"]["maxReplicaCount"]
        series = set()
        for trigger in obj["spec"]["triggers"]:
            assert trigger["type"] == "prometheus" and trigger.get("metricType", "AverageValue") == "AverageValue"
            meta = trigger["metadata"]
            assert re.fullmatch(r"https?://[a-z0-9.-]+(:\d+)?", meta["serverAddress"])
            float(meta["threshold"])
            names = _series_names(meta["query"])
            assert names <= exported_metrics, f"{name}: {names - exported_metrics} not exported"
            assert f'namespace="{NAMESPACE}"' in meta["query"]
            series |= names
        signals[name] = series
    assert signals["specd-target"] & signals["specd-draft"] == set()
    assert all(s.startswith("specd_target_") for s in signals["specd-target"])
    assert all(s.startswith("specd_draft_") for s in signals["specd-draft"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaled_pools_leave_replicas_to_the_autoscaler(overlay):
    deployments = by_kind(render(overlay), "Deployment")
    for pool in POOLS:
        assert "replicas" not in deployments[pool]["spec"], pool
    assert deployments["specd-coordinator"]["spec"]["replicas"] >= 2


def test_series_names_come_from_a_real_parse():
    # The helper the checks above rely on finds names through operators and functions, and a
    # query that does not parse fails.
    assert _series_names("sum(rate(a_total[1m])) / on(pod) max_over_time(b[5m])") == {"a_total", "b"}
    with pytest.raises(ValueError):
        _series_names("sum(rate(a_total[1m])")


def test_exported_metrics_include_what_autoscaling_uses(exported_metrics):
    assert {"specd_target_queue_depth", "specd_target_sessions_open", "specd_draft_blocks_total",
            "specd_draft_duration_seconds_sum", "specd_draft_sessions_open"} <= exported_metrics
