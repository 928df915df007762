"""`specd diff --address`: the same check against the running three-process stack; and the
per-request speculation counter the "speculation off" alert reads, as Prometheus exposes it."""

from __future__ import annotations

import json

import pytest

from specd.cli import main
from tests.e2e.test_metrics import Scrape

pytestmark = pytest.mark.slow


def test_diff_against_a_running_coordinator_exits_0(stack, workload_prompts, tmp_path, capsys):
    kinds: dict[str, object] = {}
    for p in workload_prompts:  # one prompt of each of the first two kinds
        kinds.setdefault(p.kind, p)
    chosen = list(kinds.values())[:2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p.__dict__) for p in chosen) + "\n")
    out = tmp_path / "diff.json"
    before = Scrape(stack.coordinator.metrics_url)
    rc = main(["diff", "--address", stack.coordinator.address, "--prompts", str(prompts),
               "--method", "ngram,suffix,draft_model", "--k", "4", "--max-tokens", "8", "--json", str(out),
               "--no-progress"])
    table = capsys.readouterr().out
    assert rc == 0, table
    report = json.loads(out.read_text())
    assert report["mode"] == "remote" and report["identical"] is True
    assert len(report["rows"]) == 3 * len(chosen)
    assert all(r["baseline_tokens"] > 0 and r["baseline_s"] > 0 for r in report["rows"])
    assert sum(r["num_draft_tokens"] for r in report["rows"]) > 0  # the coordinator did speculate

    after = Scrape(stack.coordinator.metrics_url)
    name = "specd_coordinator_speculation_requests_total"

    def delta(**labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    n = len(chosen)
    assert delta() == 4 * n  # every request counted once: a baseline and three methods per prompt
    assert delta(specd_speculation="off", specd_speculation_reason="requested", specd_method="none") == n
    for method in ("ngram", "suffix", "draft_model"):
        assert delta(specd_method=method) == n
    assert delta(specd_speculation="on") > 0
    drafted = {(r["prompt_id"], r["method"]) for r in report["rows"] if r["num_drafts"] > 0}
    assert delta(specd_speculation="on") == len(drafted)  # "on" means the request drafted at least once
