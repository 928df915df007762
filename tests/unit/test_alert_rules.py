"""The Prometheus rules in k8s/prometheus/, checked and unit-tested offline with promtool.

`promtool test rules` evaluates the rules on the synthetic series of tests/unit/alert_rules.test.yml
and compares the alerts that fire (labels and annotations) at given times. `make setup` installs
promtool; without it these tests fail (they are never skipped).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from specd.telemetry import CoordinatorMetrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "k8s" / "prometheus" / "specd-alerts.rules.yml"
RULE_TESTS = Path(__file__).with_name("alert_rules.test.yml")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: run `make setup` (or `make promtool`), which installs it from "
                    "Debian's prometheus package")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_rule_file_is_valid(promtool):
    proc = _run(promtool, "check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_alerts_fire_on_synthetic_series(promtool):
    proc = _run(promtool, "test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rule_tests_can_fail(promtool, tmp_path):
    """The same tests against a weakened drift rule (a drop to 0.9x its baseline fires) must fail."""
    rules = RULES.read_text()
    assert "< 0.5 * specd:spec_decode_acceptance_rate:baseline_1d" in rules
    (tmp_path / "k8s" / "prometheus").mkdir(parents=True)
    (tmp_path / "k8s" / "prometheus" / RULES.name).write_text(
        rules.replace("< 0.5 * specd:spec_decode_acceptance_rate:baseline_1d", "< 0.9 * specd:spec_decode_acceptance_rate:baseline_1d"))
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    proc = _run(promtool, "test", "rules", str(tmp_path / "tests" / "unit" / RULE_TESTS.name))
    assert proc.returncode != 0 and "SpecdAcceptanceDrift" in proc.stdout + proc.stderr


class _RecordingMeter:
    """Collects the instrument names CoordinatorMetrics creates."""

    def __init__(self):
        self.counters: list[str] = []

    def create_counter(self, name, *args, **kwargs):
        self.counters.append(name)

    def __getattr__(self, _name):
        return lambda *args, **kwargs: None


def test_rules_read_counters_the_coordinator_exports():
    """Every specd counter the rules read is one the coordinator creates (OpenTelemetry name, dots
    as underscores, `_total`, as Prometheus exposes it)."""
    meter = _RecordingMeter()
    CoordinatorMetrics(meter)  # type: ignore[arg-type]
    exported = {name.replace(".", "_") + "_total" for name in meter.counters}
    referenced = set(re.findall(r"\b(specd_[a-z_]+_total)\b", RULES.read_text()))
    assert referenced, "the rules read no specd counter"
    assert referenced <= exported, referenced - exported
    assert {"specd_coordinator_speculation_requests_total", "specd_coordinator_speculation_disabled_total",
            "specd_spec_decode_num_draft_tokens_total", "specd_spec_decode_num_accepted_tokens_total"} <= referenced
