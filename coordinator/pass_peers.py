"""The sessions that share a target replica's passes (`PassPeers`): who they are, how well they
accept, how deep they draft, and when the replica's next probe pass is."""

from __future__ import annotations

import math
import threading
import time
from typing import Callable


class PassPeers:
    """The acceptance of every open session on one target replica, as their controllers last saw it.

    Sessions on a replica share its batched passes, so each controller chooses the depth for the
    pass (`pass_rates` over its own and its peers' acceptance) rather than for itself: a session
    with poor acceptance among good ones drafts along (the positions are paid for anyway), and a
    session with good acceptance among poor ones does not lengthen everyone's pass alone. All
    sessions see nearly the same acceptances, so they arrive at nearly the same depth.

    A session that has not drafted yet is "unproven": its acceptance is only the prior. When a
    controller asks whether a probe could pay (`others(..., optimistic=...)`), unproven peers count
    as optimistic too, so a batch of new sessions probes together, in one lengthened pass, instead
    of each waiting for peers that know no more than it does.

    Probes are also lined up in time (`probe_slot`): a probe lengthens the pass of every row, and
    sessions that arrive one by one (a server kept busy, not a burst) would each probe in a pass
    of its own. Thread-safe.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions: dict[int, tuple[float, bool, float]] = {}  # handle -> (acceptance, proven, fill)
        self._depths: dict[int, int] = {}  # handle -> committed k
        self._anchors: dict[int, int] = {}  # handle -> the depth it drafts at on its own (`anchor`)
        self._next = 0
        self._lock = threading.Lock()
        self._clock = clock
        self._probe_opened = -math.inf  # when the last probe pass was opened (seconds, `clock`)

    def join(self, alpha: float, fill: float = 1.0) -> int:
        """A session opens; returns its handle."""
        with self._lock:
            self._next += 1
            self._sessions[self._next] = (alpha, False, fill)
            return self._next

    def update(self, handle: int, alpha: float, proven: bool = True, fill: float = 1.0) -> None:
        with self._lock:
            if handle in self._sessions:
                self._sessions[handle] = (alpha, proven, fill)

    def leave(self, handle: int) -> None:
        with self._lock:
            self._sessions.pop(handle, None)
            self._depths.pop(handle, None)
            self._anchors.pop(handle, None)

    def commit(self, handle: int, k: int) -> None:
        """Session `handle` now runs at depth k."""
        with self._lock:
            if handle in self._sessions:
                self._depths[handle] = k

    def anchor(self, handle: int, k: int) -> None:
        """Session `handle` would draft k tokens on its own merit: what its estimates gain at k
        beats the batch's margin. A session that drafts only because a peer does
        (`depth_math.batch_choice`) anchors 0."""
        with self._lock:
            if handle in self._sessions:
                self._anchors[handle] = k

    def deepest(self, handle: int, anchored: bool = False) -> int:
        """The largest depth another session runs at (0 if none speculates). `anchored`: the
        largest another session runs at on its own merit (the smaller of its depth and its
        anchor), so that sessions which draft only because a peer does hold no one up."""
        with self._lock:
            if not anchored:
                return max((k for h, k in self._depths.items() if h != handle), default=0)
            return max((min(k, self._anchors.get(h, 0)) for h, k in self._depths.items() if h != handle), default=0)

    def probe_slot(self, pass_s: float, period: int) -> bool:
        """Whether a session at k = 0 may probe now, in a pass of about `pass_s` seconds.

        A probe pass is opened at most once every `period` passes; the sessions that want to probe
        within half a pass of its opening join it (they step together: every row of a pass gets
        its result when the pass ends), the others wait for the next one. At batch 16 a block of
        3 costs about 1.8x a plain pass on this project's CPU machines. Sessions that arrive one
        by one (a server kept busy, not a burst) are out of step with each other: sixteen of them
        each probing one step in sixteen would lengthen about two passes in three
        (1 - (15/16)^16); lined up, they lengthen one pass in `period`."""
        now = self._clock()
        with self._lock:
            since = now - self._probe_opened
            if since <= pass_s / 2:
                return True
            if since >= period * pass_s:
                self._probe_opened = now
                return True
            return False

    def others(self, handle: int, optimistic: float | None = None) -> list[float]:
        """The acceptance of every session but `handle`; unproven ones at least `optimistic`."""
        return [a for a, _ in self.others_with_fills(handle, optimistic)]

    def others_with_fills(self, handle: int, optimistic: float | None = None) -> list[tuple[float, float]]:
        """(acceptance, fill) of every session but `handle`, as `others`; with `optimistic`, an
        unproven session counts as filling its blocks too (it has not asked for one yet)."""
        with self._lock:
            return [(max(a, optimistic), 1.0) if optimistic is not None and not proven else (a, fill)
                    for h, (a, proven, fill) in self._sessions.items() if h != handle]

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
