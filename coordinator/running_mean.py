"""A running mean that becomes a moving average: the statistic behind the controller's cost
cells and fills."""

from __future__ import annotations


class RunningMean:
    """Running mean for the first `window` samples, then an exponential moving average."""

    __slots__ = ("mean", "count")

    def __init__(self, mean: float = 0.0, count: float = 0.0):
        self.mean, self.count = mean, count

    def add(self, x: float, window: float) -> None:
        self.count += 1
        self.mean += (x - self.mean) * max(1.0 / self.count, 1.0 / window)

    def weight(self, window: float) -> float:
        return min(self.count, window)
