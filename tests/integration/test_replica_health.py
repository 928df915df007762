"""The pool's health checks against real gRPC health servers (no models): SERVING, NOT_SERVING, gone."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from grpc_health.v1 import health_pb2

from coordinator.replicas import PoolOptions, ReplicaPool
from specd.errors import Unavailable
from specd.grpc_server import build_server


def health_server():
    cfg = SimpleNamespace(host="127.0.0.1", port=0, max_workers=4, grace_seconds=0.0)
    return build_server(cfg, lambda server: None, ["specdec.v1.TargetService"])


def test_not_serving_and_unreachable_replicas_get_no_new_sessions():
    up, flaky = health_server(), health_server()
    pool = ReplicaPool([f"127.0.0.1:{up.port}", f"127.0.0.1:{flaky.port}"],
                       PoolOptions(health_interval_s=3600, health_timeout_s=1.0), name="target")
    try:
        assert [s["status"] for s in pool.snapshot()] == ["SERVING", "SERVING"]
        assert {pool.acquire().address for _ in range(2)} == {f"127.0.0.1:{up.port}", f"127.0.0.1:{flaky.port}"}

        flaky.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        pool.check_health()
        assert [s["status"] for s in pool.snapshot()] == ["SERVING", "NOT_SERVING"]
        assert {pool.acquire().address for _ in range(4)} == {f"127.0.0.1:{up.port}"}

        flaky.health.set("", health_pb2.HealthCheckResponse.SERVING)
        pool.check_health()
        assert pool.acquire().address == f"127.0.0.1:{flaky.port}"  # healthy again and the least loaded

        flaky.server.stop(0).wait()
        up.server.stop(0).wait()
        pool.check_health()
        assert [s["healthy"] for s in pool.snapshot()] == [False, False]
        assert all(s["status"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED") for s in pool.snapshot())
        with pytest.raises(Unavailable, match="no healthy target replica"):
            pool.acquire()
    finally:
        pool.close()
        up.server.stop(0)
        flaky.server.stop(0)


def test_the_watcher_thread_notices_a_draining_replica():
    server = health_server()
    pool = ReplicaPool([f"127.0.0.1:{server.port}"], PoolOptions(health_interval_s=0.05), name="draft")
    try:
        assert pool.snapshot()[0]["healthy"]
        server.health.enter_graceful_shutdown()  # what ServerHandle.drain does first
        for _ in range(100):
            if not pool.snapshot()[0]["healthy"]:
                break
            time.sleep(0.02)
        assert pool.snapshot()[0]["status"] == "NOT_SERVING"
    finally:
        pool.close()
        server.server.stop(0)


def test_a_new_pool_sees_a_replica_restarted_where_an_old_channel_is_backing_off():
    """The CI failure of stop 24: a test's server took a port an earlier test's replica had held,
    whose channel was still backing off; gRPC shared that subchannel with the new pool's channel,
    so the new replica answered UNAVAILABLE and its requests ran without speculation."""
    old = health_server()
    port = old.port
    old_pool = ReplicaPool([f"127.0.0.1:{port}"], PoolOptions(health_interval_s=3600, health_timeout_s=1.0), name="draft")
    new = None
    try:
        old.server.stop(0).wait()
        for _ in range(3):  # fail a few connection attempts: the old channel is now in backoff
            old_pool.check_health()
        assert not old_pool.snapshot()[0]["healthy"]
        cfg = SimpleNamespace(host="127.0.0.1", port=port, max_workers=4, grace_seconds=0.0)
        new = build_server(cfg, lambda server: None, ["specdec.v1.DraftService"])
        pool = ReplicaPool([f"127.0.0.1:{port}"], PoolOptions(health_interval_s=3600, health_timeout_s=1.0), name="draft")
        try:
            assert pool.snapshot()[0]["status"] == "SERVING"  # at once, not after the old channel's backoff
        finally:
            pool.close()
    finally:
        old_pool.close()
        old.server.stop(0)
        if new is not None:
            new.server.stop(0)
