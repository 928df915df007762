"""specd.telemetry without services: off by default (no SDK objects), trace context round trip,
Prometheus names and GenAI bucket boundaries. No model, no processes."""

from __future__ import annotations

import urllib.request

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from specd import telemetry as tm
from specd.telemetry import batch_bucket, extract_from, inject_into, noop_telemetry, setup_telemetry
from specdec.v1 import draft_pb2, target_pb2

OTEL_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "OTEL_SDK_DISABLED")


@pytest.fixture
def no_otel_env(monkeypatch):
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)


def test_off_by_default_creates_no_sdk_provider(no_otel_env, monkeypatch):
    import opentelemetry.sdk.metrics as sdk_metrics
    import opentelemetry.sdk.trace as sdk_trace

    def refuse(*_a, **_k):
        raise AssertionError("an SDK provider was created with telemetry off")

    monkeypatch.setattr(sdk_trace.TracerProvider, "__init__", refuse)
    monkeypatch.setattr(sdk_metrics.MeterProvider, "__init__", refuse)
    for service in ("coordinator", "target", "draft"):
        tel = setup_telemetry(service, None)
        assert not tel.tracing_on and not tel.metrics_on and not tel.enabled
        assert isinstance(tel.tracer_provider, trace.NoOpTracerProvider)
        assert isinstance(tel.meter_provider, metrics.NoOpMeterProvider)
        assert isinstance(tel.tracer, trace.NoOpTracer)
        assert isinstance(tel.meter, metrics.NoOpMeter)
        assert tel.metrics_port is None
        # Every instrument exists and is a no-op; spans are None.
        tel.coordinator.num_drafts.add(1, {"a": "b"})
        tel.coordinator.time_to_first_token.record(0.1)
        tel.target.forward_passes.add(1)
        tel.draft.duration.record(0.001)
        with tel.span("x") as span:
            assert span is None
        with tel.server_span("y", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) as span:
            assert span is None
        tel.shutdown()
    assert not noop_telemetry().enabled


def test_sdk_disabled_env_wins(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    tel = setup_telemetry("target", 0)
    assert not tel.enabled and tel.metrics_port is None


def test_otlp_env_turns_both_signals_on():
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}
    assert tm.otlp_traces_enabled(env) and not tm.otlp_metrics_enabled(env)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    assert tm.otlp_traces_enabled(env) and tm.otlp_metrics_enabled(env)
    assert not tm.otlp_traces_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": " "})


def test_trace_context_rides_on_the_proto_map_field(no_otel_env):
    exporter = InMemorySpanExporter()
    caller = setup_telemetry("coordinator", None, span_processors=[SimpleSpanProcessor(exporter)])
    callee = setup_telemetry("target", None, span_processors=[SimpleSpanProcessor(exporter)])
    assert caller.tracing_on and not caller.metrics_on
    with caller.span("verify") as parent:
        request = target_pb2.TargetRequest(verify=target_pb2.VerifyBlock(draft_token_ids=[1, 2]))
        inject_into(parent, request.trace_context)
        assert set(request.trace_context) == {"traceparent"}
    wire = target_pb2.TargetRequest.FromString(request.SerializeToString())
    with callee.server_span("target.verify", wire.trace_context) as child:
        pass
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["target.verify"].parent.span_id == spans["verify"].context.span_id
    assert spans["target.verify"].context.trace_id == spans["verify"].context.trace_id
    assert spans["target.verify"].kind == trace.SpanKind.SERVER
    assert spans["target.verify"].resource.attributes["service.name"] == "specd-target"
    # No context: a root span, not an error.
    assert extract_from(draft_pb2.DraftRequest().trace_context) is None
    with callee.server_span("draft.propose", {}) as root:
        assert root is not None
    assert exporter.get_finished_spans()[-1].parent is None
    caller.shutdown()
    callee.shutdown()


def test_an_exception_marks_the_span_as_an_error(no_otel_env):
    exporter = InMemorySpanExporter()
    tel = setup_telemetry("draft", None, span_processors=[SimpleSpanProcessor(exporter)])
    with pytest.raises(ValueError):
        with tel.span("draft.propose"):
            raise ValueError("bad k")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == trace.StatusCode.ERROR and span.events[0].name == "exception"
    tel.shutdown()


def test_prometheus_names_units_and_genai_buckets(no_otel_env):
    reader = InMemoryMetricReader()
    tel = setup_telemetry("coordinator", 0, metric_readers=[reader])
    try:
        assert tel.metrics_on and not tel.tracing_on and tel.metrics_port
        m = tel.coordinator
        attrs = {"gen_ai.request.model": "m", "specd.method": "ngram"}
        m.time_to_first_token.record(0.03, attrs)
        m.token_usage.record(7, {**attrs, "gen_ai.token.type": "output"})
        m.num_drafts.add(2, attrs)
        m.num_accepted_tokens_per_pos.add(1, {**attrs, "position": 0})
        m.requests_running.add(1, attrs)
        tel.target.forward_passes.add(1, tel.target.prefill_attrs)
        tel.target.observe(lambda: 3, lambda: 1)
        body = urllib.request.urlopen(f"http://127.0.0.1:{tel.metrics_port}/metrics", timeout=5).read().decode()
        families = {f.name: f for f in text_string_to_metric_families(body)}
        samples = {s.name: s for f in families.values() for s in f.samples}
        assert samples["specd_spec_decode_num_drafts_total"].value == 2
        assert samples["specd_spec_decode_num_drafts_total"].labels["gen_ai_request_model"] == "m"
        assert samples["specd_spec_decode_num_accepted_tokens_per_pos_total"].labels["position"] == "0"
        assert samples["gen_ai_client_token_usage_sum"].labels["gen_ai_token_type"] == "output"
        assert samples["specd_coordinator_requests_running"].value == 1
        assert samples["specd_target_forward_passes_total"].labels["specd_pass"] == "prefill"
        assert samples["specd_target_sessions_open"].value == 3 and samples["specd_target_queue_depth"].value == 1
        assert "process_cpu_seconds_total" in samples
        bounds = [float(s.labels["le"]) for s in families["gen_ai_server_time_to_first_token_seconds"].samples
                  if s.name.endswith("_bucket")]
        assert bounds == [*tm.TTFT_BUCKETS, float("inf")]
        # The in-memory reader sees the same data: both readers hang off one provider.
        names = {mt.name for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for mt in sm.metrics}
        assert "gen_ai.server.time_to_first_token" in names
    finally:
        tel.shutdown()


def test_two_telemetries_in_one_process_do_not_collide(no_otel_env):
    a = setup_telemetry("target", 0)
    b = setup_telemetry("draft", 0)
    try:
        a.target.forward_passes.add(1, a.target.verify_attrs)
        b.draft.blocks.add(1, {"specd.method": "ngram"})
        body_a = urllib.request.urlopen(f"http://127.0.0.1:{a.metrics_port}/metrics", timeout=5).read().decode()
        body_b = urllib.request.urlopen(f"http://127.0.0.1:{b.metrics_port}/metrics", timeout=5).read().decode()
        assert "specd_target_forward_passes_total" in body_a and "specd_draft_blocks_total" not in body_a
        assert "specd_draft_blocks_total" in body_b and "specd_target_forward_passes_total" not in body_b
    finally:
        a.shutdown()
        b.shutdown()


def test_batch_bucket_is_bounded():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == ["1", "2", "4", "4", "8", "8", "16", "16", "32"]
