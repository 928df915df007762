"""A load generator for the coordinator's gRPC API: closed-loop concurrency or open-loop arrivals.

Closed loop: N client threads, each sending its next request when the last one ends (the
concurrency is fixed, the rate follows the server). Open loop: requests arrive at Poisson times
at a given rate (or a rate that changes over time), whatever the server's speed, which is what
exposes queueing. Every request streams; the client records when each chunk arrived, so time to
first token and inter-token latency are measured where users feel them.

`specd loadgen` prints a summary (TTFT and ITL p50/p99, tokens/s, goodput under an SLO,
acceptance, the k chosen over time) and can write the per-request records as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import grpc

from coordinator.client import CoordinatorClient, build_request
from specd.sampling import SamplingParams
from specd.workloads import Prompt, default_prompts_path, load_prompts


@dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds since the run began."""

    prompt_id: str
    kind: str
    sent: float
    first_token: float | None = None
    done: float | None = None
    tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk, with its token count
    chunk_tokens: list[int] = field(default_factory=list)
    k_per_step: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def latency(self) -> float | None:
        return None if self.done is None else self.done - self.sent

    def inter_token_latencies(self) -> list[float]:
        """Per token after the first: a chunk of n tokens arriving dt after the previous chunk
        counts as n tokens dt / n apart (what a client rendering the stream experiences)."""
        gaps = []
        for i in range(1, len(self.chunk_times)):
            n = max(self.chunk_tokens[i], 1)
            gaps.extend([(self.chunk_times[i] - self.chunk_times[i - 1]) / n] * n)
        return gaps


# --- arrivals --------------------------------------------------------------------------------


def poisson_arrivals(rate: Callable[[float], float] | float, duration_s: float, seed: int = 0,
                     max_rate: float | None = None) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process with rate `rate(t)` per second.

    A time-varying rate is sampled by thinning: candidates at the constant `max_rate` (default:
    the rate's maximum over a fine grid), each kept with probability rate(t) / max_rate.
    """
    fn = rate if callable(rate) else (lambda _t, r=float(rate): r)
    peak = max_rate if max_rate is not None else max(fn(duration_s * i / 1000) for i in range(1001))
    if peak <= 0:
        return []
    rng = random.Random(seed)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return times
        if rng.random() * peak <= fn(t):
            times.append(t)


def step_rate(schedule: Sequence[tuple[float, float]]) -> Callable[[float], float]:
    """A piecewise-constant rate from [(start_s, rate), ...] sorted by start."""
    def rate(t: float) -> float:
        current = 0.0
        for start, r in schedule:
            if t >= start:
                current = r
        return current
    return rate


# --- statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class SLO:
    """A request counts toward goodput when it met both bounds."""

    ttft_s: float = 2.0
    itl_p99_s: float = 0.5


def summarize(records: Sequence[RequestRecord], wall_s: float, slo: SLO = SLO()) -> dict:
    ok = [r for r in records if r.error is None and r.done is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [g for r in ok for g in r.inter_token_latencies()]
    latencies = [r.latency for r in ok if r.latency is not None]
    tokens = sum(r.tokens for r in ok)
    good = [r for r in ok if r.ttft is not None and r.ttft <= slo.ttft_s
            and (percentile(r.inter_token_latencies(), 99) or 0.0) <= slo.itl_p99_s]
    drafted = sum(r.num_draft_tokens for r in ok)
    steps = [k for r in ok for k in r.k_per_step]

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 1)

    return {
        "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "goodput_tokens_per_s": round(sum(r.tokens for r in good) / wall_s, 2) if wall_s > 0 else 0.0,
        "goodput_requests": len(good),
        "ttft_ms_p50": ms(percentile(ttfts, 50)), "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "itl_ms_p50": ms(percentile(itls, 50)), "itl_ms_p99": ms(percentile(itls, 99)),
        "latency_ms_p50": ms(percentile(latencies, 50)), "latency_ms_p99": ms(percentile(latencies, 99)),
        "acceptance_rate": round(sum(r.num_accepted_tokens for r in ok) / drafted, 4) if drafted else 0.0,
        "mean_k": round(sum(steps) / len(steps), 3) if steps else 0.0,
    }


def k_over_time(records: Iterable[RequestRecord], bin_s: float = 2.0) -> list[tuple[float, float, int]]:
    """(bin start, mean k, steps) per time bin. A request's steps are spread evenly between its
    first token and its end: the result message carries the k of each step, not its time."""
    bins: dict[int, list[int]] = {}
    for r in records:
        if r.first_token is None or r.done is None or not r.k_per_step:
            continue
        n = len(r.k_per_step)
        for i, k in enumerate(r.k_per_step):
            t = r.first_token + (r.done - r.first_token) * (i + 0.5) / n
            bins.setdefault(int(t // bin_s), []).append(k)
    return [(b * bin_s, sum(ks) / len(ks), len(ks)) for b, ks in sorted(bins.items())]


# --- running ---------------------------------------------------------------------------------


@dataclass
class LoadSpec:
    """What each request asks for: drafting method and depth ("0" turns speculation off)."""

    method: str | None = None
    depth: str | None = None  # "auto", "4", "schedule:..."; None: the coordinator's default
    pipeline: bool | None = None
    max_tokens: int = 64
    timeout_s: float = 600.0


class LoadGenerator:
    """Sends requests to one coordinator; every method returns the per-request records."""

    def __init__(self, address: str, prompts: Sequence[Prompt], encode: Callable[[Prompt], list[int]] | None = None):
        if not prompts:
            raise ValueError("the load generator needs at least one prompt")
        self.address = address
        self.prompts = list(prompts)
        self.encode = encode
        self._client = CoordinatorClient(address)

    def close(self) -> None:
        self._client.close()

    def _one(self, prompt: Prompt, spec: LoadSpec, origin: float) -> RequestRecord:
        text: str | list[int] = self.encode(prompt) if self.encode is not None else prompt.prompt
        params = SamplingParams(max_tokens=min(prompt.max_tokens, spec.max_tokens))
        request = build_request(text, params, chat=prompt.chat and self.encode is None, method=spec.method,
                                k=spec.depth, pipeline=spec.pipeline)
        record = RequestRecord(prompt.id, prompt.kind, time.perf_counter() - origin)
        try:
            for msg in self._client.stream(request, timeout=spec.timeout_s):
                now = time.perf_counter() - origin
                if msg.HasField("chunk"):
                    if not msg.chunk.token_ids:
                        continue
                    if record.first_token is None:
                        record.first_token = now
                    record.chunk_times.append(now)
                    record.chunk_tokens.append(len(msg.chunk.token_ids))
                else:
                    r = msg.result
                    record.done = now
                    record.tokens = r.usage.completion_tokens
                    record.k_per_step = list(r.stats.k_per_step)
                    record.num_draft_tokens = r.stats.num_draft_tokens
                    record.num_accepted_tokens = r.stats.num_accepted_tokens
        except grpc.RpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
        return record

    def closed_loop(self, concurrency: int, requests: int, spec: LoadSpec) -> tuple[list[RequestRecord], float]:
        """`requests` requests (cycling the prompts) through `concurrency` client threads."""
        queue = [self.prompts[i % len(self.prompts)] for i in range(requests)]
        lock = threading.Lock()
        records: list[RequestRecord] = []
        origin = time.perf_counter()

        def worker() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    prompt = queue.pop(0)
                rec = self._one(prompt, spec, origin)
                with lock:
                    records.append(rec)

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return records, time.perf_counter() - origin

    def open_loop(self, arrivals: Sequence[float], spec: LoadSpec, max_in_flight: int = 64) -> tuple[list[RequestRecord], float]:
        """One request at each arrival time (seconds from now), cycling the prompts."""
        origin = time.perf_counter()
        with ThreadPoolExecutor(max_in_flight) as pool:
            futures = []
            for i, at in enumerate(arrivals):
                delay = at - (time.perf_counter() - origin)
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(self._one, self.prompts[i % len(self.prompts)], spec, origin))
            records = [f.result() for f in futures]
        for rec, at in zip(records, arrivals):
            rec.sent = at  # latency from the scheduled arrival: a late send is the generator's, not hidden
        return records, time.perf_counter() - origin


# --- CLI -------------------------------------------------------------------------------------


def add_loadgen_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50050", help="the coordinator (default 127.0.0.1:50050)")
    p.add_argument("--prompts", default=None, help="prompts file (default: the bundled workload prompts)")
    p.add_argument("--kinds", default=None, help="comma list of workload kinds to keep")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="closed loop: this many clients (default 4)")
    mode.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals at this many requests/s")
    p.add_argument("--requests", type=int, default=32, help="closed loop: requests in all (default 32)")
    p.add_argument("--duration", type=float, default=60.0, help="open loop: seconds of arrivals (default 60)")
    p.add_argument("--method", default=None, choices=["none", "ngram", "suffix", "draft_model"])
    p.add_argument("--k", default=None, help="depth: auto, a fixed k, schedule:...; default: the coordinator's")
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=500.0, help="p99 inter-token latency bound per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="write the summary and per-request records")


def run_loadgen(args: argparse.Namespace) -> int:
    prompts = load_prompts(args.prompts or default_prompts_path())
    if args.kinds:
        prompts = [p for p in prompts if p.kind in set(args.kinds.split(","))]
    if not prompts:
        print("error: no prompts left after --kinds", file=sys.stderr)
        return 2
    spec = LoadSpec(args.method, args.k, args.pipeline, args.max_tokens)
    gen = LoadGenerator(args.address, prompts)
    try:
        if args.rate is not None:
            arrivals = poisson_arrivals(args.rate, args.duration, args.seed)
            print(f"open loop: {len(arrivals)} arrivals over {args.duration:.0f} s at {args.rate}/s", file=sys.stderr)
            records, wall = gen.open_loop(arrivals, spec)
        else:
            concurrency = args.concurrency or 4
            print(f"closed loop: {args.requests} requests, {concurrency} clients", file=sys.stderr)
            records, wall = gen.closed_loop(concurrency, args.requests, spec)
    finally:
        gen.close()
    summary = summarize(records, wall, SLO(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000))
    summary["k_over_time"] = [{"t": t, "mean_k": round(k, 3), "steps": n} for t, k, n in k_over_time(records)]
    for key, value in summary.items():
        if key != "k_over_time":
            print(f"{key:>22}: {value}")
    print("k over time: " + " ".join(f"{row['t']:.0f}s:{row['mean_k']:.1f}" for row in summary["k_over_time"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "records": [asdict(r) for r in records]}, indent=1))
    return 0 if summary["errors"] == 0 else 1
