"""Replica pools end to end: two target and two draft replicas as real processes.

Sessions spread over both replicas of each pool, each session's state stays on the replica the
pool gave it (the replicas' own open-session counts match the pool's bookkeeping at every step),
outputs equal target-only greedy decoding, and a replica that turns unhealthy (SIGTERM: health
NOT_SERVING, then no new RPCs) gets no new sessions while its open one finishes there.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from coordinator.client import CoordinatorClient, build_request
from coordinator.replicas import PoolOptions, ReplicaPool
from coordinator.service import GenerationService, PromptInput
from specd.grpc_server import make_channel
from specd.launcher import Service, start_service
from specd.sampling import SamplingParams
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.conftest import hf_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
N_PROMPTS = 8
K = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Targets A, B and drafts C, D (ngram), started in parallel; a long grace so a draining
    replica keeps serving its open sessions."""
    logs = tmp_path_factory.mktemp("pool-logs")
    specs = [("target", ["--grace-seconds", "60"]), ("target", ["--grace-seconds", "60"]),
             ("draft", ["--method", "ngram", "--grace-seconds", "60"]),
             ("draft", ["--method", "ngram", "--grace-seconds", "60"])]
    with ThreadPoolExecutor(len(specs)) as ex:
        services: list[Service] = list(ex.map(lambda s: start_service(s[0], s[1], logs), specs))
    yield services
    for s in services:
        s.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def cases(target, workload_prompts):
    """(prompt ids, target-only greedy ids) for the first N_PROMPTS workload prompts."""
    out = []
    for p in workload_prompts[:N_PROMPTS]:
        ids = target.encode(p.prompt, chat=p.chat)
        out.append((ids, hf_greedy(target, ids, MAX_TOKENS)))
    return out


def tstats(s: Service) -> target_pb2.TargetStats:
    with make_channel(s.address) as ch:
        return target_pb2_grpc.TargetServiceStub(ch).GetStats(target_pb2.GetStatsRequest(), timeout=5)


def dstats(s: Service) -> draft_pb2.DraftStats:
    with make_channel(s.address) as ch:
        return draft_pb2_grpc.DraftServiceStub(ch).GetStats(draft_pb2.GetDraftStatsRequest(), timeout=5)


def params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def test_coordinator_process_spreads_sessions_over_both_replicas(fleet, cases, tmp_path):
    """`--target dns:///localhost:A,127.0.0.1:B --draft C,D`: 8 concurrent requests, exact, and
    every replica did work."""
    a, b, c, d = fleet
    before_t = [tstats(s).forward_passes for s in (a, b)]
    before_d = [dstats(s).blocks for s in (c, d)]
    coordinator = start_service("coordinator", [
        "--target", f"dns:///localhost:{a.port},{b.address}", "--draft", f"{c.address},{d.address}",
        "--method", "ngram", "--k", str(K), "--health-check-interval-s", "0.5"], tmp_path)
    try:
        with CoordinatorClient(coordinator.address) as client:
            with ThreadPoolExecutor(len(cases)) as ex:
                results = list(ex.map(lambda case: client.generate(build_request(case[0], params()), timeout=120), cases))
    finally:
        coordinator.stop()
    for (ids, ref), result in zip(cases, results):
        assert list(result.token_ids) == ref
    assert all(tstats(s).forward_passes > n for s, n in zip((a, b), before_t)), "a target replica served nothing"
    assert all(dstats(s).blocks > n for s, n in zip((c, d), before_d)), "a draft replica served nothing"
    assert sum(r.stats.num_drafts for r in results) > 0


def _opened(pool: ReplicaPool, before: dict[str, int]) -> list[str]:
    return [s["address"] for s in pool.snapshot() if s["sessions_total"] > before.get(s["address"], 0)]


def _totals(pool: ReplicaPool) -> dict[str, int]:
    return {s["address"]: s["sessions_total"] for s in pool.snapshot()}


def test_sessions_stay_on_their_replicas_and_unhealthy_replicas_get_none(fleet, cases, target):
    a, b, c, d = fleet
    opts = PoolOptions(health_interval_s=0.2, health_timeout_s=0.5)
    targets = ReplicaPool([a.address, b.address], opts, name="target")
    drafts = ReplicaPool([c.address, d.address], opts, name="draft")
    service = GenerationService(targets, drafts, target.tokenizer, target.name, frozenset(target.eos_token_ids),
                                method="ngram", k=K)

    def open_request(ids: list[int]):
        """Starts a request and steps it until both its sessions are open; returns the handle, its
        iterator, the chunks so far, and its (target, draft) replica addresses."""
        t0, d0 = _totals(targets), _totals(drafts)
        handle = service.start(PromptInput(token_ids=ids), params())
        it = iter(handle.generation)
        chunks = [next(it)]  # prefill: the target session is open
        chunks.append(next(it))  # the first step: the draft session is open too
        t_new, d_new = _opened(targets, t0), _opened(drafts, d0)
        assert len(t_new) == 1 and len(d_new) == 1, (t_new, d_new)
        return handle, it, chunks, (t_new[0], d_new[0])

    def finish(handle, it, chunks) -> list[int]:
        for chunk in it:
            chunks.append(chunk)
        handle.close()
        return [t for ch in chunks for t in ch]

    def replica_counts() -> dict[str, int]:
        return {**{s.address: tstats(s).open_sessions for s in (a, b)},
                **{s.address: dstats(s).open_sessions for s in (c, d)}}

    try:
        # Part 1: all requests open at once; where each session lives is where the pool put it.
        live = [open_request(ids) for ids, _ in cases]
        placed = [where for *_, where in live]
        expected = {addr: 0 for addr in (a.address, b.address, c.address, d.address)}
        for t_addr, d_addr in placed:
            expected[t_addr] += 1
            expected[d_addr] += 1
        assert expected[a.address] == expected[b.address] == len(cases) // 2  # least loaded: an even spread
        assert expected[c.address] == expected[d.address] == len(cases) // 2
        for _ in range(3):  # interleaved steps; the replicas' own counts never move
            assert replica_counts() == expected
            for handle, it, chunks, _ in live:
                chunk = next(it, None)
                if chunk is not None:
                    chunks.append(chunk)
        # Part 2: keep one session open on A and C, finish the rest, then drain A and C.
        held = next(r for r in live if r[3] == (a.address, c.address)) if (a.address, c.address) in placed else live[0]
        held_index = live.index(held)
        outputs: dict[int, list[int]] = {}
        for i, (handle, it, chunks, _) in enumerate(live):
            if i != held_index:
                outputs[i] = finish(handle, it, chunks)
        t_held, d_held = held[3]
        t_other = b.address if t_held == a.address else a.address
        d_other = d.address if d_held == c.address else c.address
        for svc in fleet:
            if svc.address in (t_held, d_held):
                svc.proc.send_signal(signal.SIGTERM)  # drain: NOT_SERVING, no new RPCs, open streams go on
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            health = {s["address"]: s["healthy"] for s in (*targets.snapshot(), *drafts.snapshot())}
            if not health[t_held] and not health[d_held]:
                break
            time.sleep(0.1)
        assert {s["address"]: s["healthy"] for s in targets.snapshot()} == {t_held: False, t_other: True}
        assert {s["address"]: s["healthy"] for s in drafts.snapshot()} == {d_held: False, d_other: True}
        # New sessions all go to the healthy replicas, and stay exact.
        fresh = [open_request(ids) for ids, _ in cases[:4]]
        assert [where for *_, where in fresh] == [(t_other, d_other)] * 4
        fresh_out = [finish(h, it, ch) for h, it, ch, _ in fresh]
        # The held session finishes on its draining replicas, exactly.
        outputs[held_index] = finish(*held[:3])
        for i, (_, ref) in enumerate(cases):
            assert outputs[i] == ref, f"request {i}"
        for i, (_, ref) in enumerate(cases[:4]):
            assert fresh_out[i] == ref, f"request {i} after the drain"
    finally:
        targets.close()
        drafts.close()
