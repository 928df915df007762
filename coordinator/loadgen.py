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
    chunk_k: list[int | None] = field(default_factory=list)  # the k of the step behind each chunk, if the server says
    k_per_step: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None
    cut: bool = False  # cancelled by the generator when a timed run ended (not an error)

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


def window_tokens(records: Iterable[RequestRecord], start: float, end: float) -> int:
    """Tokens whose chunks arrived in (start, end], whether or not their request finished."""
    return sum(n for r in records for t, n in zip(r.chunk_times, r.chunk_tokens) if start < t <= end)


def held_window(ended: Sequence[float], lead_in: int, now: float) -> tuple[float, float]:
    """A held loop's window from its requests' end times: from the `lead_in`-th end (0: the
    start) to the last (`now` where none ended). Ends recorded at nearly one moment (requests in
    step end within the same few milliseconds) can be appended out of order, so they are sorted."""
    ends = sorted(ended)
    if not ends:
        return 0.0, now
    begin = ends[lead_in - 1] if 0 < lead_in <= len(ends) else 0.0
    return begin, ends[-1]


def summarize(records: Sequence[RequestRecord], wall_s: float, slo: SLO = SLO(),
              window: tuple[float, float] | None = None) -> dict:
    """The run's figures. With `window` (a timed closed loop's steady span, `closed_loop_for`),
    tokens/s counts the tokens that arrived in it over its length, cut requests' included, and so
    do time to first token and inter-token latency; request latency, goodput, acceptance and k
    come from the requests that finished."""
    ok = [r for r in records if r.error is None and r.done is not None]
    cut = [r for r in records if r.cut and r.error is None and r.done is None]
    streamed = ok + cut  # a cut request's first token and gaps are as real as a finished one's
    ttfts = [r.ttft for r in streamed if r.ttft is not None]
    itls = [g for r in streamed for g in r.inter_token_latencies()]
    latencies = [r.latency for r in ok if r.latency is not None]
    tokens = sum(r.tokens for r in ok)
    good = [r for r in ok if r.ttft is not None and r.ttft <= slo.ttft_s
            and (percentile(r.inter_token_latencies(), 99) or 0.0) <= slo.itl_p99_s]
    drafted = sum(r.num_draft_tokens for r in ok)
    steps = [k for r in ok for k in r.k_per_step] + [k for r in cut for k in _streamed_steps(r)]

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 1)

    if window is not None and window[1] > window[0]:
        tokens_per_s = window_tokens(records, *window) / (window[1] - window[0])
    else:
        tokens_per_s = tokens / wall_s if wall_s > 0 else 0.0
    return {
        "requests": len(records), "completed": len(ok), "cut": len(cut), "errors": len(records) - len(ok) - len(cut),
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens_per_s, 2),
        "goodput_tokens_per_s": round(sum(r.tokens for r in good) / wall_s, 2) if wall_s > 0 else 0.0,
        "goodput_requests": len(good),
        "ttft_ms_p50": ms(percentile(ttfts, 50)), "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "itl_ms_p50": ms(percentile(itls, 50)), "itl_ms_p99": ms(percentile(itls, 99)),
        "latency_ms_p50": ms(percentile(latencies, 50)), "latency_ms_p99": ms(percentile(latencies, 99)),
        "acceptance_rate": round(sum(r.num_accepted_tokens for r in ok) / drafted, 4) if drafted else 0.0,
        "mean_k": round(sum(steps) / len(steps), 3) if steps else 0.0,
    }


def _streamed_steps(r: RequestRecord) -> list[int]:
    """The k of each verify step whose chunk arrived, where the server said (a cut request has no
    result message to list them)."""
    return [k for k in r.chunk_k if k is not None]


def k_over_time(records: Iterable[RequestRecord], bin_s: float = 2.0) -> list[tuple[float, float, int]]:
    """(bin start, mean k, steps) per time bin. Each step at the arrival of its chunk, where the
    server says each chunk's k; otherwise (an older server) a finished request's steps are spread
    evenly between its first token and its end."""
    bins: dict[int, list[int]] = {}
    for r in records:
        if any(k is not None for k in r.chunk_k):
            for t, k in zip(r.chunk_times, r.chunk_k):
                if k is not None:
                    bins.setdefault(int(t // bin_s), []).append(k)
            continue
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

    @classmethod
    def for_depth(cls, method: str, depth: str, max_tokens: int) -> "LoadSpec":
        """A bench configuration: `method` at `depth`, or no drafting at all for depth "0"."""
        return cls(method if depth != "0" else "none", depth, max_tokens=max_tokens)


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

    def _one(self, prompt: Prompt, spec: LoadSpec, origin: float, calls: "_OpenCalls | None" = None,
             on_first_token: Callable[[], None] | None = None) -> RequestRecord:
        """One streamed request. `calls`: a timed run's open streams (this one joins them, so the
        run can cancel it); `on_first_token`: called once, at its first token or when it ends
        without one."""
        text: str | list[int] = self.encode(prompt) if self.encode is not None else prompt.prompt
        params = SamplingParams(max_tokens=min(prompt.max_tokens, spec.max_tokens))
        request = build_request(text, params, chat=prompt.chat and self.encode is None, method=spec.method,
                                k=spec.depth, pipeline=spec.pipeline)
        record = RequestRecord(prompt.id, prompt.kind, time.perf_counter() - origin)
        call = self._client.stream(request, timeout=spec.timeout_s)
        try:
            if calls is not None and not calls.open(call):  # the run ended as this one was sent
                call.cancel()  # type: ignore[attr-defined]
                record.cut = True
                return record
            for msg in call:
                now = time.perf_counter() - origin
                if msg.HasField("chunk"):
                    if not msg.chunk.token_ids:
                        continue
                    if record.first_token is None:
                        record.first_token = now
                        if on_first_token is not None:
                            on_first_token()
                            on_first_token = None
                    record.chunk_times.append(now)
                    record.chunk_tokens.append(len(msg.chunk.token_ids))
                    record.chunk_k.append(msg.chunk.k if msg.chunk.HasField("k") else None)
                else:
                    r = msg.result
                    record.done = now
                    record.tokens = r.usage.completion_tokens
                    record.k_per_step = list(r.stats.k_per_step)
                    record.num_draft_tokens = r.stats.num_draft_tokens
                    record.num_accepted_tokens = r.stats.num_accepted_tokens
        except grpc.RpcError as exc:
            if calls is not None and calls.stopped and exc.code() == grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                record.cut = True
            else:
                record.error = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
        finally:
            if calls is not None:
                calls.close(call)
            if on_first_token is not None and record.first_token is None:
                on_first_token()
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

    def closed_loop_for(self, concurrency: int, window_s: float, spec: LoadSpec,
                        stagger_s: float = 0.0) -> tuple[list[RequestRecord], tuple[float, float]]:
        """A closed loop held at `concurrency` through a steady window of `window_s` seconds.

        Each client thread sends the next prompt (cycling) as soon as its last request ends;
        thread i sends its first one i * `stagger_s` seconds in. The window opens when every
        thread's first request has had its first token (the opening prefills are over: 16 long
        prompts take seconds to prefill) and closes `window_s` later; then the streams still open
        are cancelled and their records marked `cut`. Returns the records and the window (seconds
        since the start).

        Why stagger: requests of one length started together stay in step, wave after wave, and
        each wave's prefills stall every session's decoding at once; how many of those stalls a
        window holds can then swing its tokens/s (speculation off on extract at 16 sessions, 12 s
        windows, read 77.3, 70.7 and 81.3 tok/s in one sequence). Started apart, requests keep their offsets, and prefills are spread
        through the window as a server with independent clients sees them.

        Within the window `concurrency` requests are always in flight, which a fixed batch of
        requests cannot give: a burst of c requests drains one by one, spends much of its time
        below c, and its tokens/s is the makespan of its slowest request. Tokens/s over the window
        (`summarize(..., window=...)`) is the throughput of a server kept at this concurrency.
        """
        if concurrency < 1 or window_s <= 0:
            raise ValueError(f"need concurrency >= 1 and window_s > 0, got {concurrency}, {window_s}")
        calls = _OpenCalls()
        lock = threading.Lock()
        records: list[RequestRecord] = []
        started = threading.Semaphore(0)  # released at each thread's first token (or first failure)
        sent = 0
        origin = time.perf_counter()

        def worker(delay: float) -> None:
            nonlocal sent
            first: Callable[[], None] | None = started.release
            time.sleep(delay)
            while not calls.stopped:
                with lock:
                    prompt = self.prompts[sent % len(self.prompts)]
                    sent += 1
                rec = self._one(prompt, spec, origin, calls, on_first_token=first)
                first = None
                with lock:
                    records.append(rec)

        threads = [threading.Thread(target=worker, args=(i * stagger_s,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        for _ in threads:
            started.acquire(timeout=spec.timeout_s + concurrency * stagger_s)
        begin = time.perf_counter() - origin
        time.sleep(window_s)
        calls.stop()
        for t in threads:
            t.join()
        return records, (begin, begin + window_s)

    def closed_loop_held(self, concurrency: int, finished: int, spec: LoadSpec, lead_in: int = 0
                         ) -> tuple[list[RequestRecord], tuple[float, float]]:
        """Fixed work at a held concurrency: `concurrency` client threads send requests (cycling
        the prompts) until `lead_in` + `finished` requests have ended; then the streams still open
        are cancelled and their records marked `cut`. Returns the records and the window, from the
        `lead_in`-th request's end (0: the start) to the last one's, for `summarize(...,
        window=...)`: tokens/s counts every token streamed in it, cut requests' included.

        Why not `closed_loop` (the same requests, then stop): a burst of c requests drains one by
        one, and its tokens/s is its slowest request's makespan. Speculation off runs requests of
        one length in step, so its bursts end together; with speculation the requests of a burst
        end at different steps and the last ones run in passes of a few rows: at 16 sessions, a
        quarter of a cell's passes were that drain (docs/benchmarks.md). Held, the server runs at
        `concurrency` to the end, as a server with that many clients does.

        Why a lead-in (`lead_in` = `concurrency` in the bench): a window from the start opens with
        every client at a new request and closes at a request's end. Speculation off keeps requests
        of one length in step, so its close finds every client at a new request again (its last
        wave just ended together); with speculation the requests fall out of step, and the close
        finds up to c - 1 of them started, prefilled and barely streamed: prefill time spent, its
        tokens not yet come. At 16 sessions off ran 53-59 prefills in 48 requests and every
        drafting configuration 62-63. Opened at a request's end too, after the opening wave, the
        window starts and ends alike whether the sessions run in step or apart: it holds
        `finished` requests' work, tokens arriving in it over its length."""
        if concurrency < 1 or finished < 1 or lead_in < 0:
            raise ValueError(f"need concurrency >= 1, finished >= 1 and lead_in >= 0, got "
                             f"{concurrency}, {finished}, {lead_in}")
        calls = _OpenCalls()
        lock = threading.Lock()
        records: list[RequestRecord] = []
        sent = 0
        ended: list[float] = []  # when each request that ended did
        stop_at = lead_in + finished
        origin = time.perf_counter()

        def worker() -> None:
            nonlocal sent
            while not calls.stopped:
                with lock:
                    prompt = self.prompts[sent % len(self.prompts)]
                    sent += 1
                rec = self._one(prompt, spec, origin, calls)
                with lock:
                    records.append(rec)
                    counts = not rec.cut and len(ended) < stop_at
                    if counts:
                        ended.append(rec.done if rec.done is not None else time.perf_counter() - origin)
                if counts and len(ended) == stop_at:
                    calls.stop()

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return records, held_window(ended, lead_in, time.perf_counter() - origin)

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


class _OpenCalls:
    """The streams a timed closed loop has open, so that it can cancel them all when time is up."""

    def __init__(self) -> None:
        self._calls: set = set()
        self._lock = threading.Lock()
        self.stopped = False

    def open(self, call: object) -> bool:
        """Registers a call; False once the run has stopped (the caller cancels it)."""
        with self._lock:
            if self.stopped:
                return False
            self._calls.add(call)
            return True

    def close(self, call: object) -> None:
        with self._lock:
            self._calls.discard(call)

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()  # type: ignore[attr-defined]


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
