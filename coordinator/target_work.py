"""What a target replica did between two readings of its stats: verify passes and prefills.

The depth a configuration runs decides the verify passes' work; the prefills are the same for
every configuration of a cell (one per request) but swing with the machine, and at 16 code edits
they are two thirds of the wall time (docs/benchmarks.md). The verify time a token streamed is
the figure the depth choice moves, apart from that swing: `scripts/held_cells.py` and
`specd bench-load` print it beside tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.v1 import target_pb2, target_pb2_grpc

WorkReading = dict[int, tuple[int, float]]  # rows -> (passes, total ms); the prefills under 0


def target_work(stub: target_pb2_grpc.TargetServiceStub) -> WorkReading:
    """The target's verify passes so far by rows: rows -> (passes, total ms), and its prefills
    under rows 0."""
    stats = stub.GetStats(target_pb2.GetStatsRequest(), timeout=5)
    totals: WorkReading = {0: (stats.prefills, stats.prefill_ms)}
    for row in stats.verify_latency:
        count, ms = totals.get(row.batch_size, (0, 0.0))
        totals[row.batch_size] = (count + row.count, ms + row.count * row.mean_ms)
    return totals


@dataclass(frozen=True)
class CellWork:
    """What the target did during one cell: its verify passes (count, mean rows, total ms) and
    its prefills (count, total ms)."""

    passes: int
    rows: float
    verify_ms: float
    prefills: int
    prefill_ms: float

    def verify_ms_a_token(self, tokens: int) -> float:
        """The verify passes' time over the tokens the cell streamed."""
        return self.verify_ms / max(tokens, 1)

    def prefill_ms_each(self) -> float:
        """The prefills' mean time (0 with none)."""
        return self.prefill_ms / self.prefills if self.prefills else 0.0


def cell_work(before: WorkReading, after: WorkReading) -> CellWork:
    """The difference of two `target_work` readings."""
    done = {b: (c - before.get(b, (0, 0.0))[0], ms - before.get(b, (0, 0.0))[1]) for b, (c, ms) in after.items()}
    prefills, prefill_ms = done.pop(0, (0, 0.0))
    count = sum(c for c, _ in done.values())
    rows = sum(b * c for b, (c, _) in done.items()) / count if count > 0 else 0.0
    return CellWork(count, rows, sum(ms for _, ms in done.values()), prefills, prefill_ms)
