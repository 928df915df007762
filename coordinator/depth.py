"""Glue between the depth controller (pure policy, coordinator/controller.py) and the transports.

`DepthPolicy` gives each request its own `DepthController`, sharing one `CostModel` per target
replica (every session on a replica sees the same verify costs), and hands the engine the
replica's current load. `LoadMonitor` polls the target replicas' `GetStats` in the background:
queue depth and open sessions become `LoadSignal`s, and the first answer seeds the replica's cost
model with the verify latencies the replica has already measured, so a restarted coordinator
does not start from the prior. It also counts requests per second, for the load generator's
report and the k-over-time plot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable

import grpc

from coordinator.controller import CostModel, DepthController, LoadSignal, PassPeers, SharedAcceptance, make_controller

log = logging.getLogger(__name__)

EMBEDDED = "embedded"


def replica_key(session: Any) -> str:
    """The replica a target session lives on ("embedded" for in-process sessions)."""
    replica = getattr(session, "replica", None)
    return getattr(replica, "address", EMBEDDED)


class CostModels:
    """One CostModel and one SharedAcceptance per (target replica, drafting method), and one
    PassPeers per target replica, created on first use: verify costs belong to the replica, draft
    costs and acceptance to the method, and the passes to the replica whatever each session's method."""

    def __init__(self, factory: Callable[[], CostModel] = CostModel):
        self._factory = factory
        self._models: dict[str, CostModel] = {}
        self._acceptance: dict[str, SharedAcceptance] = {}
        self._peers: dict[str, PassPeers] = {}
        self._lock = threading.Lock()

    def get(self, key: str, method: str = "") -> CostModel:
        name = f"{key}|{method}" if method else key
        with self._lock:
            model = self._models.get(name)
            if model is None:
                model = self._models[name] = self._factory()
                base = self._models.get(key) if method else None
                if base is not None:  # verify costs already learnt or seeded for the replica
                    model.seed_from_stats(base.verify_table())
            return model

    def acceptance(self, key: str, method: str) -> SharedAcceptance:
        with self._lock:
            return self._acceptance.setdefault(f"{key}|{method}", SharedAcceptance())

    def peers(self, key: str) -> PassPeers:
        with self._lock:
            return self._peers.setdefault(key, PassPeers())

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._models


class DepthPolicy:
    """What the engine needs for per-request depth control: `controller(target)` and `load(target)`.

    spec: "auto", an integer k, or "schedule:B=K,...", each optionally with ",floor=A" (see
    `make_controller`); validated here so that a bad spec fails at request start, naming itself.
    """

    def __init__(self, spec: str = "auto", k_max: int = 8, costs: CostModels | None = None,
                 monitor: "LoadMonitor | None" = None):
        make_controller(spec, k_max)  # raises ValueError on a bad spec
        self.spec = spec
        self.k_max = k_max
        self.costs = costs or CostModels()
        self.monitor = monitor

    def controller(self, target: Any, method: str = "") -> DepthController:
        key = replica_key(target)
        return make_controller(self.spec, self.k_max, self.costs.get(key, method), self.costs.acceptance(key, method),
                               self.costs.peers(key))

    def cost_model(self, target: Any, method: str = "") -> CostModel:
        """The cost model `target`'s replica shares with the sessions of `method` (a fixed k's
        steps record their costs in it, as a controller's do)."""
        return self.costs.get(replica_key(target), method)

    def acceptance(self, target: Any, method: str) -> SharedAcceptance:
        """The record of acceptance `target`'s replica keeps for `method` (a fixed k's sessions
        report to it, as a controller's do)."""
        return self.costs.acceptance(replica_key(target), method)

    def load(self, target: Any) -> LoadSignal | None:
        if self.monitor is None:
            return None
        return self.monitor.load(replica_key(target))

    def with_spec(self, spec: str, k_max: int | None = None) -> "DepthPolicy":
        """The same cost models and monitor under another spec (a per-request override)."""
        return DepthPolicy(spec, self.k_max if k_max is None else k_max, self.costs, self.monitor)


class RequestRate:
    """Requests per second over a sliding window."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._times: deque[float] = deque()
        self._lock = threading.Lock()

    def record(self, now: float | None = None) -> None:
        with self._lock:
            self._times.append(time.monotonic() if now is None else now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._times and self._times[0] < now - self.window_s:
                self._times.popleft()
            return len(self._times) / self.window_s


class LoadMonitor:
    """Polls each target replica's GetStats every `interval_s` seconds in a daemon thread.

    `replicas()` returns (address, stub) pairs to poll (the pool's current replicas), so replicas
    that come and go are followed. A replica that does not answer keeps its last signal.
    """

    def __init__(self, replicas: Callable[[], Iterable[tuple[str, Any]]], costs: CostModels,
                 interval_s: float = 0.25, timeout_s: float = 1.0):
        self._replicas = replicas
        self.costs = costs
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._signals: dict[str, LoadSignal] = {}
        self._seeded: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.requests = RequestRate()
        self._thread = threading.Thread(target=self._run, name="specd-load-monitor", daemon=True)

    def start(self) -> "LoadMonitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def load(self, key: str) -> LoadSignal | None:
        with self._lock:
            return self._signals.get(key)

    def poll_once(self) -> None:
        from specdec.v1 import target_pb2  # generated code: imported late so the module imports without it

        for address, stub in list(self._replicas()):
            with self._lock:
                seeded = address in self._seeded
            try:
                # The latency table only until it has seeded the replica's cost model: it grows
                # with every pass shape the replica has run, without bound, and it is built under
                # the target's interpreter lock, which its passes' thread needs between ops (on
                # the 2-core machines 1000 rows took 1.4 ms to build, 3000 4.3 ms; four polls a
                # second).
                stats = stub.GetStats(target_pb2.GetStatsRequest(load_only=seeded), timeout=self.timeout_s)
            except grpc.RpcError as exc:  # a replica that does not answer keeps its last signal
                log.debug("GetStats failed for %s: %s", address, exc.code())
                continue
            with self._lock:
                self._signals[address] = LoadSignal(int(stats.queue_depth), int(stats.open_sessions))
                self._seeded.add(address)
            if not seeded and stats.verify_latency:
                self.costs.get(address).seed_from_stats(stats.verify_latency)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
            except Exception:  # a bug here must not end polling silently: say it, keep polling
                log.warning("load monitor: polling the target replicas failed", exc_info=True)
