"""Admission control: at most `max_running` requests generate at once, at most `max_queue` wait.

A request beyond both is refused at once with RESOURCE_EXHAUSTED and a retry hint, rather than
piling up threads, memory and latency; one that waits longer than `queue_timeout_s` (or its own
deadline) is refused the same way. Waiters are served first come, first served: a new arrival
never overtakes the queue. The gRPC and HTTP front ends share one `Admission`, so the limits hold
for the coordinator as a whole.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from specd.errors import ResourceExhausted

MIN_RETRY_MS = 100
MAX_RETRY_MS = 30_000
DEFAULT_RETRY_MS = 1_000
ALIVE_POLL_S = 0.1  # how often a queued request checks that its caller is still there


def retry_after_ms(mean_request_s: float | None, max_running: int) -> int:
    """When a refused client should try again: about when the next queue place frees, i.e. the mean
    request duration divided by the requests running, clamped to [MIN_RETRY_MS, MAX_RETRY_MS]
    (DEFAULT_RETRY_MS before any request has finished)."""
    if mean_request_s is None:
        return DEFAULT_RETRY_MS
    ms = 1000.0 * mean_request_s / max(max_running, 1)
    return int(min(max(ms, MIN_RETRY_MS), MAX_RETRY_MS))


class Overloaded(ResourceExhausted):
    """Refused by admission control; `retry_after_ms` is the hint sent with the refusal."""

    def __init__(self, message: str, retry_after_ms: int):
        super().__init__(f"{message}; retry in {retry_after_ms} ms", retry_after_ms=retry_after_ms)


class QueueDeadline(TimeoutError):
    """The caller's deadline passed while it waited in the queue (DEADLINE_EXCEEDED)."""


@dataclass
class AdmissionStats:
    running: int
    waiting: int
    admitted: int
    refused: int


class Ticket:
    """A running slot; `release` (or leaving the `with` block) frees it. Idempotent."""

    def __init__(self, admission: "Admission", timed: bool = True):
        self._admission = admission
        self._start = time.monotonic() if timed else None
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(None if self._start is None else time.monotonic() - self._start)

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Waiter(threading.Event):
    """A place in the queue; set when a running slot is handed to it."""


class Admission:
    def __init__(self, max_running: int, max_queue: int, queue_timeout_s: float = 30.0, ewma_alpha: float = 0.1):
        if max_running < 1 or max_queue < 0:
            raise ValueError("max_running must be >= 1 and max_queue >= 0")
        self.max_running = max_running
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._alpha = ewma_alpha
        self._lock = threading.Lock()
        self._queue: deque[Waiter] = deque()  # in arrival order; each is woken with its slot
        self._running = 0
        self._admitted = 0
        self._refused = 0
        self._mean_s: float | None = None

    @property
    def stats(self) -> AdmissionStats:
        with self._lock:
            return AdmissionStats(self._running, len(self._queue), self._admitted, self._refused)

    def retry_hint_ms(self) -> int:
        return retry_after_ms(self._mean_s, self.max_running)

    def _refuse(self, message: str) -> Overloaded:
        self._refused += 1
        return Overloaded(message, self.retry_hint_ms())

    def acquire(self, timeout: float | None = None, alive: Callable[[], bool] | None = None) -> Ticket:
        """A running slot, waiting in the queue for at most min(queue_timeout_s, `timeout`) seconds.

        Raises Overloaded (RESOURCE_EXHAUSTED) when the queue is full or the wait runs out. `alive`
        (e.g. the RPC's is_active) is polled while waiting: a caller that went away leaves the queue.
        """
        entry = self.enter()
        return entry if isinstance(entry, Ticket) else self.wait(entry, timeout, alive)

    def enter(self) -> "Ticket | Waiter":
        """Never blocks: a Ticket when a slot is free, else a place in the queue to `wait` on.
        Raises Overloaded when the queue is full."""
        with self._lock:
            if self._running < self.max_running and not self._queue:
                self._running += 1
                self._admitted += 1
                return Ticket(self)
            if len(self._queue) >= self.max_queue:
                raise self._refuse(f"the coordinator is at capacity ({self._running} requests running, "
                                   f"{len(self._queue)} queued)")
            waiter = Waiter()
            self._queue.append(waiter)
            return waiter

    def wait(self, waiter: "Waiter", timeout: float | None = None, alive: Callable[[], bool] | None = None) -> Ticket:
        """Blocks until `waiter` gets a slot, or refuses it after min(queue_timeout_s, `timeout`) or
        once `alive()` turns false."""
        wait = self.queue_timeout_s if timeout is None else min(self.queue_timeout_s, max(timeout, 0.0))
        deadline = time.monotonic() + wait
        gone = False
        while True:
            remaining = deadline - time.monotonic()
            if waiter.wait(max(0.0, min(remaining, ALIVE_POLL_S if alive is not None else remaining))):
                return Ticket(self)  # _release handed its slot over
            gone = alive is not None and not alive()
            if gone or remaining <= 0:
                break
        with self._lock:
            handed = waiter.is_set()  # the slot arrived just as the wait ended
            if not handed:
                self._queue.remove(waiter)
            elif not gone:
                return Ticket(self)
            if not gone and wait < self.queue_timeout_s:  # the caller's own deadline ran out first
                raise QueueDeadline(f"the request's deadline passed after {wait:.3g} s in the queue")
            if not gone:
                raise self._refuse(f"no capacity within {wait:g} s in the queue")
        if handed:
            Ticket(self, timed=False).release()  # pass the slot on
        raise Overloaded("the caller went away while queued", self.retry_hint_ms())

    def _release(self, seconds: float | None) -> None:
        with self._lock:
            if seconds is not None:  # the request durations' moving mean, for the retry hint
                self._mean_s = seconds if self._mean_s is None else (1 - self._alpha) * self._mean_s + self._alpha * seconds
            if self._queue:  # hand the slot straight to the oldest waiter: `_running` stays the same
                self._admitted += 1
                self._queue.popleft().set()
            else:
                self._running -= 1
