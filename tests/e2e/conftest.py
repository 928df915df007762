"""One stack of three real processes (target, draft with a tiny draft model, coordinator with HTTP, each with a
Prometheus metrics endpoint) per test session."""

from __future__ import annotations

import time

import pytest

from coordinator.client import CoordinatorClient
from specd.grpc_server import make_channel
from specd.launcher import free_port, start_stack
from specd.models import save_tiny_random_model
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


@pytest.fixture(scope="session")
def stack(target, tmp_path_factory):
    tiny = save_tiny_random_model(tmp_path_factory.mktemp("tiny-draft"), vocab_size=target.vocab_size, hidden_size=64,
                                  tokenizer_from=target.tokenizer, max_position_embeddings=8192)
    s = start_stack(tmp_path_factory.mktemp("logs"), draft_model=str(tiny), http_port=free_port(),
                    metrics_ports={"target": 0, "draft": 0, "coordinator": 0})  # Prometheus on free ports
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(stack):
    with CoordinatorClient(stack.coordinator.address) as c:
        yield c


def target_stats(stack) -> target_pb2.TargetStats:
    with make_channel(stack.target.address) as ch:
        return target_pb2_grpc.TargetServiceStub(ch).GetStats(target_pb2.GetStatsRequest(), timeout=5)


def draft_stats(stack) -> draft_pb2.DraftStats:
    with make_channel(stack.draft.address) as ch:
        return draft_pb2_grpc.DraftServiceStub(ch).GetStats(draft_pb2.GetDraftStatsRequest(), timeout=5)


def wait_sessions_closed(stack, within: float = 1.0) -> tuple[int, int]:
    """Open sessions on (target, draft) once both reach zero, or when `within` seconds have passed."""
    deadline = time.monotonic() + within
    while True:
        t, d = target_stats(stack).open_sessions, draft_stats(stack).open_sessions
        if (t, d) == (0, 0) or time.monotonic() > deadline:
            return t, d
        time.sleep(0.05)
