"""docker-compose.yml against the compose specification's JSON schema (the copy check-jsonschema
vendors), plus what the file promises: two target replicas, gRPC health checks on every specd
service, a stop grace period longer than the drain, Prometheus scraping every service's metrics
port and loading the alert rules. No docker daemon (nor the compose plugin) is needed."""

from __future__ import annotations

import copy
import fnmatch
import json
import re
from functools import lru_cache
from importlib import resources

import pytest
import yaml

from tests.deploy.conftest import ROOT, need_module

COMPOSE = ROOT / "docker-compose.yml"
SPECD_SERVICES = ("target", "draft", "coordinator")


def _load() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@lru_cache(maxsize=1)
def _compose_validator():
    jsonschema = need_module("jsonschema")
    need_module("check_jsonschema")
    schema = json.loads(resources.files("check_jsonschema.builtin_schemas.vendor")
                        .joinpath("compose-spec.json").read_text(encoding="utf-8"))
    assert schema.get("title") == "Compose Specification"
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _errors(doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _compose_validator().iter_errors(doc)]


def test_compose_file_follows_the_compose_specification():
    assert _errors(_load()) == []


@pytest.mark.parametrize("mutate", [
    lambda d: d["services"]["target"]["healthcheck"].update(intervall="5s"),    # unknown key
    lambda d: d["services"]["target"]["deploy"].update(replicas=[2]),         # not an integer
    lambda d: d["services"]["coordinator"]["depends_on"]["target"].update(condition="service_ready"),
    lambda d: d.update(servics={}),                                             # unknown top-level key
])
def test_schema_rejects_broken_compose_files(mutate):
    doc = copy.deepcopy(_load())
    mutate(doc)
    assert _errors(doc)


def _seconds(duration: str) -> float:
    total = 0.0
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration):
        total += float(value) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    assert total > 0, duration
    return total


def test_specd_services_are_health_checked_and_drain_in_time():
    doc = _load()
    services = doc["services"]
    assert services["target"]["deploy"]["replicas"] == 2
    for name in SPECD_SERVICES:
        svc = services[name]
        assert svc["command"][:2] == ["serve", name]
        assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "specd.healthcheck"]
        env = svc["environment"]
        assert env["SPECD_HOST"] == "0.0.0.0"
        assert int(env["SPECD_PORT"]) > 0  # the health check's port
        assert svc.get("stop_signal", "SIGTERM") == "SIGTERM"
        assert _seconds(svc["stop_grace_period"]) > float(env["SPECD_GRACE_SECONDS"]), name
    coordinator = services["coordinator"]
    assert coordinator["depends_on"] == {"target": {"condition": "service_healthy"},
                                         "draft": {"condition": "service_healthy"}}
    args = coordinator["command"]
    for flag, pool in (("--target", "target"), ("--draft", "draft")):
        host, port = re.fullmatch(r"dns:///([a-z-]+):(\d+)", args[args.index(flag) + 1]).groups()
        assert host == pool and port == services[pool]["environment"]["SPECD_PORT"]


def _prometheus_mounts(doc: dict) -> dict[str, str]:
    """Container path -> host path (relative to the repository) of Prometheus's bind mounts."""
    out = {}
    for volume in doc["services"]["prometheus"]["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            out[target] = source[2:]
    return out


def test_prometheus_scrapes_every_specd_service_and_loads_the_alert_rules():
    doc = _load()
    mounts = _prometheus_mounts(doc)
    for host_path in mounts.values():
        assert (ROOT / host_path).is_file(), f"{host_path} is mounted into Prometheus but does not exist"
    config = yaml.safe_load((ROOT / mounts["/etc/prometheus/prometheus.yml"]).read_text())
    rule_globs = config["rule_files"]
    assert any(fnmatch.fnmatch(target, g) for target in mounts for g in rule_globs), (rule_globs, mounts)
    assert mounts["/etc/prometheus/rules/specd-alerts.rules.yml"] == "k8s/prometheus/specd-alerts.rules.yml"
    scraped = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            assert sd["type"] == "A"  # every replica behind the name, not one
            for name in sd["names"]:
                scraped[name] = sd["port"]
    for name in SPECD_SERVICES:
        assert scraped[name] == int(doc["services"][name]["environment"]["SPECD_METRICS_PORT"]), name
    # The rule file is a rule file: groups of named rules whose expressions parse.
    promql = need_module("promql_parser")
    rules = yaml.safe_load((ROOT / "k8s/prometheus/specd-alerts.rules.yml").read_text())
    assert isinstance(rules.get("groups"), list)
    for group in rules["groups"]:
        assert group["name"]
        for rule in group.get("rules", []):
            assert ("alert" in rule) != ("record" in rule)
            promql.parse(rule["expr"])
