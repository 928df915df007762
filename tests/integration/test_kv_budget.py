"""The target's KV memory budget on a tiny model: it derives the session limit, the limit holds
over gRPC, and the KV pool never grows past the budget."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import grpc
import pytest

from specd.grpc_server import build_server, make_channel
from specd.models import load_model, save_tiny_random_model
from specd.sampling import SamplingParams
from specd.wire import sampling_to_proto
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.kv_budget import MIB
from target_service.kv_pool import KVShape
from target_service.server import SERVICE_NAME, TargetServicer, register


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny_random_model(tmp_path_factory.mktemp("tiny"), vocab_size=32, seed=5,
                                                 max_position_embeddings=256)))


def per_session_bytes(model) -> int:
    return KVShape.of(model.model.config).bytes_per_token(model.dtype) * model.max_context


def test_budget_sets_the_session_limit_and_caps_the_pool(tiny):
    budget_mb = 2.5 * per_session_bytes(tiny) / MIB  # room for two sessions, not three
    servicer = TargetServicer(tiny, max_sessions=64, kv_budget_mb=budget_mb)
    assert servicer.max_sessions == 2 and servicer.session_limit.source == "kv_budget_mb"
    handle = build_server(SimpleNamespace(host="127.0.0.1", port=0, max_workers=8, grace_seconds=1.0),
                          register(servicer), [SERVICE_NAME])
    try:
        with make_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            assert stub.GetStats(target_pb2.GetStatsRequest(), timeout=5).max_sessions == 2
            streams = []
            for _ in range(2):  # two long sessions: the pool grows to their full context
                requests: queue.SimpleQueue = queue.SimpleQueue()
                replies = stub.Session(iter(requests.get, None), timeout=30)
                requests.put(target_pb2.TargetRequest(open=target_pb2.OpenTargetSession(
                    prompt_token_ids=list(range(1, 30)) * 8, params=sampling_to_proto(SamplingParams(max_tokens=8)))))
                assert next(replies).HasField("opened")
                streams.append((requests, replies))
            requests = queue.SimpleQueue()
            replies = stub.Session(iter(requests.get, None), timeout=30)
            requests.put(target_pb2.TargetRequest(open=target_pb2.OpenTargetSession(prompt_token_ids=[1, 2])))
            with pytest.raises(grpc.RpcError) as err:
                next(replies)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 2 sessions" in err.value.details()
            pool = servicer.target.forward.pool
            assert pool.slots <= 2 and pool.capacity <= tiny.max_context
            assert pool.nbytes <= budget_mb * MIB
            for q, _ in streams:
                q.put(None)
    finally:
        handle.drain(0.5)


def test_a_budget_below_one_session_fails_the_start(tiny):
    with pytest.raises(ValueError, match="kv_budget_mb: .* holds no session"):
        TargetServicer(tiny, kv_budget_mb=0.5 * per_session_bytes(tiny) / MIB)
