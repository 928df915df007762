"""Replica pools without servers: selection, spec parsing, DNS discovery and health, with fakes."""

from __future__ import annotations

import socket
from collections.abc import Sequence

import pytest

from coordinator.replicas import (
    Discovery,
    PoolOptions,
    Replica,
    ReplicaPool,
    ReplicaSpec,
    format_address,
    least_loaded,
    parse_replica_spec,
    resolve_dns,
)
from specd.errors import Unavailable


class FakeChannel:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Fleet:
    """Fake replicas: a mutable DNS answer and a health verdict per address."""

    def __init__(self, addresses: Sequence[str]):
        self.dns = list(addresses)
        self.unhealthy: set[str] = set()
        self.lookups = 0

    def resolver(self, host: str, port: int) -> list[str]:
        self.lookups += 1
        if self.dns is None:
            raise socket.gaierror("temporary failure in name resolution")
        return list(self.dns)

    def health_check(self, replicas: Sequence[Replica], timeout: float) -> list[tuple[bool, str]]:
        return [(r.address not in self.unhealthy, "NOT_SERVING" if r.address in self.unhealthy else "SERVING")
                for r in replicas]

    def options(self, health_interval_s: float = 1.0) -> PoolOptions:
        return PoolOptions(health_interval_s=health_interval_s, refresh_s=3600, resolver=self.resolver,
                           health_check=self.health_check,
                           connect=lambda a: Replica(a, FakeChannel()))  # type: ignore[arg-type]

    def pool(self, specs: Sequence[str] = ("dns:///svc:50052",), **kw) -> ReplicaPool:
        pool = ReplicaPool(specs, self.options(**kw), name="target")
        return pool


# --- least_loaded ----------------------------------------------------------------------------


def test_least_loaded_picks_the_fewest_sessions():
    assert least_loaded([3, 1, 2], [True, True, True]) == 1


def test_least_loaded_skips_ineligible_replicas_even_if_idle():
    assert least_loaded([0, 5, 2], [False, True, True]) == 2


def test_least_loaded_rotates_among_ties():
    assert [least_loaded([1, 1, 1], [True] * 3, start) for start in range(4)] == [0, 1, 2, 0]


def test_least_loaded_none_when_nothing_is_eligible():
    assert least_loaded([0, 0], [False, False]) is None
    assert least_loaded([], []) is None


# --- specs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, expected", [
    ("127.0.0.1:50052", ReplicaSpec("127.0.0.1", 50052)),
    ("target-0.specd:50052", ReplicaSpec("target-0.specd", 50052)),
    ("dns:///specd-target.default.svc.cluster.local:50052", ReplicaSpec("specd-target.default.svc.cluster.local", 50052, True)),
    ("[::1]:7", ReplicaSpec("::1", 7)),
    (" dns:///[::1]:7 ", ReplicaSpec("::1", 7, True)),
])
def test_parse_replica_spec(spec, expected):
    assert parse_replica_spec(spec) == expected


@pytest.mark.parametrize("spec", ["nohost", ":50052", "host:port", "host:70000", "dns://8.8.8.8/svc:50052", "[::1]7"])
def test_parse_replica_spec_refuses_bad_specs(spec):
    with pytest.raises(ValueError):
        parse_replica_spec(spec)


def test_format_address_brackets_ipv6():
    assert format_address("10.0.0.7", 1) == "10.0.0.7:1"
    assert format_address("fd00::7", 1) == "[fd00::7]:1"
    assert format_address("svc", 1) == "svc:1"


def test_resolve_dns_gives_every_address_once():
    addresses = resolve_dns("localhost", 50052)
    assert addresses and len(addresses) == len(set(addresses))
    assert all(a.endswith(":50052") for a in addresses)
    assert "127.0.0.1:50052" in addresses or "[::1]:50052" in addresses


def test_discovery_unions_static_and_dns_and_keeps_the_last_answer_on_failure():
    fleet = Fleet(["10.0.0.1:50052", "10.0.0.2:50052"])
    d = Discovery(["10.0.0.9:50052", "dns:///svc:50052"], resolver=fleet.resolver)
    assert d.dynamic
    assert d.resolve() == ["10.0.0.9:50052", "10.0.0.1:50052", "10.0.0.2:50052"]
    fleet.dns = None  # the resolver fails: the pool must not empty itself
    assert d.resolve() == ["10.0.0.9:50052", "10.0.0.1:50052", "10.0.0.2:50052"]
    assert not Discovery(["a:1", "b:2"]).dynamic


# --- the pool --------------------------------------------------------------------------------


def test_pool_spreads_sessions_and_release_frees_them():
    pool = Fleet(["10.0.0.1:1", "10.0.0.2:1"]).pool()
    got = [pool.acquire() for _ in range(4)]
    assert sorted(r.address for r in got) == ["10.0.0.1:1", "10.0.0.1:1", "10.0.0.2:1", "10.0.0.2:1"]
    for r in got[:2]:
        pool.release(r)
    assert sum(r.open_sessions for r in pool.replicas) == 2
    assert [s["sessions_total"] for s in pool.snapshot()] == [2, 2]
    pool.close()


def test_unhealthy_replica_gets_no_new_sessions_until_it_recovers():
    fleet = Fleet(["10.0.0.1:1", "10.0.0.2:1"])
    pool = fleet.pool()
    fleet.unhealthy.add("10.0.0.1:1")
    pool.check_health()
    assert {pool.acquire().address for _ in range(5)} == {"10.0.0.2:1"}
    fleet.unhealthy.clear()
    pool.check_health()
    assert pool.acquire().address == "10.0.0.1:1"  # now the least loaded
    pool.close()


def test_no_healthy_replica_raises_unavailable_naming_the_states():
    fleet = Fleet(["10.0.0.1:1"])
    fleet.unhealthy.add("10.0.0.1:1")
    pool = fleet.pool()  # the constructor's first health round already sees it
    with pytest.raises(Unavailable, match=r"no healthy target replica \(10.0.0.1:1 NOT_SERVING\)"):
        pool.acquire()
    pool.close()


def test_health_checks_off_treats_every_replica_as_healthy():
    fleet = Fleet(["10.0.0.1:1"])
    fleet.unhealthy.add("10.0.0.1:1")
    pool = fleet.pool(health_interval_s=0)
    assert pool.acquire().address == "10.0.0.1:1"
    pool.close()


def test_dns_refresh_adds_new_replicas_and_retires_vanished_ones_after_their_sessions():
    fleet = Fleet(["10.0.0.1:1", "10.0.0.2:1"])
    pool = fleet.pool()
    held = [pool.acquire(), pool.acquire()]
    old = next(r for r in held if r.address == "10.0.0.1:1")
    fleet.dns = ["10.0.0.2:1", "10.0.0.3:1"]  # pod 1 went away, pod 3 came
    pool.refresh()
    assert {s["address"]: s["retired"] for s in pool.snapshot()} == {"10.0.0.1:1": True, "10.0.0.2:1": False,
                                                                   "10.0.0.3:1": False}
    assert {pool.acquire().address for _ in range(3)} <= {"10.0.0.2:1", "10.0.0.3:1"}
    assert not old.channel.closed  # its session still runs there
    pool.release(old)
    assert old.channel.closed and "10.0.0.1:1" not in [r.address for r in pool.replicas]
    pool.close()


def test_a_vanished_idle_replica_is_dropped_at_once_and_a_returning_one_revived():
    fleet = Fleet(["10.0.0.1:1", "10.0.0.2:1"])
    pool = fleet.pool()
    held = pool.acquire()
    fleet.dns = ["10.0.0.1:1"] if held.address == "10.0.0.1:1" else ["10.0.0.2:1"]
    pool.refresh()
    assert [r.address for r in pool.replicas] == [held.address]
    fleet.dns = []
    pool.refresh()
    assert pool.replicas[0].retired
    fleet.dns = [held.address]
    pool.refresh()
    assert not pool.replicas[0].retired and pool.acquire() is held
    pool.close()


def test_wait_for_replica_raises_when_discovery_finds_none():
    fleet = Fleet([])
    pool = fleet.pool()
    with pytest.raises(Unavailable, match="no target replica discovered"):
        pool.wait_for_replica(0.05)
    with pytest.raises(Unavailable, match="none discovered"):
        pool.acquire()
    pool.close()


def test_empty_spec_list_is_refused():
    with pytest.raises(ValueError):
        ReplicaPool([])
