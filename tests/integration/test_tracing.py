"""One trace across the three services, in-process: target (the real bundled model), draft (n-gram,
model-free) and coordinator, each built as specd/serve.py builds it but with its own Telemetry
reading spans into memory. A request's spans form one tree: the coordinator's request span is
the root; its "prefill"/"verify"/"draft" children are the parents of the services' spans."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from coordinator.client import CoordinatorClient, build_request
from specd.config import CoordinatorConfig, DraftConfig, TargetConfig
from specd.grpc_server import make_channel
from specd.sampling import SamplingParams
from specd.serve import start_coordinator, start_draft, start_target
from specd.telemetry import setup_telemetry
from specdec.v1 import target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

SERVICES = ("target", "draft", "coordinator")
PROMPT = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"


@pytest.fixture(scope="module")
def traced():
    exporters = {s: InMemorySpanExporter() for s in SERVICES}
    readers = {s: InMemoryMetricReader() for s in SERVICES}
    tels = {s: setup_telemetry(s, None, span_processors=[SimpleSpanProcessor(exporters[s])], metric_readers=[readers[s]])
            for s in SERVICES}
    handles = {}
    try:
        handles["target"] = start_target(TargetConfig(port=0, max_workers=8, grace_seconds=1.0), telemetry=tels["target"])
        handles["draft"] = start_draft(DraftConfig(port=0, max_workers=8, grace_seconds=1.0), telemetry=tels["draft"])
        handles["coordinator"] = start_coordinator(CoordinatorConfig(
            port=0, max_workers=8, grace_seconds=1.0, target=(f"127.0.0.1:{handles['target'].port}",),
            draft=(f"127.0.0.1:{handles['draft'].port}",), method="ngram", k=4), telemetry=tels["coordinator"])
        yield {"exporters": exporters, "readers": readers, "handles": handles}
    finally:
        for s in reversed(SERVICES):
            if s in handles:
                handles[s].drain(0.5)
            tels[s].shutdown()


def _spans(traced):
    return {s: list(e.get_finished_spans()) for s, e in traced["exporters"].items()}


def _counter_total(reader: InMemoryMetricReader, name: str) -> float:
    total = 0.0
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    total += sum(getattr(p, "value", None) if hasattr(p, "value") else p.count for p in m.data.data_points)
    return total


def test_one_trace_across_three_services(traced):
    for e in traced["exporters"].values():
        e.clear()
    address = f"127.0.0.1:{traced['handles']['coordinator'].port}"
    with CoordinatorClient(address) as client:
        result = None
        for msg in client.stream(build_request(PROMPT, SamplingParams(max_tokens=24), method="ngram", k=4), timeout=120):
            if msg.HasField("result"):
                result = msg.result
    assert result is not None and len(result.token_ids) > 0
    stats = result.stats
    assert stats.num_drafts > 0, "the prompt should give the n-gram drafter something to propose"

    # The request span ends before the result is sent; allow a moment for nothing else to trail.
    deadline = time.monotonic() + 5
    while not any(s.parent is None for s in traced["exporters"]["coordinator"].get_finished_spans()):
        assert time.monotonic() < deadline, "the request span never ended"
        time.sleep(0.05)
    spans = _spans(traced)
    everything = [s for group in spans.values() for s in group]

    # Exactly one trace, across all three exporters; each service contributed.
    assert len({s.context.trace_id for s in everything}) == 1
    assert all(spans[s] for s in SERVICES)
    for service, group in spans.items():
        assert {s.resource.attributes["service.name"] for s in group} == {f"specd-{service}"}

    # The coordinator's request span is the only root.
    roots = [s for s in everything if s.parent is None]
    assert len(roots) == 1
    root = roots[0]
    assert root in spans["coordinator"] and root.kind == SpanKind.SERVER
    assert root.name.startswith("text_completion ")
    a = root.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"]
    assert a["gen_ai.request.max_tokens"] == 24 and a["gen_ai.request.temperature"] == 0.0
    assert a["specd.request_id"] == result.request_id and a["specd.method"] == "ngram" and a["specd.k"] == 4
    assert a["gen_ai.usage.input_tokens"] == result.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == len(result.token_ids)
    assert a["specd.num_drafts"] == stats.num_drafts and a["specd.num_draft_tokens"] == stats.num_draft_tokens
    assert a["specd.num_accepted_tokens"] == stats.num_accepted_tokens
    assert list(a["gen_ai.response.finish_reasons"]) in (["stop"], ["length"])

    by_name = {}
    for s in spans["coordinator"]:
        by_name.setdefault(s.name, []).append(s)
    verify, draft, prefill = by_name.get("verify", []), by_name.get("draft", []), by_name["prefill"]
    root_id = root.context.span_id
    for s in verify + draft + prefill:
        assert s.parent.span_id == root_id and s.kind == SpanKind.CLIENT, s.name
    assert set(by_name) == {root.name, "prefill", "verify", "draft"}

    # Service spans hang off the coordinator span of the same step, one each.
    verify_ids = {s.context.span_id for s in verify}
    draft_ids = {s.context.span_id for s in draft}
    target_verify = [s for s in spans["target"] if s.name == "target.verify"]
    draft_propose = [s for s in spans["draft"] if s.name == "draft.propose"]
    assert target_verify and draft_propose
    assert all(s.parent.span_id in verify_ids and s.kind == SpanKind.SERVER for s in target_verify)
    assert all(s.parent.span_id in draft_ids and s.kind == SpanKind.SERVER for s in draft_propose)
    assert Counter(s.parent.span_id for s in target_verify) == Counter(verify_ids)
    assert Counter(s.parent.span_id for s in draft_propose) == Counter(draft_ids)
    (target_prefill,) = [s for s in spans["target"] if s.name == "target.prefill"]
    assert target_prefill.parent.span_id == prefill[0].context.span_id
    (draft_open,) = [s for s in spans["draft"] if s.name == "draft.open"]
    assert draft_open.parent.span_id == root_id
    assert {s.name for s in spans["target"]} == {"target.prefill", "target.verify"}
    assert {s.name for s in spans["draft"]} == {"draft.open", "draft.propose"}

    # One verify span per verify pass (the prefill is the one other forward pass).
    assert len(verify) == len(target_verify) == stats.target_forward_passes - 1
    assert sum(s.attributes["specd.draft_tokens"] for s in draft) == stats.num_draft_tokens
    assert sum(s.attributes["specd.accepted_tokens"] for s in verify) == stats.num_accepted_tokens
    assert sum(s.attributes["specd.num_accepted"] for s in target_verify) == stats.num_accepted_tokens
    assert all(s.attributes["specd.batch_size"] == 1 for s in verify + target_verify)
    assert all(4 >= s.attributes["specd.k"] >= s.attributes["specd.draft_tokens"] for s in verify + draft)
    assert sum(s.attributes["specd.block_length"] - 1 for s in target_verify) == stats.num_draft_tokens
    assert sum(s.attributes["specd.block_length"] for s in draft_propose) == stats.num_draft_tokens
    assert len({s.attributes["specd.session_id"] for s in target_verify}) == 1

    # The metrics agree with the request's own stats.
    readers = traced["readers"]
    assert _counter_total(readers["coordinator"], "specd.spec_decode.num_drafts") == stats.num_drafts
    assert _counter_total(readers["coordinator"], "specd.spec_decode.num_draft_tokens") == stats.num_draft_tokens
    assert _counter_total(readers["coordinator"], "specd.spec_decode.num_accepted_tokens") == stats.num_accepted_tokens
    assert _counter_total(readers["target"], "specd.target.forward_passes") == stats.target_forward_passes
    assert _counter_total(readers["draft"], "specd.draft.blocks") == len(draft)


def test_health_checks_and_stats_are_not_traced(traced):
    before = {s: len(v) for s, v in _spans(traced).items()}
    for s in SERVICES:
        with make_channel(f"127.0.0.1:{traced['handles'][s].port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for _ in range(3):
                assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            if s == "target":
                target_pb2_grpc.TargetServiceStub(ch).GetStats(target_pb2.GetStatsRequest(), timeout=5)
    time.sleep(0.2)
    assert {s: len(v) for s, v in _spans(traced).items()} == before
