"""Deadlines for single calls on a long-lived stream.

A session is one bidi stream with one deadline (the request's), so a single draft or verify call
on it cannot carry a deadline of its own: reading the next reply just blocks. The watchdog runs
a callback (cancelling the stream) when a call outlives its budget; the blocked read then fails
and the session reports the call as timed out. One daemon thread serves every call of the
process: arming and disarming is a heap push and a flag, no thread per call.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Callable


class Alarm:
    """One armed deadline; `disarm` it when the call returns in time. `fired` tells whether it ran."""

    __slots__ = ("when", "callback", "cancelled", "fired")

    def __init__(self, when: float, callback: Callable[[], None]):
        self.when = when
        self.callback = callback
        self.cancelled = False
        self.fired = False

    def disarm(self) -> None:
        self.cancelled = True


class Watchdog:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Alarm]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, callback: Callable[[], None]) -> Alarm:
        """Runs `callback` on the watchdog's thread in `seconds` unless disarmed first."""
        alarm = Alarm(time.monotonic() + seconds, callback)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="specd-watchdog")
                self._thread.start()
            heapq.heappush(self._heap, (alarm.when, next(self._seq), alarm))
            if self._heap[0][2] is alarm:  # a new earliest deadline: wake the thread to re-time its wait
                self._cond.notify()
        return alarm

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][2].cancelled:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                alarm = heapq.heappop(self._heap)[2]
                if alarm.cancelled:
                    continue
                alarm.fired = True
            try:
                alarm.callback()
            except Exception:  # a failing callback must not stop the watchdog
                pass


WATCHDOG = Watchdog()
