"""Autoscaling the target deployment on the load its replicas report, not on Serve's request count.

A target replica's real load is its open sessions (each holds a KV row for the whole request)
and the verify work queued for its model; Serve's own metric, ongoing requests, sees only the
short verify calls in flight. Each replica reports both through `record_autoscaling_stats`;
this policy asks for enough replicas that each holds about `target_ongoing_requests` of that
load. Serve then applies the config's bounds, scaling factors and up/down delays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def desired_replicas(open_sessions: float, queue_depth: float, per_replica: float, current: int) -> int:
    """Replicas for this load at `per_replica` each; `current` when nothing was reported yet."""
    if per_replica <= 0:
        raise ValueError("per_replica must be positive")
    load = open_sessions + queue_depth
    return max(1, math.ceil(load / per_replica)) if load > 0 or current > 0 else 0


def _total(metrics: Mapping[str, Mapping[Any, float]] | None, name: str) -> float | None:
    if not metrics or name not in metrics:
        return None
    return float(sum(metrics[name].values()))


def session_load_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Serve's custom policy entry point (AutoscalingContext in, (replicas, state) out)."""
    metrics = ctx.aggregated_metrics
    sessions = _total(metrics, "open_sessions")
    if sessions is None:  # no report yet: keep what we have
        return ctx.target_num_replicas, ctx.policy_state or {}
    queue = _total(metrics, "queue_depth") or 0.0
    per_replica = ctx.config.get_target_ongoing_requests()
    return desired_replicas(sessions, queue, per_replica, ctx.current_num_replicas), ctx.policy_state or {}
