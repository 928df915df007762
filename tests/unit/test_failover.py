"""Failover pieces without servers: the watchdog, per-call budgets on a lockstep stream, the pool's
immediate re-check of a failed replica, and which errors count as a replica's failure."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from coordinator.failover import fault_reason, is_request_deadline, is_target_failure
from coordinator.remote import LockstepStream
from coordinator.replicas import PoolOptions, Replica, ReplicaPool
from coordinator.watchdog import Watchdog
from specd.errors import CallTimeout, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from tests.fakes import FakeRpcError


def test_watchdog_fires_late_alarms_only():
    dog = Watchdog()
    fired: list[str] = []
    done = threading.Event()
    kept = dog.arm(0.05, lambda: fired.append("disarmed"))
    late = dog.arm(0.1, lambda: (fired.append("late"), done.set()))
    kept.disarm()
    early = dog.arm(0.01, lambda: fired.append("early"))
    assert done.wait(5)
    assert fired == ["early", "late"] and late.fired and early.fired and not kept.fired


class FakeCall:
    """A bidi call's reply iterator: replies when told to, fails like grpc when cancelled."""

    def __init__(self) -> None:
        self.replies: list[object] = []
        self.ready = threading.Condition()
        self.cancelled = False

    def __call__(self, requests, timeout=None, metadata=()):
        return self

    def reply(self, item: object) -> None:
        with self.ready:
            self.replies.append(item)
            self.ready.notify_all()

    def __next__(self):
        with self.ready:
            while not self.replies and not self.cancelled:
                self.ready.wait()
            if self.cancelled:
                raise FakeRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
            item = self.replies.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        with self.ready:
            self.cancelled = True
            self.ready.notify_all()


def test_a_reply_within_the_budget_is_returned():
    call = FakeCall()
    stream = LockstepStream(call, timeout=None)
    call.reply("block")
    assert stream.call("step", budget=1.0) == "block"
    time.sleep(1.1)  # the disarmed alarm never cancels the stream later
    assert not call.cancelled


def test_a_reply_past_the_budget_cancels_the_stream_and_raises_call_timeout():
    call = FakeCall()
    stream = LockstepStream(call, timeout=None)
    start = time.monotonic()
    with pytest.raises(CallTimeout, match="no reply within 100 ms"):
        stream.call("step", budget=0.1)
    assert 0.09 <= time.monotonic() - start < 1.0 and call.cancelled


def test_an_error_of_the_stream_itself_is_not_a_timeout():
    call = FakeCall()
    stream = LockstepStream(call, timeout=None)
    call.reply(FakeRpcError(grpc.StatusCode.UNAVAILABLE))
    with pytest.raises(FakeRpcError):
        stream.call("step", budget=1.0)


class FakeChannel:
    def close(self) -> None:
        pass


class Health:
    def __init__(self) -> None:
        self.down: set[str] = set()
        self.checks: list[list[str]] = []

    def __call__(self, replicas, timeout):
        self.checks.append([r.address for r in replicas])
        return [(r.address not in self.down, "UNAVAILABLE" if r.address in self.down else "SERVING") for r in replicas]


def pool_of(health: Health, interval: float = 3600.0) -> ReplicaPool:
    return ReplicaPool(["a:1", "b:1"], PoolOptions(health_interval_s=interval, health_check=health,
                                                   connect=lambda a: Replica(a, FakeChannel())))  # type: ignore[arg-type]


def test_report_failure_rechecks_the_replica_at_once():
    health = Health()
    pool = pool_of(health)
    try:
        a = pool.acquire()
        health.down.add(a.address)
        pool.report_failure(a)
        assert health.checks[-1] == [a.address]  # only that replica, now
        assert [pool.acquire().address for _ in range(3)] == ["b:1"] * 3
        other = next(r for r in pool.replicas if r.address == "b:1")
        pool.report_failure(other)  # one broken stream on a replica that still answers SERVING
        assert other.healthy
    finally:
        pool.close()


def test_report_failure_without_health_checks_changes_nothing():
    health = Health()
    pool = pool_of(health, interval=0)
    try:
        a = pool.acquire()
        health.down.add(a.address)
        pool.report_failure(a)
        assert a.healthy and health.checks == []
    finally:
        pool.close()


@pytest.mark.parametrize("exc,failover,reason", [
    (FakeRpcError(grpc.StatusCode.UNAVAILABLE), True, "unavailable"),
    (FakeRpcError(grpc.StatusCode.CANCELLED), True, "cancelled"),
    (FakeRpcError(grpc.StatusCode.NOT_FOUND), True, "not_found"),
    (FakeRpcError(grpc.StatusCode.ABORTED), True, "aborted"),
    (CallTimeout("slow"), True, "timeout"),
    (Unavailable("draining"), True, "unavailable"),
    (NotFound("session"), True, "not_found"),
    (FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED), False, "deadline_exceeded"),
    (FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT), False, "invalid_argument"),
    (FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED), False, "resource_exhausted"),
    (FakeRpcError(grpc.StatusCode.INTERNAL), False, "internal"),
    (ResourceExhausted("full"), False, "ResourceExhausted"),
    (InvalidArgument("prompt", "empty"), False, "InvalidArgument"),
    (TimeoutError("the request's deadline passed"), False, "TimeoutError"),
])
def test_which_errors_are_a_target_replicas_failure(exc, failover, reason):
    assert is_target_failure(exc) is failover
    assert fault_reason(exc) == reason
    assert is_request_deadline(exc) is (reason == "deadline_exceeded")
