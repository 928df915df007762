"""The target service in-process on a tiny model: session limit, idle TTL, draining, bad blocks."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import grpc
import pytest

from specd.grpc_server import build_server, make_channel
from specd.models import load_model, save_tiny_random_model
from specd.sampling import SamplingParams
from specd.wire import sampling_to_proto
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.server import SERVICE_NAME, TargetServicer, register


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny_random_model(tmp_path_factory.mktemp("tiny"), vocab_size=32, seed=5)))


def serve(tiny, **kwargs):
    servicer = TargetServicer(tiny, **kwargs)
    cfg = SimpleNamespace(host="127.0.0.1", port=0, max_workers=16, grace_seconds=1.0)
    handle = build_server(cfg, register(servicer), [SERVICE_NAME])
    handle.add_drain_hook(servicer.drain)
    return servicer, handle


class Session:
    """A lockstep client of TargetService.Session."""

    def __init__(self, stub):
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = stub.Session(iter(self.requests.get, None), timeout=30)

    def send(self, **kind):
        self.requests.put(target_pb2.TargetRequest(**kind))
        return next(self.replies)

    def open(self, prompt=(1, 2, 3)):
        return self.send(open=target_pb2.OpenTargetSession(prompt_token_ids=list(prompt),
                                                           params=sampling_to_proto(SamplingParams(max_tokens=8))))

    def close(self):
        self.requests.put(None)


def stats(stub) -> target_pb2.TargetStats:
    return stub.GetStats(target_pb2.GetStatsRequest(), timeout=5)


def test_session_limit_is_resource_exhausted_and_frees_on_close(tiny):
    servicer, handle = serve(tiny, max_sessions=1)
    try:
        with make_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            first = Session(stub)
            assert first.open().opened.first_token_id >= 0
            second = Session(stub)
            with pytest.raises(grpc.RpcError) as err:
                second.open()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 1" in err.value.details()
            assert first.send(verify=target_pb2.VerifyBlock(draft_token_ids=[4, 5])).verified.token_ids  # still serving
            first.close()
            deadline = time.monotonic() + 2
            while stats(stub).open_sessions and time.monotonic() < deadline:
                time.sleep(0.02)
            assert stats(stub).open_sessions == 0
            third = Session(stub)
            assert third.open().HasField("opened")
            third.close()
    finally:
        handle.drain(0.5)


def test_idle_sessions_expire_after_the_ttl(tiny):
    servicer, handle = serve(tiny, session_ttl_s=0.4)
    try:
        with make_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            idle = Session(stub)
            idle.open()
            assert stats(stub).open_sessions == 1
            time.sleep(1.2)
            assert stats(stub).open_sessions == 0
            with pytest.raises(grpc.RpcError) as err:
                idle.send(verify=target_pb2.VerifyBlock())
            assert err.value.code() == grpc.StatusCode.CANCELLED
    finally:
        handle.drain(0.5)


def test_bad_blocks_are_invalid_argument_and_the_session_survives_elsewhere(tiny):
    servicer, handle = serve(tiny)
    try:
        with make_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            good = Session(stub)
            good.open()
            bad = Session(stub)
            bad.open()
            with pytest.raises(grpc.RpcError) as err:
                bad.send(verify=target_pb2.VerifyBlock(draft_token_ids=[999]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft_tokens" in err.value.details()
            assert good.send(verify=target_pb2.VerifyBlock(draft_token_ids=[3])).HasField("verified")
            good.close()
    finally:
        handle.drain(0.5)


def test_draining_refuses_new_sessions(tiny):
    servicer, handle = serve(tiny)
    try:
        servicer.drain()
        with make_channel(f"127.0.0.1:{handle.port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                Session(target_pb2_grpc.TargetServiceStub(ch)).open()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
    finally:
        handle.drain(0.5)


def test_load_monitor_reads_a_real_targets_stats_and_seeds_the_cost_model(tiny):
    """The coordinator's LoadMonitor polls GetStats: open sessions and queue depth become the
    replica's LoadSignal, and the verify latencies already measured seed its cost model."""
    from coordinator.depth import CostModels, LoadMonitor

    servicer, handle = serve(tiny)
    address = f"127.0.0.1:{handle.port}"
    try:
        with make_channel(address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            sessions = [Session(stub) for _ in range(2)]
            for s in sessions:
                s.open()
                assert s.send(verify=target_pb2.VerifyBlock(draft_token_ids=[4, 5])).HasField("verified")
            costs = CostModels()
            monitor = LoadMonitor(lambda: [(address, stub)], costs)
            assert monitor.load(address) is None
            monitor.poll_once()
            signal = monitor.load(address)
            assert signal is not None and signal.open_sessions == 2 and signal.queue_depth == 0
            assert {(b, p) for b, _, _, _, p in costs.get(address).verify_table()} == {
                (v.batch_size, v.positions) for v in stats(stub).verify_latency}
            for s in sessions:
                s.close()
    finally:
        handle.drain(0.5)


def test_stats_count_the_prefills_and_their_time_apart_from_the_verify_passes(tiny):
    """GetStats says how much of the model's time went to prefills (one per session opened) and
    how much to verify passes (`verify_latency`): at 16 sessions on the bundled target most of it
    can be prefills, where no depth choice helps."""
    servicer, handle = serve(tiny)
    try:
        with make_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            assert stats(stub).prefills == 0 and stats(stub).prefill_ms == 0.0
            sessions = [Session(stub) for _ in range(3)]
            for s in sessions:
                s.open()
            s.send(verify=target_pb2.VerifyBlock(draft_token_ids=[4, 5]))
            after = stats(stub)
            assert after.prefills == 3 and after.prefill_ms > 0.0
            assert sum(v.count for v in after.verify_latency) == 1  # the verify pass is not a prefill
            for s in sessions:
                s.close()
    finally:
        handle.drain(0.5)


def test_load_only_stats_leave_out_the_tables_and_the_monitor_asks_for_them_once(tiny):
    """GetStats(load_only) answers the load fields without the batch-size and latency tables, and
    the LoadMonitor asks for the tables only until they have seeded the replica's cost model."""
    from coordinator.depth import CostModels, LoadMonitor

    servicer, handle = serve(tiny)
    address = f"127.0.0.1:{handle.port}"
    try:
        with make_channel(address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            session = Session(stub)
            session.open()
            assert session.send(verify=target_pb2.VerifyBlock(draft_token_ids=[4, 5])).HasField("verified")
            full = stats(stub)
            light = stub.GetStats(target_pb2.GetStatsRequest(load_only=True), timeout=5)
            assert full.verify_latency and full.batch_sizes
            assert not light.verify_latency and not light.batch_sizes
            assert (light.open_sessions, light.forward_passes, light.prefills) == \
                (full.open_sessions, full.forward_passes, full.prefills) == (1, 2, 1)  # a prefill and a verify

            asked: list[bool] = []

            class Recording:
                def GetStats(self, request, timeout=None):
                    asked.append(request.load_only)
                    return stub.GetStats(request, timeout=timeout)

            costs = CostModels()
            monitor = LoadMonitor(lambda: [(address, Recording())], costs)
            for _ in range(3):
                monitor.poll_once()
            assert asked == [False, True, True]
            assert costs.get(address).verify_table()  # seeded from the first, full answer
            signal = monitor.load(address)
            assert signal is not None and signal.open_sessions == 1
            session.close()
    finally:
        handle.drain(0.5)
