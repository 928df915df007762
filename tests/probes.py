"""Readings tests take of running services: open sessions on both replicas, OTel metric points."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from specd.grpc_server import make_channel
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


def wait_no_sessions(target_address: str, draft_address: str, within: float, tls: Any = None,
                     poll_s: float = 0.05) -> tuple[int, int]:
    """(target, draft) open sessions once both are zero, or when `within` seconds have passed."""
    with make_channel(target_address, tls=tls) as t, make_channel(draft_address, tls=tls) as d:
        target, draft = target_pb2_grpc.TargetServiceStub(t), draft_pb2_grpc.DraftServiceStub(d)
        deadline = time.monotonic() + within
        while True:
            counts = (target.GetStats(target_pb2.GetStatsRequest(), timeout=5).open_sessions,
                      draft.GetStats(draft_pb2.GetDraftStatsRequest(), timeout=5).open_sessions)
            if counts == (0, 0) or time.monotonic() > deadline:
                return counts
            time.sleep(poll_s)


def metric_points(reader: InMemoryMetricReader, name: str) -> list[tuple[dict, float]]:
    """(attributes, value) of every data point of the metric `name` the reader holds."""
    out = []
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    out.extend((dict(p.attributes), p.value) for p in m.data.data_points)
    return out
