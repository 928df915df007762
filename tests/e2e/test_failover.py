"""Failover and draining with real processes, killed for real (coordinator/failover.py).

Three target replicas A, B, C and a draft D (ngram), on the default model. A coordinator process
serves A and B with D. Every stream asks for exactly MAX_TOKENS greedy tokens (ignore_eos), so
its reference is transformers' target-only greedy output of that length, and every stream's
chunks must concatenate to exactly its final token ids (nothing lost or repeated).

1. SIGKILL the draft in the middle of 8 concurrent streams: all 8 complete, exact (the draft
   failures are counted); a draft restarted on the same port brings speculation back.
2. SIGKILL target A in the middle of 8 concurrent streams: all 8 complete, exact (the streams on
   A moved to B).
3. Draining: SIGTERM target C (grace 3 s) with sessions open on it: new sessions go to B, a
   session that finishes within the grace does so on C, one still open when the grace ends is
   moved to B by the failover; all exact.
4. No target left: SIGKILL B under a stream (A is gone too): the stream fails with UNAVAILABLE and
   a message saying so.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from coordinator.client import CoordinatorClient, build_request
from coordinator.replicas import PoolOptions, ReplicaPool
from coordinator.service import GenerationService, PromptInput
from specd.kv import forward, new_cache
from specd.launcher import Service, start_service
from specd.sampling import SamplingParams
from tests.conftest import hf_greedy
from tests.e2e.test_metrics import Scrape

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
STREAMS = 8
GRACE_C = 3.0
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@dataclass
class Fleet:
    a: Service
    b: Service
    c: Service
    d: Service
    coordinator: Service
    logs: object
    extra: list[Service] = field(default_factory=list)

    def all(self) -> list[Service]:
        return [self.coordinator, self.a, self.b, self.c, self.d, *self.extra]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    logs = tmp_path_factory.mktemp("failover-logs")
    specs = [("target", ["--grace-seconds", "30"]), ("target", ["--grace-seconds", "30"]),
             ("target", ["--grace-seconds", str(GRACE_C)]), ("draft", ["--method", "ngram"])]
    with ThreadPoolExecutor(len(specs)) as ex:
        a, b, c, d = ex.map(lambda s: start_service(s[0], s[1], logs), specs)
    coordinator = start_service("coordinator", [
        "--target", f"{a.address},{b.address}", "--draft", d.address, "--method", "ngram", "--k", "4",
        "--health-check-interval-s", "0.2"], logs, metrics_port=0)
    f = Fleet(a, b, c, d, coordinator, logs)
    yield f
    for s in f.all():
        s.stop(signal.SIGKILL)


def greedy_ignoring_eos(model, ids: list[int], n: int) -> list[int]:
    """Target-only greedy decoding (transformers' model, its KV cache), n tokens, EOS an ordinary
    token as the requests' ignore_eos asks (`generate` with min_new_tokens would suppress it)."""
    cache = new_cache(model.model)
    out: list[int] = []
    step = list(ids)
    for _ in range(n):
        out.append(int(forward(model.model, step, cache, keep_last=1)[-1].argmax()))
        step = out[-1:]
    return out


@pytest.fixture(scope="module")
def cases(target, workload_prompts) -> list[tuple[list[int], list[int]]]:
    out = []
    for p in workload_prompts[:STREAMS]:
        ids = target.encode(p.prompt, chat=p.chat)
        out.append((ids, greedy_ignoring_eos(target, ids, MAX_TOKENS)))
    ids, ref = next((ids, ref) for ids, ref in out if not set(ref) & set(target.eos_token_ids))
    assert ref == hf_greedy(target, ids, MAX_TOKENS)  # where the two references can agree, they do
    return out


@dataclass
class Stream:
    chunks: list[list[int]] = field(default_factory=list)
    result: object = None
    error: BaseException | None = None
    finished_at: float = 0.0

    @property
    def streamed(self) -> list[int]:
        return [t for c in self.chunks for t in c]


def streams_with_fault(coordinator: Service, cases, fault) -> tuple[list[Stream], float]:
    """Runs one stream per case through the coordinator; once every stream has its first chunk,
    runs `fault()`; returns the streams and the time of the fault."""
    streams = [Stream() for _ in cases]
    first = threading.Semaphore(0)

    def run(i: int) -> None:
        s = streams[i]
        try:
            with CoordinatorClient(coordinator.address) as client:
                for msg in client.stream(build_request(cases[i][0], PARAMS), timeout=180):
                    if msg.HasField("chunk"):
                        s.chunks.append(list(msg.chunk.token_ids))
                        if len(s.chunks) == 1:
                            first.release()
                    else:
                        s.result = msg.result
        except BaseException as exc:  # reported by the assertions
            s.error = exc
            first.release()
        s.finished_at = time.monotonic()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for _ in threads:
        assert first.acquire(timeout=120), "a stream got no first chunk"
    fault_at = time.monotonic()
    fault()
    for t in threads:
        t.join(180)
    return streams, fault_at


def check_exact(streams: list[Stream], cases, fault_at: float) -> int:
    """Every stream complete and exact; returns how many were still running when the fault hit."""
    for i, (s, (_, ref)) in enumerate(zip(streams, cases)):
        assert s.error is None, f"stream {i} failed: {s.error!r}"
        assert s.result is not None, f"stream {i} has no result"
        assert s.streamed == list(s.result.token_ids), f"stream {i}: chunks lost or repeated"
        assert s.streamed == ref, f"stream {i} differs from target-only greedy decoding"
    return sum(s.finished_at > fault_at for s in streams)


def failovers(coordinator: Service, service: str) -> float:
    return Scrape(coordinator.metrics_url).total("specd_coordinator_failovers_total", specd_service=service)


def test_draft_killed_mid_stream(fleet, cases):
    before = failovers(fleet.coordinator, "draft")
    streams, fault_at = streams_with_fault(fleet.coordinator, cases, lambda: fleet.d.proc.kill())
    running = check_exact(streams, cases, fault_at)
    assert running >= STREAMS // 2, f"only {running} streams were still running when the draft died"
    assert failovers(fleet.coordinator, "draft") - before >= 1
    print(f"draft killed: {STREAMS} streams, {running} running at the kill, 0 failures")
    fleet.d.proc.wait()
    # A draft back on the same port: new requests speculate again.
    fleet.d = start_service("draft", ["--method", "ngram"], fleet.logs, port=fleet.d.port)
    repetitive = build_request("1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4,", SamplingParams(max_tokens=12))
    deadline = time.monotonic() + 30
    with CoordinatorClient(fleet.coordinator.address) as client:
        while client.generate(repetitive, timeout=60).stats.num_drafts == 0:
            assert time.monotonic() < deadline, "speculation did not resume after the draft came back"
            time.sleep(0.5)


def test_target_killed_mid_stream(fleet, cases):
    before = failovers(fleet.coordinator, "target")
    streams, fault_at = streams_with_fault(fleet.coordinator, cases, lambda: fleet.a.proc.kill())
    running = check_exact(streams, cases, fault_at)
    moved = failovers(fleet.coordinator, "target") - before
    assert running >= STREAMS // 2, f"only {running} streams were still running when the target died"
    assert moved >= 1, "no stream failed over"
    print(f"target killed: {STREAMS} streams, {running} running at the kill, {moved:.0f} moved, 0 failures")


def test_draining_target_finishes_or_moves_its_sessions(fleet, cases, target):
    """In-process pools over the real processes B and C, so each session's replica is known."""
    opts = PoolOptions(health_interval_s=0.2, health_timeout_s=0.5)
    targets = ReplicaPool([fleet.b.address, fleet.c.address], opts, name="target")
    drafts = ReplicaPool([fleet.d.address], opts, name="draft")
    service = GenerationService(targets, drafts, target.tokenizer, target.name, frozenset(target.eos_token_ids),
                                method="ngram", k=4)

    def totals() -> dict[str, int]:
        return {s["address"]: s["sessions_total"] for s in targets.snapshot()}

    def open_request(ids):
        before = totals()
        handle = service.start(PromptInput(token_ids=ids), PARAMS)
        it = iter(handle.generation)
        chunks = [next(it)]  # prefilled: the session is open
        (where,) = [a for a, n in totals().items() if n > before.get(a, 0)]
        return handle, it, chunks, where

    def finish(handle, it, chunks) -> list[int]:
        chunks.extend(it)
        handle.close()
        assert [t for c in chunks for t in c] == handle.generation.token_ids
        return handle.generation.token_ids

    try:
        held = [open_request(ids) for ids, _ in cases[:4]]  # least loaded: two on B, two on C
        on_c = [i for i, h in enumerate(held) if h[3] == fleet.c.address]
        assert len(on_c) == 2
        within = on_c[0]  # finishes on C inside its grace period: close to its end when C is told to stop
        while sum(map(len, held[within][2])) < MAX_TOKENS - 4:
            held[within][2].append(next(held[within][1]))
        fleet.c.proc.send_signal(signal.SIGTERM)
        assert finish(*held[within][:3]) == cases[within][1]
        assert held[within][0].generation.faults == []
        deadline = time.monotonic() + 10
        while {s["address"]: s["healthy"] for s in targets.snapshot()}[fleet.c.address]:
            assert time.monotonic() < deadline, "C never reported NOT_SERVING"
            time.sleep(0.05)
        fresh = [open_request(ids) for ids, _ in cases[4:6]]
        assert [h[3] for h in fresh] == [fleet.b.address] * 2  # no new session on the draining replica
        fleet.c.proc.wait(GRACE_C + 15)  # the grace ran out: C cancelled the other stream and exited
        late = on_c[1]
        assert finish(*held[late][:3]) == cases[late][1]
        assert [f[0] for f in held[late][0].generation.faults] == ["target"]  # moved to B
        for i, h in enumerate(held):
            if i not in on_c:
                assert finish(*h[:3]) == cases[i][1]
        for h, (_, ref) in zip(fresh, cases[4:6]):
            assert finish(*h[:3]) == ref
    finally:
        targets.close()
        drafts.close()


def test_no_target_left_fails_with_unavailable(fleet, cases):
    with CoordinatorClient(fleet.coordinator.address) as client:
        stream = client.stream(build_request(cases[0][0], PARAMS), timeout=60)
        first = next(stream)
        assert first.HasField("chunk")
        fleet.b.proc.kill()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no other target replica can take the request over" in err.value.details()
    assert "no healthy target replica" in err.value.details()
