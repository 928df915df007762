"""The timed closed loop against a real gRPC server on loopback: a fake coordinator whose
requests prefill one at a time (a queue, as a single target replica has) and then stream a token
every few milliseconds. Checks that the window opens after the opening prefills, that the loop
stays at its concurrency, and that the streams still open at the end are cancelled, reach the
server as cancellations and are counted as cut, not as errors."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Callable, TypeVar

import grpc
import pytest

from coordinator.loadgen import LoadGenerator, LoadSpec, summarize
from specd.workloads import Prompt
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

PREFILL_S = 0.05
TOKEN_S = 0.01
TOKENS = 20
T = TypeVar("T")
SPEC = LoadSpec(max_tokens=TOKENS)


class QueuedCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.prefill = threading.Lock()  # one prefill at a time
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.cancelled = 0

    def Generate(self, request, context):
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            with self.prefill:
                time.sleep(PREFILL_S)
            for i in range(TOKENS):
                if not context.is_active():
                    with self.lock:
                        self.cancelled += 1
                    return
                yield coordinator_pb2.GenerateResponse(chunk=coordinator_pb2.TokenChunk(token_ids=[i]))
                time.sleep(TOKEN_S)
            result = coordinator_pb2.GenerateResult(token_ids=list(range(TOKENS)))
            result.usage.completion_tokens = TOKENS
            yield coordinator_pb2.GenerateResponse(result=result)
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.fixture()
def server():
    servicer = QueuedCoordinator()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(0)


def _run(address: str, loop: Callable[[LoadGenerator], T], prompts: int = 1) -> T:
    """`loop` on a load generator of `prompts` one-word prompts against the server, closed after."""
    gen = LoadGenerator(address, [Prompt(id=f"p{i}", kind="chat", chat=False, prompt="hi", max_tokens=TOKENS)
                                  for i in range(prompts)], encode=lambda p: [1, 2, 3])
    try:
        return loop(gen)
    finally:
        gen.close()


def test_timed_closed_loop_holds_its_concurrency_and_cuts_the_open_streams(server) -> None:
    servicer, address = server
    records, (begin, end) = _run(address, lambda gen: gen.closed_loop_for(4, 0.6, SPEC), prompts=3)
    # the window opens after the four opening prefills, which the server ran one at a time
    assert begin >= 4 * PREFILL_S - 0.01 and end == pytest.approx(begin + 0.6)
    assert servicer.most_in_flight == 4
    finished = [r for r in records if r.done is not None]
    cut = [r for r in records if r.cut]
    assert finished and cut and all(r.error is None for r in records)
    assert len(cut) <= 4 and all(r.tokens == TOKENS for r in finished)
    deadline = time.time() + 2
    while servicer.in_flight and time.time() < deadline:
        time.sleep(0.01)
    assert servicer.in_flight == 0 and servicer.cancelled >= 1  # the cut streams reached the server
    s = summarize(records, end, window=(begin, end))
    assert (s["errors"], s["cut"], s["completed"]) == (0, len(cut), len(finished))
    # four streams at a token per ~10 ms, less the prefills inside the window
    assert 0.3 * 4 / TOKEN_S < s["tokens_per_s"] < 1.1 * 4 / TOKEN_S


def test_staggered_clients_start_apart_and_the_window_waits_for_the_last(server) -> None:
    _, address = server
    records, (begin, _) = _run(address, lambda gen: gen.closed_loop_for(3, 0.3, SPEC, stagger_s=0.1))
    firsts = sorted(r.sent for r in records)[:3]
    assert firsts[0] < 0.05 and firsts[1] == pytest.approx(0.1, abs=0.04) and firsts[2] == pytest.approx(0.2, abs=0.04)
    assert begin >= 0.2 + PREFILL_S


def test_a_held_fixed_work_loop_stays_at_its_concurrency_until_the_asked_requests_end(server) -> None:
    """`closed_loop_held`: no drain. Four clients, six requests to end: when the sixth ends, the
    other clients' requests are still streaming and are cut, and the window closes at that end."""
    servicer, address = server
    records, (begin, end) = _run(address, lambda gen: gen.closed_loop_held(4, 6, SPEC))
    finished = sorted((r for r in records if r.done is not None), key=lambda r: r.done)
    cut = [r for r in records if r.cut]
    assert len(finished) == 6 and all(r.error is None for r in records)
    assert begin == 0.0 and end == pytest.approx(finished[-1].done)
    assert 3 <= len(cut) <= 4  # the other three clients' requests (and one sent as the run stopped)
    assert servicer.most_in_flight == 4
    s = summarize(records, end, window=(begin, end))
    streamed_cut = sum(sum(r.chunk_tokens) for r in cut)
    assert streamed_cut > 0  # the cut requests' tokens until then count
    assert s["tokens_per_s"] == pytest.approx((6 * TOKENS + sum(
        n for r in cut for t, n in zip(r.chunk_times, r.chunk_tokens) if t <= end)) / end, rel=0.01)


def test_a_held_loop_with_a_lead_in_counts_only_the_tokens_after_the_opening_wave(server) -> None:
    """`closed_loop_held(..., lead_in=c)`: the window opens at the c-th request's end, so the
    opening wave's prefills and tokens before it do not count, and closes when `finished` more
    requests have ended."""
    _, address = server
    records, (begin, end) = _run(address, lambda gen: gen.closed_loop_held(3, 4, SPEC, lead_in=3))
    ends = sorted(r.done for r in records if r.done is not None)
    assert len(ends) == 7
    assert begin == pytest.approx(ends[2]) and end == pytest.approx(ends[-1])
    assert begin >= 3 * PREFILL_S + TOKENS * TOKEN_S  # after the third prefill in the queue and its tokens
    s = summarize(records, end, window=(begin, end))
    in_window = sum(n for r in records for t, n in zip(r.chunk_times, r.chunk_tokens) if begin < t <= end)
    assert 0 < in_window < 7 * TOKENS
    assert s["tokens_per_s"] == pytest.approx(in_window / (end - begin), rel=0.01)
