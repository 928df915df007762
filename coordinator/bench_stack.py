"""`specd bench-stack`: the distributed stack against the embedded engine and transformers.

Starts target, draft and coordinator as separate processes on loopback, then in every run:
transformers' target-only generate() in this process, the embedded engine (none, ngram), the
stack over gRPC streaming at concurrency 1 (none, ngram) and at concurrency N (N client threads
sharing the prompts), and the OpenAI-compatible HTTP API (SSE streaming, ngram, concurrency 1).
Tokens/s per system is tokens over wall seconds of the run's phase; the report gives medians over
runs, ratios against target-only measured in the same run, the per-step cost of the two RPC hops,
and each process's peak memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from coordinator.bench import HF_TARGET, hf_systems, specd_system
from coordinator.client import CoordinatorClient, build_request
from coordinator.engine import SpeculativeEngine
from draft_service.proposers import make_proposer
from specd.launcher import free_port, start_stack
from specd.models import load_model
from specd.sampling import SamplingParams
from specd.workloads import Prompt, default_prompts_path, load_prompts
from target_service.verifier import TargetModel


def add_bench_stack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=None)
    p.add_argument("--kinds", default=None, help="comma list of workload kinds to keep")
    p.add_argument("--max-tokens", type=int, default=96, help="cap on every prompt's max_tokens (default 96)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", default="bench-results/stack")


def _stack_phase(address: str, prompts: list[Prompt], encoded: dict[str, list[int]], method: str, k: int,
                 concurrency: int) -> tuple[int, float, list[dict]]:
    """Run every prompt through the coordinator with `concurrency` client threads; (tokens, seconds, per-request)."""

    def one(p: Prompt) -> dict:
        with CoordinatorClient(address) as c:
            request = build_request(encoded[p.id], SamplingParams(max_tokens=p.max_tokens), method=method, k=k)
            r = [m for m in c.stream(request, timeout=600) if m.HasField("result")][0].result
        steps = max(r.stats.target_forward_passes - 1, 1)
        return {"id": p.id, "kind": p.kind, "ids": list(r.token_ids), "tokens": r.usage.completion_tokens,
                "rpc_overhead_ms_per_step": r.timings.rpc_overhead_ms / steps}

    # Enough requests to keep `concurrency` sessions in flight for two waves, cycling the prompts.
    requests = [prompts[i % len(prompts)] for i in range(max(len(prompts), 2 * concurrency if concurrency > 1 else 0))]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, requests))
    seconds = time.perf_counter() - start
    return sum(r["tokens"] for r in results), seconds, results


def _http_phase(http_port: int, prompts: list[Prompt], encoded: dict[str, list[int]], method: str, k: int) -> tuple[int, float, list[dict]]:
    """The same requests streamed through the OpenAI-compatible HTTP API (server-sent events)."""
    import httpx

    url = f"http://127.0.0.1:{http_port}/v1/completions"
    results = []
    start = time.perf_counter()
    with httpx.Client(timeout=600) as http:
        for p in prompts:
            body = {"prompt": encoded[p.id], "max_tokens": p.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "speculative": {"method": method, "k": k}}
            tokens = 0
            with http.stream("POST", url, json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            results.append({"id": p.id, "tokens": tokens})
    return sum(r["tokens"] for r in results), time.perf_counter() - start, results


def run_bench_stack(args: argparse.Namespace) -> int:
    prompts = load_prompts(args.prompts or default_prompts_path())
    if args.kinds:
        prompts = [p for p in prompts if p.kind in set(args.kinds.split(","))]
    prompts = [p.with_max_tokens(min(p.max_tokens, args.max_tokens)) for p in prompts]
    target = load_model()
    encoded = {p.id: target.encode(p.prompt, chat=p.chat) for p in prompts}
    local = hf_systems(target, [HF_TARGET], 10)
    verifier = TargetModel(target)
    local.append(specd_system("embedded_none", SpeculativeEngine(verifier, None, eos_token_ids=target.eos_token_ids)))
    local.append(specd_system(f"embedded_ngram_k{args.k}", SpeculativeEngine(verifier, make_proposer("ngram"), k=args.k,
                                                                              eos_token_ids=target.eos_token_ids)))
    log_dir = Path(tempfile.mkdtemp(prefix="specd-bench-stack-"))
    print(f"starting the stack (logs in {log_dir})", file=sys.stderr, flush=True)
    stack = start_stack(log_dir, k=args.k, http_port=free_port())
    tps: dict[str, list[float]] = defaultdict(list)
    ratio: dict[str, list[float]] = defaultdict(list)
    overhead: list[float] = []
    exact = True
    try:
        for system in local:  # warm-up, untimed
            system.run(prompts[0].with_max_tokens(8), encoded[prompts[0].id])
        _stack_phase(stack.coordinator.address, prompts[:2], encoded, "none", 0, 1)
        for run in range(args.runs):
            run_tps: dict[str, float] = {}
            reference: dict[str, list[int]] = {}
            for system in local:
                start, tokens = time.perf_counter(), 0
                for p in prompts:
                    ids, _ = system.run(p, encoded[p.id])
                    tokens += len(ids)
                    if system.name == HF_TARGET:
                        reference[p.id] = ids
                    elif ids != reference[p.id]:
                        exact = False
                run_tps[system.name] = tokens / (time.perf_counter() - start)
                print(f"run {run + 1}: {system.name:<24} {run_tps[system.name]:6.1f} tok/s", file=sys.stderr, flush=True)
            for method, k in (("none", 0), ("ngram", args.k)):
                for conc in (1, args.concurrency):
                    name = f"stack_{method}" + (f"_k{k}" if k else "") + f"_c{conc}"
                    tokens, seconds, results = _stack_phase(stack.coordinator.address, prompts, encoded, method, k, conc)
                    exact &= all(r["ids"] == reference[r["id"]] for r in results)
                    if conc == 1:
                        overhead.extend(r["rpc_overhead_ms_per_step"] for r in results)
                    run_tps[name] = tokens / seconds
                    print(f"run {run + 1}: {name:<24} {run_tps[name]:6.1f} tok/s", file=sys.stderr, flush=True)
            tokens, seconds, _ = _http_phase(stack.http_port, prompts, encoded, "ngram", args.k)  # type: ignore[arg-type]
            run_tps[f"http_ngram_k{args.k}_c1"] = tokens / seconds
            print(f"run {run + 1}: {'http_ngram_k%d_c1' % args.k:<24} {run_tps[f'http_ngram_k{args.k}_c1']:6.1f} tok/s", file=sys.stderr, flush=True)
            ratio["http_vs_grpc_streaming_ngram_c1"].append(run_tps[f"http_ngram_k{args.k}_c1"] / run_tps[f"stack_ngram_k{args.k}_c1"])
            for name, value in run_tps.items():
                tps[name].append(value)
                ratio[name].append(value / run_tps[HF_TARGET])
            for method_name in ("stack_none", f"stack_ngram_k{args.k}"):
                ratio[f"{method_name}_c{args.concurrency}_vs_c1"].append(
                    run_tps[f"{method_name}_c{args.concurrency}"] / run_tps[f"{method_name}_c1"])
        memory = {s.name: round(s.peak_rss_mb(), 1) for s in (stack.target, stack.draft, stack.coordinator)}
    finally:
        stack.stop()
    memory["bench process (transformers + embedded engine)"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    report = {
        "tokens_per_s": {n: round(statistics.median(v), 2) for n, v in tps.items()},
        "ratios": {n: round(statistics.median(v), 3) for n, v in ratio.items()},
        "rpc_overhead_ms_per_step_median": round(statistics.median(overhead), 3) if overhead else None,
        "peak_rss_mb": memory,
        "exact": exact,
        "runs": args.runs,
        "prompts": len(prompts),
        "max_tokens_cap": args.max_tokens,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-stack.json").write_text(json.dumps(report, indent=1))
    md = render(report)
    (out / "bench-stack.md").write_text(md)
    print(md)
    return 0 if exact else 1


def render(report: dict) -> str:
    lines = ["| system | tokens/s (median) | vs transformers target-only (same run) |", "|---|---|---|"]
    for name, value in report["tokens_per_s"].items():
        lines.append(f"| {name} | {value:.1f} | {report['ratios'].get(name, 0):.2f} |")
    lines.append("")
    for name, value in report["ratios"].items():
        if "_vs_" in name:
            lines.append(f"- {name}: {value:.2f}x")
    lines.append(f"- RPC overhead per decoding step (both hops, median over requests): {report['rpc_overhead_ms_per_step_median']} ms")
    lines.append("- peak RSS (MB): " + ", ".join(f"{k} {v}" for k, v in report["peak_rss_mb"].items()))
    lines.append(f"- outputs identical to target-only: {report['exact']}; {report['prompts']} prompts, max_tokens capped at "
                 f"{report['max_tokens_cap']}, {report['runs']} runs")
    return "\n".join(lines) + "\n"
