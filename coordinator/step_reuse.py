"""A value one step computed, reused at the next few steps while what it rests on is unchanged.

A session that the depth controller keeps at k = 0 asks the same questions at step after step
(what depth pays now, whether a probe would, how many idle steps a gated probe waits) and gets the
same answers until its evidence, its batch or its method's recent sessions change. At 16
sessions those lookups run 16 times between one pass's end and the next pass's start, serialized
by the coordinator's interpreter lock, so each answer is kept for a few steps (`StepReuse`).
What the key leaves out (the replica's costs, the peers) moves over many passes, and a reused
answer is at most `steps` - 1 steps old.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, TypeVar

T = TypeVar("T")


class StepReuse(Generic[T]):
    """One cached answer: `get(key, compute, steps)` returns the answer kept for `key` while it is
    younger than `steps` steps (each call is a step), else computes it. A key of None never
    reuses; `keep(value)` False does not keep the new answer (only settled answers are kept)."""

    def __init__(self) -> None:
        self._key: Hashable | None = None
        self._value: T | None = None
        self._age = 0

    def get(self, key: Hashable | None, compute: Callable[[], T], steps: int,
            keep: Callable[[T], bool] = lambda value: True) -> T:
        if key is not None and key == self._key and self._age < steps:
            self._age += 1
            return self._value  # type: ignore[return-value]
        value = compute()
        if key is not None and keep(value):
            self._key, self._value, self._age = key, value, 1
        else:
            self.forget()
        return value

    def forget(self) -> None:
        self._key, self._value, self._age = None, None, 0
