"""Per-call budgets over a real gRPC stream: a draft replica that answers too slowly is given up
after the budget (CallTimeout, the stream cancelled, the replica told), and the request goes on
without it, exactly."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from coordinator.engine import SpeculativeEngine
from coordinator.remote import RemoteDraftSession, RemoteProposer
from coordinator.replicas import PoolOptions, ReplicaPool
from specd.errors import CallTimeout
from specd.models import load_model, save_tiny_random_model
from specd.sampling import SamplingParams
from specdec.v1 import draft_pb2, draft_pb2_grpc
from target_service.verifier import TargetModel
from tests.conftest import hf_greedy

BUDGET_S = 0.2


class SlowDraft(draft_pb2_grpc.DraftServiceServicer):
    """Opens at once; answers every step after `delay` seconds with a useless one-token block."""

    def __init__(self, delay: float):
        self.delay = delay
        self.ended = threading.Event()  # set when a session's stream ended (cancelled by the client)

    def Session(self, request_iterator, context):
        try:
            for request in request_iterator:
                if request.WhichOneof("kind") == "open":
                    yield draft_pb2.DraftBlock(session_id="slow-1")
                else:
                    time.sleep(self.delay)
                    yield draft_pb2.DraftBlock(token_ids=[1])
        finally:
            self.ended.set()


@pytest.fixture
def slow_draft():
    servicer = SlowDraft(delay=2.0)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    pool = ReplicaPool([f"127.0.0.1:{port}"], PoolOptions(health_interval_s=0), name="draft")
    yield servicer, pool
    pool.close()
    server.stop(0)


def test_a_draft_call_past_its_budget_raises_call_timeout_and_frees_the_replica(slow_draft):
    servicer, pool = slow_draft
    session = RemoteDraftSession(pool, "ngram", [1, 2, 3], SamplingParams(max_tokens=4), "r", None,
                                 times=RemoteProposer(pool, "ngram").times, budget=BUDGET_S)
    start = time.monotonic()
    with pytest.raises(CallTimeout):
        session.propose(4)
    assert BUDGET_S <= time.monotonic() - start < BUDGET_S + 1.0  # not the 2 s the replica takes
    assert servicer.ended.wait(5), "the replica's stream was not cancelled"
    session.abandon()
    assert pool.snapshot()[0]["open_sessions"] == 0


def test_a_slow_draft_replica_costs_the_request_its_speculation_not_its_output(slow_draft, tmp_path):
    _, pool = slow_draft
    tiny = load_model(str(save_tiny_random_model(tmp_path, vocab_size=32, seed=3, max_position_embeddings=64)))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = SpeculativeEngine(TargetModel(tiny), RemoteProposer(pool, "ngram", budget=BUDGET_S), k=4)
    start = time.monotonic()
    gen = engine.generate([5, 6, 7, 8], params).run()
    assert gen.token_ids == hf_greedy(tiny, [5, 6, 7, 8], 12, exact_length=True)
    # 11 steps: the first waits out the budget, 7 go without a draft, the 9th tries a new session (slow
    # again: the backoff doubles), the last 2 go without; each slow step costs the budget, not 2 s.
    assert gen.faults == [("draft", "timeout")] * 2
    assert gen.stats.num_drafts == 0 and gen.stats.k_per_step == [0] * 11
    assert time.monotonic() - start < 3.0  # two slow steps at the replica's pace would take 4 s
