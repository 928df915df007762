"""A Ray Serve request router that keeps each session on the replica holding its state.

Configured on the target and draft deployments (`request_router_config.request_router_class`).
The decision itself is `specd.ray_serve.affinity.route`; this class only feeds it the replicas'
ids and loads. A replica's load is the open-session count it last reported through
`record_routing_stats` plus the sessions this router has sent it since that report, so a burst
of new sessions between two reports still spreads.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specd.ray_serve.affinity import owner_of, route

OPEN_METHOD = "open"


class SessionAffinityRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._sent_since_report: dict[str, int] = {}
        self._last_report: dict[str, float] = {}

    def _load(self, replica: RunningReplica) -> tuple[float, bool]:
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        reported_at = float(stats.get("reported_at", 0.0))
        if self._last_report.get(rid) != reported_at:  # a fresh report counts those sessions itself
            self._last_report[rid] = reported_at
            self._sent_since_report[rid] = 0
        load = float(stats.get("open_sessions", 0)) + self._sent_since_report.get(rid, 0)
        return load, bool(stats.get("serving", 1))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not hasattr(self, "_sent_since_report"):
            self.initialize_state()
        metadata = pending_request.metadata if pending_request is not None else None
        session_id = metadata.session_id if metadata is not None else ""
        ids = [r.replica_id.unique_id for r in candidate_replicas]
        loads, serving = zip(*(self._load(r) for r in candidate_replicas)) if candidate_replicas else ((), ())
        ranks = route(session_id, ids, loads, serving)
        if metadata is not None and metadata.call_method == OPEN_METHOD and ranks and owner_of(session_id) is None:
            first = ids[ranks[0][0]]  # almost always the one taken: replicas accept many requests
            self._sent_since_report[first] = self._sent_since_report.get(first, 0) + 1
        return [[candidate_replicas[i] for i in rank] for rank in ranks]
