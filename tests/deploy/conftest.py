"""Shared helpers of the offline deployment checks: the repository's paths, the tools they need
(a missing one fails the test and says to run `make setup`, never skips), kustomize renders, and
the metric names the services really export."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import urllib.request
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
NAMESPACE = "specd"


def need_module(name: str) -> Any:
    """Imports `name`, or fails the test naming the install step."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} is missing ({exc}): run `make setup` (it installs the dev extras)", pytrace=False)


def need_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not on PATH: run `make setup`", pytrace=False)
    return path


@lru_cache(maxsize=None)
def _kustomize(path: str) -> str:
    kubectl = need_binary("kubectl")
    proc = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} failed:\n{proc.stderr}")
    return proc.stdout


def kustomize(path: Path | str) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize PATH` renders (fresh copies: tests may mutate them)."""
    return [d for d in yaml.safe_load_all(_kustomize(str(path))) if d]


def render(overlay: str) -> list[dict[str, Any]]:
    return kustomize(K8S / "overlays" / overlay)


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@lru_cache(maxsize=None)
def _exported_metric_names() -> frozenset[str]:
    """Every sample name a target's and a draft's /metrics serve, scraped from real Telemetry
    objects (specd/telemetry.py, the same path the services take) after one recorded value each."""
    from prometheus_client.parser import text_string_to_metric_families

    from specd.telemetry import setup_telemetry

    names: set[str] = set()
    for service in ("target", "draft", "coordinator"):
        telemetry = setup_telemetry(service, 0, None, metrics_host="127.0.0.1", env={})
        try:
            if service == "target":
                telemetry.target.observe(lambda: 0, lambda: 0)
                telemetry.target.forward_passes.add(1, telemetry.target.verify_attrs)
            elif service == "draft":
                telemetry.draft.observe(lambda: 0)
                attrs = {"specd.method": "ngram"}
                telemetry.draft.blocks.add(1, attrs)
                telemetry.draft.tokens.add(4, attrs)
                telemetry.draft.duration.record(0.001, attrs)
            else:
                attrs = {"gen_ai.request.model": "m", "specd.method": "ngram"}
                telemetry.coordinator.num_drafts.add(1, attrs)
            url = f"http://127.0.0.1:{telemetry.metrics_port}/metrics"
            body = urllib.request.urlopen(url, timeout=10).read().decode()
        finally:
            telemetry.shutdown()
        for family in text_string_to_metric_families(body):
            names.update(s.name for s in family.samples)
    return frozenset(names)


@pytest.fixture(scope="session")
def exported_metrics() -> frozenset[str]:
    return _exported_metric_names()
