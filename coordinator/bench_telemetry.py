"""`specd bench-telemetry`: tokens/s of the stack with telemetry on against off, in the same run.

Two stacks run side by side: one with telemetry off (the default), one with every service
exporting Prometheus metrics and OTLP traces (to a minimal OTLP trace sink in this process, so
the exporters do their full work). Phases alternate within each run (off, on, off, on), and the
report gives each phase's tokens/s median and the median of the per-run on/off ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from coordinator.bench_stack import _stack_phase
from specd.launcher import start_stack
from specd.models import encode_chat, load_tokenizer
from specd.workloads import default_prompts_path, load_prompts


class _TraceSink(trace_service_pb2_grpc.TraceServiceServicer):
    """Accepts OTLP trace exports and counts spans (a stand-in for a collector)."""

    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def add_bench_telemetry_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=None)
    p.add_argument("--kinds", default="chat,code_edit")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--out", default="bench-results/telemetry")


def run_bench_telemetry(args: argparse.Namespace) -> int:
    prompts = [p for p in load_prompts(args.prompts or default_prompts_path()) if p.kind in set(args.kinds.split(","))]
    prompts = [p.with_max_tokens(min(p.max_tokens, args.max_tokens)) for p in prompts]
    tokenizer = load_tokenizer()
    encoded = {p.id: encode_chat(tokenizer, [{"role": "user", "content": p.prompt}]) if p.chat
               else list(tokenizer(p.prompt)["input_ids"]) for p in prompts}
    sink = _TraceSink()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    sink_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    log_dir = Path(tempfile.mkdtemp(prefix="specd-bench-telemetry-"))
    print(f"starting two stacks (logs in {log_dir})", file=sys.stderr, flush=True)
    (log_dir / "off").mkdir()
    (log_dir / "on").mkdir()
    off = start_stack(log_dir / "off", k=args.k)
    saved = dict(os.environ)
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{sink_port}"
    os.environ["OTEL_EXPORTER_OTLP_TRACES_INSECURE"] = "true"
    try:
        on = start_stack(log_dir / "on", k=args.k,
                         metrics_ports={"target": 0, "draft": 0, "coordinator": 0})
    finally:
        os.environ.clear()
        os.environ.update(saved)
    tps: dict[str, list[float]] = defaultdict(list)
    ratios: dict[str, list[float]] = defaultdict(list)
    try:
        for stack in (off, on):  # warm-up
            _stack_phase(stack.coordinator.address, prompts[:1], encoded, "none", 0, 1)
        for run in range(args.runs):
            for method, k in (("none", 0), ("ngram", args.k)):
                values = {}
                for label, stack in (("off", off), ("on", on)):
                    tokens, seconds, _ = _stack_phase(stack.coordinator.address, prompts, encoded, method, k, 1)
                    values[label] = tokens / seconds
                    tps[f"{method}_{label}"].append(values[label])
                    print(f"run {run + 1}: {method:<6} telemetry {label:<3} {values[label]:6.1f} tok/s", file=sys.stderr, flush=True)
                ratios[method].append(values["on"] / values["off"])
    finally:
        on.stop()
        off.stop()
        time.sleep(1)
        server.stop(0)
    report = {
        "tokens_per_s": {n: round(statistics.median(v), 2) for n, v in tps.items()},
        "on_vs_off": {n: round(statistics.median(v), 3) for n, v in ratios.items()},
        "spans_exported": sink.spans,
        "runs": args.runs,
        "prompts": len(prompts),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-telemetry.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0
