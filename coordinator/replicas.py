"""Replica pools: which replicas of a service exist, which are healthy, and which gets a new session.

A session (a bidi stream) lives on one replica for its whole life, because that replica holds its
KV cache or draft state; the pool only decides where a *new* session goes:

- **discovery**: the replica set comes from a static list (`host:port`) and/or DNS names
  (`dns:///name:port`: every A/AAAA record, re-resolved every `refresh_s` seconds, as a
  Kubernetes headless Service publishes its ready pods). New addresses join the pool; vanished
  ones are *retired*: they get no new sessions and their channel closes once their last session ends.
- **health**: a background thread asks every replica's `grpc.health.v1.Health/Check` each
  `health_interval_s`; a replica answering anything but SERVING (draining replicas answer
  NOT_SERVING) or not answering gets no new sessions until it reports SERVING again. Periodic
  `Check` rather than a `Watch` stream: a Watch holds one handler thread of the (synchronous)
  replica server per coordinator for ever.
- **selection**: the least loaded (fewest sessions this coordinator has open on it) healthy,
  non-retired replica, rotating among ties (`least_loaded`, a pure function).

With no eligible replica, `acquire` raises `specd.errors.Unavailable` (gRPC UNAVAILABLE, HTTP 503).
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.errors import Unavailable
from specd.grpc_server import make_channel

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
DEFAULT_REFRESH_S = 10.0
DEFAULT_HEALTH_INTERVAL_S = 1.0
DEFAULT_HEALTH_TIMEOUT_S = 1.0

SERVING = health_pb2.HealthCheckResponse.SERVING
# gRPC waits up to 120 s between reconnection attempts by default: a replica back from an outage
# (a restarted container at the same address) would stay unhealthy that long.
MAX_RECONNECT_BACKOFF_MS = 5_000


# --- pure logic ------------------------------------------------------------------------------


def least_loaded(loads: Sequence[int], eligible: Sequence[bool], start: int = 0) -> int | None:
    """The index of the eligible entry with the smallest load, or None when none is eligible.

    Ties go to the first one at or after `start` in rotation order, so that equally loaded
    replicas take turns rather than the first one always winning.
    """
    n = len(loads)
    best: int | None = None
    for offset in range(n):
        i = (start + offset) % n
        if eligible[i] and (best is None or loads[i] < loads[best]):
            best = i
    return best


@dataclass(frozen=True)
class ReplicaSpec:
    """One entry of a `--target`/`--draft` list: a fixed address or a DNS name to resolve."""

    host: str
    port: int
    dns: bool = False

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)


def parse_replica_spec(spec: str) -> ReplicaSpec:
    """`host:port`, `[v6]:port` or `dns:///name:port` (gRPC's naming syntax; no DNS authority)."""
    raw = spec.strip()
    dns = raw.startswith(DNS_SCHEME)
    if dns:
        raw = raw[len(DNS_SCHEME):]
    elif raw.startswith("dns:"):
        raise ValueError(f"{spec!r}: write dns:///NAME:PORT (a custom DNS authority is not supported)")
    if raw.startswith("["):
        host, sep, rest = raw[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{spec!r}: expected [IPv6]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = raw.rpartition(":")
        if not sep:
            raise ValueError(f"{spec!r}: expected HOST:PORT or dns:///NAME:PORT")
    if not host:
        raise ValueError(f"{spec!r}: the host is empty")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{spec!r}: the port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"{spec!r}: the port {port} is out of range")
    return ReplicaSpec(host, port, dns)


def format_address(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed as gRPC expects."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


Resolver = Callable[[str, int], Iterable[str]]


def resolve_dns(host: str, port: int) -> list[str]:
    """Every A and AAAA record of `host`, as sorted `ip:port` addresses (one per distinct IP)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({format_address(str(info[4][0]), port) for info in infos})


class Discovery:
    """The addresses a list of specs names now: static ones as given, DNS names as resolved.

    A name that fails to resolve keeps its last answer (a DNS hiccup must not empty the pool;
    health checks still catch replicas that are really gone).
    """

    def __init__(self, specs: Sequence[str], refresh_s: float = DEFAULT_REFRESH_S, resolver: Resolver = resolve_dns):
        if not specs:
            raise ValueError("a replica pool needs at least one address")
        self.specs = [parse_replica_spec(s) for s in specs]
        self.refresh_s = refresh_s
        self.resolver = resolver
        self._last: dict[ReplicaSpec, list[str]] = {}

    @property
    def dynamic(self) -> bool:
        """Whether re-resolving can change the answer (some spec is a DNS name)."""
        return any(s.dns for s in self.specs)

    def resolve(self) -> list[str]:
        addresses: list[str] = []
        for spec in self.specs:
            if not spec.dns:
                found = [spec.address]
            else:
                try:
                    found = list(self.resolver(spec.host, spec.port))
                    self._last[spec] = found
                except OSError as exc:
                    found = self._last.get(spec, [])
                    log.warning("resolving %s failed (%s); keeping %d known replica(s)", spec.host, exc, len(found))
            addresses.extend(a for a in found if a not in addresses)
        return addresses


# --- the pool --------------------------------------------------------------------------------


@dataclass(eq=False)
class Replica:
    """One replica of a pool, with the sessions this coordinator has open on it.

    `healthy` is the last health check's verdict; `retired` means discovery no longer lists it.
    """

    address: str
    channel: grpc.Channel
    open_sessions: int = 0
    sessions_total: int = 0
    healthy: bool = True
    retired: bool = False
    last_status: str = "unchecked"

    @classmethod
    def connect(cls, address: str) -> "Replica":
        return cls(address, make_channel(address, options=[("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]))

    @property
    def eligible(self) -> bool:
        """May take new sessions."""
        return self.healthy and not self.retired


HealthCheck = Callable[[Sequence[Replica], float], list[tuple[bool, str]]]


def check_health(replicas: Sequence[Replica], timeout: float) -> list[tuple[bool, str]]:
    """(healthy, status) per replica, from concurrent `Health/Check` calls on the server's "" service."""
    request = health_pb2.HealthCheckRequest(service="")
    futures = [health_pb2_grpc.HealthStub(r.channel).Check.future(request, timeout=timeout) for r in replicas]
    verdicts: list[tuple[bool, str]] = []
    for fut in futures:
        try:
            status = fut.result().status
            verdicts.append((status == SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(status)))
        except grpc.RpcError as exc:
            verdicts.append((False, exc.code().name if callable(getattr(exc, "code", None)) else "ERROR"))
    return verdicts


@dataclass
class PoolOptions:
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S  # 0: no health checks (every replica counts as healthy)
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    refresh_s: float = DEFAULT_REFRESH_S  # DNS re-resolution period
    connect: Callable[[str], Replica] = field(default=Replica.connect)
    health_check: HealthCheck = field(default=check_health)
    resolver: Resolver = field(default=resolve_dns)


class ReplicaPool:
    """Replicas of one service; a new session goes to the least loaded healthy replica.

    `addresses` are specs (`host:port` or `dns:///name:port`). The constructor resolves them and
    checks health once before returning, then a daemon thread keeps both up to date.
    """

    def __init__(self, addresses: Sequence[str], options: PoolOptions | None = None, name: str = "replicas"):
        self.options = options or PoolOptions()
        self.name = name
        self.discovery = Discovery(addresses, self.options.refresh_s, self.options.resolver)
        self._replicas: list[Replica] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._rr = itertools.count()
        self._stop = threading.Event()
        self.refresh()
        self.check_health()
        if self.options.health_interval_s > 0 or self.discovery.dynamic:
            self._thread = threading.Thread(target=self._watch, daemon=True, name=f"specd-pool-{name}")
            self._thread.start()

    # -- selection --

    @property
    def replicas(self) -> list[Replica]:
        """The current replicas, retired ones still draining included (a snapshot)."""
        with self._lock:
            return list(self._replicas)

    def acquire(self) -> Replica:
        """Counts a new session on the chosen replica; raises Unavailable when none is eligible."""
        with self._lock:
            replicas = self._replicas
            i = least_loaded([r.open_sessions for r in replicas], [r.eligible for r in replicas],
                             next(self._rr) % max(len(replicas), 1))
            if i is None:
                states = ", ".join(f"{r.address} {'retired' if r.retired else r.last_status}" for r in replicas)
                raise Unavailable(f"no healthy {self.name} replica ({states or 'none discovered'}); retry later")
            replica = replicas[i]
            replica.open_sessions += 1
            replica.sessions_total += 1
            return replica

    def release(self, replica: Replica) -> None:
        with self._lock:
            replica.open_sessions -= 1
            if replica.retired and replica.open_sessions <= 0 and replica in self._replicas:
                self._replicas.remove(replica)
                replica.channel.close()
                log.info("%s replica %s retired: its last session closed", self.name, replica.address)

    def wait_for_replica(self, timeout: float) -> Replica:
        """Some non-retired replica (healthy or not), waiting up to `timeout` for discovery to find one."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                live = [r for r in self._replicas if not r.retired]
                if live:
                    return live[0]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Unavailable(f"no {self.name} replica discovered within {timeout:g}s")
                self._changed.wait(remaining)

    # -- discovery and health --

    def refresh(self) -> None:
        """Resolves the specs once: adds new replicas, retires vanished ones, revives returning ones."""
        addresses = self.discovery.resolve()
        with self._lock:
            known = {r.address: r for r in self._replicas}
            for address in addresses:
                replica = known.get(address)
                if replica is None:
                    self._replicas.append(self.options.connect(address))
                    log.info("%s replica %s discovered", self.name, address)
                elif replica.retired:
                    replica.retired = False
                    log.info("%s replica %s is back", self.name, address)
            for replica in list(self._replicas):
                if replica.address not in addresses and not replica.retired:
                    replica.retired = True
                    log.info("%s replica %s vanished from discovery: retiring it", self.name, replica.address)
                    if replica.open_sessions <= 0:
                        self._replicas.remove(replica)
                        replica.channel.close()
            self._changed.notify_all()

    def check_health(self) -> None:
        """One round of health checks over every replica, concurrently."""
        if self.options.health_interval_s <= 0:
            return
        replicas = self.replicas
        if not replicas:
            return
        verdicts = self.options.health_check(replicas, self.options.health_timeout_s)
        with self._lock:
            for replica, (healthy, status) in zip(replicas, verdicts):
                if healthy != replica.healthy:
                    level = logging.INFO if healthy else logging.WARNING
                    log.log(level, "%s replica %s is %s (%s)", self.name, replica.address,
                            "healthy again" if healthy else "unhealthy: no new sessions", status)
                replica.healthy = healthy
                replica.last_status = status

    def report_failure(self, replica: Replica) -> None:
        """A session on `replica` just failed at the transport level (the caller fails over or
        goes on without it): check the replica's health now rather than at the next round, so
        that new sessions, the failover's included, avoid it at once if it is down or draining.
        A replica that still answers SERVING stays eligible (one broken stream is not a dead
        replica). Without health checks (interval 0) this does nothing."""
        if self.options.health_interval_s <= 0:
            return
        healthy, status = self.options.health_check([replica], self.options.health_timeout_s)[0]
        with self._lock:
            if replica.healthy and not healthy:
                log.warning("%s replica %s failed a session and is unhealthy (%s): no new sessions",
                            self.name, replica.address, status)
            replica.healthy = healthy
            replica.last_status = status

    def _watch(self) -> None:
        interval = self.options.health_interval_s
        next_refresh = time.monotonic() + self.discovery.refresh_s
        while not self._stop.wait(interval if interval > 0 else self.discovery.refresh_s):
            try:
                if self.discovery.dynamic and time.monotonic() >= next_refresh:
                    next_refresh = time.monotonic() + self.discovery.refresh_s
                    self.refresh()
                self.check_health()
            except Exception:  # the watcher must outlive a bad round
                log.exception("%s pool: discovery or health round failed", self.name)

    def snapshot(self) -> list[dict[str, Any]]:
        """Per replica: address, healthy, retired, last status, open and total sessions (for stats and tests)."""
        with self._lock:
            return [{"address": r.address, "healthy": r.healthy, "retired": r.retired, "status": r.last_status,
                     "open_sessions": r.open_sessions, "sessions_total": r.sessions_total} for r in self._replicas]

    def close(self) -> None:
        self._stop.set()
        for r in self.replicas:
            r.channel.close()
