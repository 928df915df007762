"""OpenTelemetry for the three services: traces, and metrics exposed to Prometheus and/or OTLP.

`setup_telemetry(service, metrics_port)` builds one `Telemetry` per service:

- traces: an SDK TracerProvider (resource `service.name=specd-<service>`) exporting over OTLP/gRPC
  when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set;
- metrics: an SDK MeterProvider read by Prometheus (an HTTP endpoint on `metrics_port`) and/or by
  a periodic OTLP exporter when `OTEL_EXPORTER_OTLP_ENDPOINT` or
  `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` is set.

With neither on (the default) no SDK object is created at all: the tracer and meter come from the
API's no-op providers, `tracing_on`/`metrics_on` are False, and the hot paths check those flags
before building any attribute or span, so telemetry that is off costs a branch per step.

Providers are kept on the Telemetry object (never installed as the global ones), so several
services in one process (the tests) each keep their own tracer, meter and Prometheus registry.

Trace context crosses the services per message: a session is one long-lived bidi stream whose
steps belong to different caller spans, so each `TargetRequest`/`DraftRequest` carries the W3C
`traceparent` of the coordinator's span for that step in its `trace_context` map (`inject_into`),
and the servicers start their step span as a child of it (`Telemetry.server_span`).

Metric names follow the OpenTelemetry GenAI semantic conventions where one exists (with their
recommended bucket boundaries), and vLLM's spec-decode counters for speculation; `METRICS_DOC`
in the README lists them as Prometheus exposes them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

SCOPE = "specd"
_PROPAGATOR = TraceContextTextMapPropagator()

# --- bucket boundaries -----------------------------------------------------------------------

# Recommended by the GenAI semantic conventions (gen-ai-metrics.md) for each instrument.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
# specd's own: one step's latency (sub-millisecond n-gram drafts up to a slow batched pass).
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


# --- environment -----------------------------------------------------------------------------


def _env_set(env: Mapping[str, str], *names: str) -> bool:
    return any(env.get(n, "").strip() for n in names)


def otlp_traces_enabled(env: Mapping[str, str] = os.environ) -> bool:
    return _env_set(env, "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def otlp_metrics_enabled(env: Mapping[str, str] = os.environ) -> bool:
    return _env_set(env, "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")


def sdk_disabled(env: Mapping[str, str] = os.environ) -> bool:
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


# --- propagation -----------------------------------------------------------------------------


def inject_into(span_or_context: trace.Span | Context, carrier: Any) -> None:
    """Writes the W3C trace context of a span (or of a Context holding one) into `carrier`: a
    dict or a proto `map<string, string>` field."""
    ctx = span_or_context if isinstance(span_or_context, Context) else trace.set_span_in_context(span_or_context)
    _PROPAGATOR.inject(carrier, context=ctx)


def extract_from(carrier: Any) -> Context | None:
    """The context a caller sent in `carrier` (a dict, a proto map field or gRPC metadata as a
    dict); None when it carries none, so a span started with it becomes a root."""
    if not carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


# --- instruments -----------------------------------------------------------------------------


def batch_bucket(size: int) -> str:
    """A bounded label for a batch size: the power of two at or above it ("1", "2", "4", ...)."""
    return str(1 << max(size - 1, 0).bit_length())


class CoordinatorMetrics:
    """Per-request GenAI metrics and per-step speculation metrics, recorded by the coordinator."""

    def __init__(self, meter: otel_metrics.Meter):
        h, c = meter.create_histogram, meter.create_counter
        self.time_to_first_token = h(
            "gen_ai.server.time_to_first_token", "s", "Time from receiving a request to its first output token",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.time_per_output_token = h(
            "gen_ai.server.time_per_output_token", "s", "Time per output token after the first, per request",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.request_duration = h(
            "gen_ai.server.request.duration", "s", "Time from receiving a request to its last output token",
            explicit_bucket_boundaries_advisory=REQUEST_DURATION_BUCKETS)
        # Token usage: the GenAI conventions define one token-usage instrument, the histogram
        # `gen_ai.client.token.usage` ({token}, by `gen_ai.token.type` = input|output, with these
        # buckets); their model-server section has no token metric of its own. We emit that
        # instrument unchanged (name, unit, type, buckets) rather than inventing a
        # `gen_ai.server.*` name, so convention-based dashboards and queries find it; its _sum
        # series is the token counter (rate(..._sum) = tokens per second).
        self.token_usage = h(
            "gen_ai.client.token.usage", "{token}", "Input and output tokens per request",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        self.requests = c("specd.coordinator.requests", "{request}", "Requests finished, by finish reason or error type")
        self.requests_running = meter.create_up_down_counter(
            "specd.coordinator.requests.running", "{request}", "Requests generating (first token sent, not finished)")
        self.requests_waiting = meter.create_up_down_counter(
            "specd.coordinator.requests.waiting", "{request}", "Requests accepted but waiting for their first token")
        # After vLLM's spec-decode counters (vllm:spec_decode_num_drafts, ...).
        self.num_drafts = c("specd.spec_decode.num_drafts", "{draft}", "Verify steps that carried at least one draft token")
        self.num_draft_tokens = c("specd.spec_decode.num_draft_tokens", "{token}", "Draft tokens sent to the target")
        self.num_accepted_tokens = c("specd.spec_decode.num_accepted_tokens", "{token}", "Draft tokens the target accepted")
        self.num_accepted_tokens_per_pos = c(
            "specd.spec_decode.num_accepted_tokens_per_pos", "{token}",
            "Drafts whose token at `position` (0-based) was accepted")
        # Rollout safety: whether each finished request speculated (`specd.speculation` on/off,
        # `specd.speculation.reason` when off), and every refusal of a draft replica.
        self.speculation_requests = c(
            "specd.coordinator.speculation.requests", "{request}",
            "Finished requests by whether they speculated (specd.speculation on/off) and why not")
        self.speculation_disabled = c(
            "specd.coordinator.speculation.disabled", "{event}",
            "Draft replicas found incompatible at start-up and draft sessions they refused, by reason")
        self.k = h("specd.spec_decode.k", "{token}", "Draft tokens asked for per step (the k chosen)",
                   explicit_bucket_boundaries_advisory=K_BUCKETS)
        self.draft_duration = h("specd.coordinator.draft.duration", "s",
                                "Wall time of one draft call as the coordinator sees it (network included)",
                                explicit_bucket_boundaries_advisory=STEP_BUCKETS)
        self.verify_duration = h("specd.coordinator.verify.duration", "s",
                                 "Wall time of one verify call as the coordinator sees it (network and batching included)",
                                 explicit_bucket_boundaries_advisory=STEP_BUCKETS)
        # Replica failures a request met (coordinator/failover.py): a target session moved to
        # another replica (or the request failed when none was left), a draft session given up.
        self.failovers = c("specd.coordinator.failovers", "{event}",
                           "Replica failures met by requests, by specd.service (target: the session moved; draft: "
                           "the request went on without speculation) and specd.reason")


class TargetMetrics:
    """Forward passes, batching and latency of a target replica (gauges are added by `observe`)."""

    def __init__(self, meter: otel_metrics.Meter):
        self._meter = meter
        self.forward_passes = meter.create_counter(
            "specd.target.forward_passes", "{pass}", "Forward passes run, by kind (prefill or verify)")
        self.batch_size = meter.create_histogram(
            "specd.target.batch.size", "{session}", "Sessions sharing one verify forward pass",
            explicit_bucket_boundaries_advisory=BATCH_BUCKETS)
        self.verify_duration = meter.create_histogram(
            "specd.target.verify.duration", "s", "Time of one batched verify pass (forward and acceptance)",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS)
        self.prefill_duration = meter.create_histogram(
            "specd.target.prefill.duration", "s", "Time of one prefill pass",
            explicit_bucket_boundaries_advisory=REQUEST_DURATION_BUCKETS)
        self.queue_duration = meter.create_histogram(
            "specd.target.queue.duration", "s", "Time a prefill or verify request waited for the model",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS)
        self.prefill_attrs = {"specd.pass": "prefill"}
        self.verify_attrs = {"specd.pass": "verify"}

    def observe(self, open_sessions: Callable[[], int], queue_depth: Callable[[], int]) -> None:
        _gauge(self._meter, "specd.target.sessions.open", "{session}", "Sessions open on this replica", open_sessions)
        _gauge(self._meter, "specd.target.queue.depth", "{request}", "Prefill and verify requests waiting for the model", queue_depth)


class DraftMetrics:
    """Blocks drafted and drafting latency of a draft replica (the gauge is added by `observe`)."""

    def __init__(self, meter: otel_metrics.Meter):
        self._meter = meter
        self.blocks = meter.create_counter("specd.draft.blocks", "{block}", "Draft blocks proposed, by method")
        self.tokens = meter.create_counter("specd.draft.tokens", "{token}", "Draft tokens proposed, by method")
        self.duration = meter.create_histogram(
            "specd.draft.duration", "s", "Time to apply feedback and draft one block, by method",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS)

    def observe(self, open_sessions: Callable[[], int]) -> None:
        _gauge(self._meter, "specd.draft.sessions.open", "{session}", "Sessions open on this replica", open_sessions)


def _gauge(meter: otel_metrics.Meter, name: str, unit: str, description: str, read: Callable[[], int]) -> None:
    def callback(_options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(read())]

    meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)


# --- the Telemetry object --------------------------------------------------------------------


class Telemetry:
    """One service's tracer, meter and instruments, and what to shut down.

    `coordinator`, `target` and `draft` create that service's instruments on first use (on the
    no-op meter they are no-op instruments). Hot paths check `tracing_on` / `metrics_on` first.
    """

    def __init__(self, service: str, tracer_provider: Any = None, meter_provider: Any = None,
                 http_server: Any = None, metrics_port: int | None = None):
        self.service = service
        self.tracer_provider = tracer_provider if tracer_provider is not None else trace.NoOpTracerProvider()
        self.meter_provider = meter_provider if meter_provider is not None else otel_metrics.NoOpMeterProvider()
        self.tracing_on = tracer_provider is not None
        self.metrics_on = meter_provider is not None
        self.tracer = self.tracer_provider.get_tracer(SCOPE)
        self.meter = self.meter_provider.get_meter(SCOPE)
        self.metrics_port = metrics_port  # the bound Prometheus port (port 0 asks for a free one)
        self._http_server = http_server
        self._shut = False

    @property
    def enabled(self) -> bool:
        return self.tracing_on or self.metrics_on

    @functools.cached_property
    def coordinator(self) -> CoordinatorMetrics:
        return CoordinatorMetrics(self.meter)

    @functools.cached_property
    def target(self) -> TargetMetrics:
        return TargetMetrics(self.meter)

    @functools.cached_property
    def draft(self) -> DraftMetrics:
        return DraftMetrics(self.meter)

    @contextlib.contextmanager
    def span(self, name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
             attributes: Mapping[str, Any] | None = None) -> Iterator[trace.Span | None]:
        """A span (child of `parent`, not made current) ended on exit, with an exception recorded
        as an error; yields None when tracing is off. Never attached to the thread's context, so
        it is safe around code that yields (gRPC stream handlers, the engine's generator)."""
        if not self.tracing_on:
            yield None
            return
        span = self.tracer.start_span(name, context=parent, kind=kind, attributes=attributes)
        try:
            yield span
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))
            raise
        finally:
            span.end()

    def server_span(self, name: str, carrier: Any, attributes: Mapping[str, Any] | None = None
                    ) -> contextlib.AbstractContextManager[trace.Span | None]:
        """A SERVER span continuing the trace context a caller sent in `carrier` (see `span`)."""
        if not self.tracing_on:
            return contextlib.nullcontext(None)
        return self.span(name, extract_from(carrier), SpanKind.SERVER, attributes)

    def shutdown(self) -> None:
        """Flushes and stops the exporters and the metrics endpoint. Spans and measurements made
        afterwards are dropped by the SDK."""
        if self._shut:
            return
        self._shut = True
        if self._http_server is not None:
            server, self._http_server = self._http_server, None
            server.shutdown()
            server.server_close()
        for provider in (self.tracer_provider, self.meter_provider):
            stop = getattr(provider, "shutdown", None)
            if stop is not None:
                try:
                    stop()
                except Exception:  # a collector that went away must not fail the shutdown
                    log.warning("telemetry shutdown of %s failed", type(provider).__name__, exc_info=True)


_NOOP: Telemetry | None = None


def noop_telemetry() -> Telemetry:
    """The shared no-op Telemetry: the default of every servicer and service."""
    global _NOOP
    if _NOOP is None:
        _NOOP = Telemetry("noop")
    return _NOOP


def setup_telemetry(service: str, metrics_port: int | None, model: str | None = None, *,
                    metrics_host: str = "127.0.0.1", span_processors: Sequence[Any] = (),
                    metric_readers: Sequence[Any] = (), env: Mapping[str, str] | None = None) -> Telemetry:
    """Builds `service`'s Telemetry: see the module docstring.

    `metrics_port` (None: no endpoint; 0: a free port, reported as `metrics_port`) serves the
    Prometheus text format on `metrics_host`. `span_processors` and `metric_readers` are added to
    the providers (tests pass an InMemorySpanExporter's processor or an InMemoryMetricReader);
    passing any turns that signal on. `model` becomes the resource attribute `specd.model`.
    """
    env = os.environ if env is None else env
    if sdk_disabled(env) and not span_processors and not metric_readers:
        return Telemetry(service)
    want_traces = bool(span_processors) or otlp_traces_enabled(env)
    otlp_metrics = otlp_metrics_enabled(env)
    want_metrics = bool(metric_readers) or metrics_port is not None or otlp_metrics
    if not want_traces and not want_metrics:
        return Telemetry(service)  # no SDK object at all

    from opentelemetry.sdk.resources import Resource

    attributes = {"service.name": f"specd-{service}", "service.namespace": "specd"}
    if model:
        attributes["specd.model"] = model
    resource = Resource.create(attributes)

    tracer_provider = None
    if want_traces:
        from opentelemetry.sdk.trace import TracerProvider

        tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        for processor in span_processors:
            tracer_provider.add_span_processor(processor)
        if otlp_traces_enabled(env):
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))

    meter_provider = None
    http_server = None
    bound_port = None
    if want_metrics:
        from opentelemetry.sdk.metrics import MeterProvider

        readers = list(metric_readers)
        if metrics_port is not None:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry, start_http_server
            from prometheus_client.gc_collector import GCCollector
            from prometheus_client.platform_collector import PlatformCollector
            from prometheus_client.process_collector import ProcessCollector

            # A registry of our own: several services in one process must not collide.
            registry = CollectorRegistry(auto_describe=True)
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
            try:
                prometheus = PrometheusMetricReader(registry=registry)
            except TypeError:  # an exporter without the `registry` argument: move its collector over
                from prometheus_client import REGISTRY

                prometheus = PrometheusMetricReader()
                REGISTRY.unregister(prometheus._collector)
                registry.register(prometheus._collector)
            readers.append(prometheus)
            try:
                http_server, _thread = start_http_server(metrics_port, addr=metrics_host, registry=registry)
            except OSError as exc:
                raise RuntimeError(f"cannot serve metrics on {metrics_host}:{metrics_port}: {exc}") from exc
            bound_port = http_server.server_port
        if otlp_metrics:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    return Telemetry(service, tracer_provider, meter_provider, http_server, bound_port)


__all__ = ["Telemetry", "setup_telemetry", "noop_telemetry", "inject_into", "extract_from", "batch_bucket"]
