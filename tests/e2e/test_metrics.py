"""Prometheus metrics of the three real processes agree with the requests' own statistics.

Scrapes each service's /metrics before and after a few known requests and compares the deltas
(other tests share the stack, so only differences count) with the stats the coordinator returned.
Requests run one at a time, so every verify pass has batch size one."""

from __future__ import annotations

import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.client import build_request
from specd.sampling import SamplingParams
from specd.telemetry import TOKEN_BUCKETS, TTFT_BUCKETS
from tests.e2e.conftest import wait_sessions_closed

pytestmark = pytest.mark.slow

REQUESTS = [
    ("Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox", "ngram", 4, 24),
    ("List: alpha, beta, gamma, delta, alpha, beta, gamma, delta, alpha,", "suffix", 6, 20),
    ("Once upon a time", "draft_model", 3, 12),
    ("Hello", "none", 0, 6),
]


class Scrape:
    """One scrape of a /metrics endpoint: sample name -> [(labels, value)]."""

    def __init__(self, url: str):
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(body)}
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in self.families.values():
            for s in family.samples:
                self.samples[s.name].append((s.labels, s.value))

    def total(self, name: str, **labels: str) -> float:
        return sum(v for lab, v in self.samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))

    def buckets(self, name: str) -> list[float]:
        return sorted({float(lab["le"]) for lab, _ in self.samples.get(name + "_bucket", [])})


def scrape_all(stack) -> dict[str, Scrape]:
    return {name: Scrape(getattr(stack, name).metrics_url) for name in ("coordinator", "draft", "target")}


def test_every_service_serves_metrics(stack, client):
    # A fresh coordinator has recorded nothing yet (no series, so no target_info either): one request.
    client.generate(build_request("Hi", SamplingParams(max_tokens=2), method="ngram", k=2), timeout=120)
    for name in ("coordinator", "draft", "target"):
        svc = getattr(stack, name)
        assert svc.metrics_url, f"{name} was started without a metrics port"
        scrape = Scrape(svc.metrics_url)
        (info,) = scrape.samples["target_info"]
        assert info[0]["service_name"] == f"specd-{name}"
        assert scrape.samples["process_cpu_seconds_total"]


def test_counters_agree_with_the_requests_stats(stack, client):
    before = scrape_all(stack)
    results = []
    for prompt, method, k, max_tokens in REQUESTS:
        req = build_request(prompt, SamplingParams(max_tokens=max_tokens), method=method, k=k)
        results.append((method, client.generate(req, timeout=300)))
    assert wait_sessions_closed(stack) == (0, 0)
    after = scrape_all(stack)

    def delta(service: str, name: str, **labels: str) -> float:
        return after[service].total(name, **labels) - before[service].total(name, **labels)

    stats = [r.stats for _, r in results]
    n = len(results)
    drafts = sum(s.num_drafts for s in stats)
    draft_tokens = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    passes = sum(s.target_forward_passes for s in stats)
    verifies = passes - n  # one prefill per request
    output = sum(len(r.token_ids) for _, r in results)
    prompt_tokens = sum(r.usage.prompt_tokens for _, r in results)
    assert drafts > 0 and accepted > 0

    # Coordinator: speculation counters (vLLM's), per position too.
    assert delta("coordinator", "specd_spec_decode_num_drafts_total") == drafts
    assert delta("coordinator", "specd_spec_decode_num_draft_tokens_total") == draft_tokens
    assert delta("coordinator", "specd_spec_decode_num_accepted_tokens_total") == accepted
    per_pos = defaultdict(int)
    for s in stats:
        for i, c in enumerate(s.accepted_per_position):
            per_pos[i] += c
    for i, c in per_pos.items():
        assert delta("coordinator", "specd_spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) == c
    for method, r in results:
        if method != "none":
            assert delta("coordinator", "specd_spec_decode_num_drafts_total", specd_method=method) == r.stats.num_drafts
    series = [lab for lab, _ in after["coordinator"].samples["specd_spec_decode_num_drafts_total"]]
    assert all(lab.get("gen_ai_request_model") for lab in series), "the spec-decode counters carry the target model"
    dm = [lab for lab in series if lab["specd_method"] == "draft_model"]
    assert dm and all(lab.get("specd_draft_model") for lab in dm), "draft_model counters name the draft model"

    # Coordinator: GenAI request metrics.
    assert delta("coordinator", "gen_ai_client_token_usage_sum", gen_ai_token_type="output") == output
    assert delta("coordinator", "gen_ai_client_token_usage_sum", gen_ai_token_type="input") == prompt_tokens
    assert delta("coordinator", "gen_ai_client_token_usage_count", gen_ai_token_type="output") == n
    assert delta("coordinator", "gen_ai_server_time_to_first_token_seconds_count") == n
    assert delta("coordinator", "gen_ai_server_request_duration_seconds_count") == n
    assert delta("coordinator", "gen_ai_server_time_per_output_token_seconds_count") == sum(len(r.token_ids) > 1 for _, r in results)
    assert delta("coordinator", "specd_coordinator_requests_total") == n
    assert after["coordinator"].total("specd_coordinator_requests_running") == 0
    assert after["coordinator"].total("specd_coordinator_requests_waiting") == 0
    assert after["coordinator"].buckets("gen_ai_server_time_to_first_token_seconds") == [*TTFT_BUCKETS, float("inf")]
    assert after["coordinator"].buckets("gen_ai_client_token_usage") == [*map(float, TOKEN_BUCKETS), float("inf")]
    # Steps as the coordinator saw them: one verify call per verify pass, one draft call per k chosen.
    assert delta("coordinator", "specd_coordinator_verify_duration_seconds_count") == verifies
    proposals = delta("coordinator", "specd_spec_decode_k_count")
    assert drafts <= proposals <= verifies
    assert delta("coordinator", "specd_coordinator_draft_duration_seconds_count") == proposals

    # Target: forward passes (prefills and verifies), batch sizes (all one), latency histograms.
    assert delta("target", "specd_target_forward_passes_total") == passes
    assert delta("target", "specd_target_forward_passes_total", specd_pass="prefill") == n
    assert delta("target", "specd_target_batch_size_count") == verifies
    assert delta("target", "specd_target_batch_size_sum") == verifies
    assert delta("target", "specd_target_verify_duration_seconds_count") == verifies
    assert delta("target", "specd_target_prefill_duration_seconds_count") == n
    assert delta("target", "specd_target_queue_duration_seconds_count") == passes
    assert after["target"].total("specd_target_sessions_open") == 0
    assert after["target"].total("specd_target_queue_depth") == 0

    # Draft: one block per proposal, the same draft tokens.
    assert delta("draft", "specd_draft_blocks_total") == proposals
    assert delta("draft", "specd_draft_tokens_total") == draft_tokens
    assert delta("draft", "specd_draft_duration_seconds_count") == proposals
    assert after["draft"].total("specd_draft_sessions_open") == 0
