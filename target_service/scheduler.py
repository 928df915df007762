"""Batches verify requests of different sessions into shared forward passes, on one model thread.

Session handlers (one thread per gRPC stream) submit work and block on its result. The model
thread runs queued prefills first, each alone (`next_prefill`), then verifies: a verify waits for
other sessions' verifies and runs them together, up to `max_batch_size`:

- at least `batch_wait_ms` for any other session (none once every open session is queued);
- longer, up to `straggler_wait_ms` and at most half the recent pass time, for the sessions that
  are on their way back: handed a result moments ago, now crossing the coordinator and the draft
  service. Without this, a session that misses a pass by a few ms (a draft round trip) waits a
  whole pass for the next one and then runs in a small pass of its own: the sessions split into
  groups that take turns, and each group pays the pass's fixed cost (on this project's CPU machines
  one row costs 70 % of eight). See `straggler_wait_s` and `awaited_sessions`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping, Sequence

from draft_service.proposers.base import Proposal
from specd.telemetry import Telemetry, batch_bucket, noop_telemetry
from target_service.rejection_sampler import VerifyOutcome
from target_service.verifier import TargetModel, TargetSession

log = logging.getLogger(__name__)


@dataclass
class _Work:
    session: TargetSession
    proposal: Proposal | None  # None: prefill
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class StepTiming:
    queue_ms: float
    compute_ms: float
    batch_size: int
    block_length: int = 1  # positions per row of the pass (the longest block in it)
    positions: int = 1  # positions the pass computed, all rows together
    packed: bool = False  # whether the replica packs rows of different block lengths
    pass_id: int = 0  # the verify pass's number on this replica, from 1 (0: a prefill)


class BatchStats:
    """Batch sizes seen, verify latency by (batch size, block length, positions computed), and
    the prefills' count and time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batch_sizes: dict[int, int] = defaultdict(int)
        self.latency: dict[tuple[int, int, int], tuple[int, float]] = {}  # -> (count, total ms)
        self.prefills = 0
        self.prefill_ms = 0.0

    def record(self, batch_size: int, block_length: int, ms: float, positions: int) -> None:
        """positions: what the pass computed, all rows together."""
        key = (batch_size, block_length, positions)
        with self.lock:
            self.batch_sizes[batch_size] += 1
            count, total = self.latency.get(key, (0, 0.0))
            self.latency[key] = (count + 1, total + ms)

    def record_prefill(self, ms: float) -> None:
        with self.lock:
            self.prefills += 1
            self.prefill_ms += ms

    def mean_batch_size(self) -> float:
        with self.lock:
            passes = sum(self.batch_sizes.values())
            return sum(b * c for b, c in self.batch_sizes.items()) / passes if passes else 0.0


# Waiting for a straggler idles the model; missing it costs a pass of its own later, which on a
# weight-bound model is nearly a whole pass. Half a pass bounds the first by a fraction of the second.
STRAGGLER_WAIT_FRACTION = 0.5
PASS_EMA = 0.2  # weight of the newest verify pass in the moving pass time


def straggler_wait_s(pass_s: float | None, floor_s: float, cap_s: float) -> float:
    """How long a verify may wait for sessions on their way back: half the recent pass time,
    within [floor_s, cap_s] (floor_s until a pass has been timed)."""
    if pass_s is None:
        return floor_s
    return max(floor_s, min(STRAGGLER_WAIT_FRACTION * pass_s, cap_s))


def awaited_sessions(open_ids: Iterable[int], queued_ids: Collection[int], delivered_at: Mapping[int, float],
                     now: float, horizon_s: float) -> set[int]:
    """The open sessions worth waiting for: not queued, and handed a result less than `horizon_s`
    ago, so presumably on their way back with the next block. A session idle for longer (its
    client is slow, or it is done and about to close) is not waited for."""
    return {sid for sid in open_ids
            if sid not in queued_ids and sid in delivered_at and now - delivered_at[sid] < horizon_s}


def next_prefill(is_prefill: Sequence[bool], prefills_ahead: int, limit: int) -> int | None:
    """Which queued request (by queue position) to run now as a prefill, or None for a verify pass.

    Prefills go first: the oldest queued prefill runs before any verify pass, unless `limit`
    prefills in a row have already run ahead of waiting verifies (`prefills_ahead`), so a stream of
    new sessions cannot stall the open ones for long. Why: a session waiting for its prefill is
    missing from the verify passes that run meanwhile, and a pass of fewer rows costs nearly as
    much as a full one (on this project's CPU machines 70 % of a pass is reading the weights). In
    oldest-first order, sessions that finished in the same pass were prefilled one by one between
    passes, each missing the passes queued before its prefill. Prefilled back to back, they join
    the next pass together, and new requests get their first token sooner: at 16 extraction
    sessions with fixed k = 2 the median time to first token went from 1.7 s to 1.4-1.5 s
    (docs/benchmarks.md, "Fixed work held at its concurrency")."""
    if not any(is_prefill):
        return None
    if prefills_ahead >= limit and not all(is_prefill):
        return None
    return is_prefill.index(True)


class VerifyScheduler:
    def __init__(self, target: TargetModel, max_batch_size: int = 16, batch_wait_ms: float = 5.0,
                 telemetry: Telemetry | None = None, straggler_wait_ms: float = 40.0, torch_threads: int | None = None):
        """torch_threads: the model thread's intra-op threads (torch.set_num_threads on it), for a
        process that kept its main thread serial (`specd.openmp.serial_until_model_thread`);
        None: torch's process-wide setting."""
        self.target = target
        self.torch_threads = torch_threads
        self.telemetry = telemetry or noop_telemetry()
        self.max_batch_size = max_batch_size
        self.batch_wait = batch_wait_ms / 1000.0
        self.straggler_wait_cap = max(straggler_wait_ms / 1000.0, self.batch_wait)
        self.stats = BatchStats()
        self._pass_s: float | None = None  # moving verify pass time
        self._passes = 0  # verify passes run (each pass's rows report its number)
        self._delivered_at: dict[int, float] = {}  # session id -> when its last result was handed out
        self._prefills_ahead = 0  # prefills run in a row while verifies waited (`next_prefill`)
        self._last_end: float | None = None  # when the last pass (prefill or verify) ended
        self._queue: deque[_Work] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="specd-model", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def prefill(self, session: TargetSession) -> tuple[int, StepTiming]:
        return self._submit(_Work(session, None))

    def verify(self, session: TargetSession, proposal: Proposal) -> tuple[VerifyOutcome, StepTiming]:
        session.check_block(proposal)  # reject bad blocks in the caller's thread, before batching
        return self._submit(_Work(session, proposal))

    def _submit(self, work: _Work):
        with self._cv:
            if self._stopped:
                raise RuntimeError("scheduler stopped")
            self._queue.append(work)
            self._cv.notify()
        return work.future.result()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def forget(self, session: TargetSession) -> None:
        """A session closed: stop waiting for it."""
        with self._cv:
            if self._delivered_at.pop(session.session_id, None) is not None:
                self._cv.notify()

    def _run(self) -> None:
        if self.torch_threads is not None:
            import torch

            torch.set_num_threads(self.torch_threads)
            log.info("model thread: %d torch threads, the main thread serial (one OpenMP team)",
                     torch.get_num_threads())
        self._tune_kernels()
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._execute(batch)

    def _tune_kernels(self) -> None:
        """Products of a few token rows on the faster kernel, timed here, on the thread and threads
        that run the passes (specd/cpu_kernels.py, `tune_few_rows`); about 1.5 s for the bundled
        model on the 2-core machines, a few seconds more while the machine is busy."""
        from specd.cpu_kernels import runs_onednn, tune_few_rows

        module = getattr(getattr(self.target, "model", None), "model", None)
        if module is None or not runs_onednn(module):
            return
        rows = tune_few_rows(module)
        log.info("linear layers: products of up to %d token rows on torch's kernel, wider ones on oneDNN's", rows)

    def _next_batch(self) -> list[_Work] | None:
        with self._cv:
            while not self._queue and not self._stopped:
                self._cv.wait()
            if self._stopped and not self._queue:
                return None
            start = time.perf_counter()
            floor_deadline = start + self.batch_wait
            budget = straggler_wait_s(self._pass_s, self.batch_wait, self.straggler_wait_cap)
            deadline = start + budget
            while True:
                prefill = self._take_prefill()  # ahead of the pass; stragglers come back while it runs
                if prefill is not None:
                    return [prefill]
                queued = {w.session.session_id for w in self._queue if w.proposal is not None}
                now = time.perf_counter()
                everyone_here = len(queued) >= len(self.target.sessions)
                awaited = awaited_sessions(list(self.target.sessions), queued, self._delivered_at, now, budget)
                until = deadline if awaited else floor_deadline
                if len(queued) >= self.max_batch_size or everyone_here or now >= until:
                    break
                self._cv.wait(until - now)
            self._prefills_ahead = 0
            batch: list[_Work] = []
            rest: deque[_Work] = deque()
            while self._queue:
                w = self._queue.popleft()
                (batch if w.proposal is not None and len(batch) < self.max_batch_size else rest).append(w)
            self._queue = rest
            if log.isEnabledFor(logging.DEBUG):
                self._log_missing(batch, rest)
            return batch

    def _log_missing(self, batch: list[_Work], rest: Iterable[_Work]) -> None:
        """DEBUG: the open sessions a verify pass runs without, and why (under `_cv`)."""
        now = time.perf_counter()
        rows = {w.session.session_id for w in batch}
        prefilling = {w.session.session_id for w in rest if w.proposal is None}
        missing = [(sid, "prefill queued" if sid in prefilling else
                    f"{1000 * (now - self._delivered_at[sid]):.0f} ms since its result" if sid in self._delivered_at
                    else "not prefilled") for sid in list(self.target.sessions) if sid not in rows]
        last_end = self._last_end if self._last_end is not None else now
        since = [1000 * (w.enqueued - last_end) for w in batch]
        log.debug("verify pass of %d rows, %d open, the rows queued %.1f-%.1f ms after the last pass ended, "
                  "starting %.1f ms after it; not in it: %s", len(batch), len(self.target.sessions), min(since),
                  max(since), 1000 * (now - last_end), ", ".join(f"{sid} ({why})" for sid, why in missing) or "none")

    def _take_prefill(self) -> _Work | None:
        """Removes and returns the prefill to run now, if any (`next_prefill`); under `_cv`."""
        i = next_prefill([w.proposal is None for w in self._queue], self._prefills_ahead, self.max_batch_size)
        if i is None:
            return None
        work = self._queue[i]
        del self._queue[i]
        if any(w.proposal is not None for w in self._queue):
            self._prefills_ahead += 1
        return work

    def _execute(self, batch: list[_Work]) -> None:
        start = time.perf_counter()
        try:
            if batch[0].proposal is None:
                results = [self.target.prefill(batch[0].session)]
            else:
                results = self.target.verify_batch([(w.session, w.proposal) for w in batch])  # type: ignore[misc]
        except BaseException as exc:  # hand the error to every waiting session; keep serving
            for w in batch:
                w.future.set_exception(exc)
            return
        end = time.perf_counter()
        idle_before = start - (self._last_end if self._last_end is not None else start)
        self._last_end = end
        compute_ms = (end - start) * 1000
        block = 1
        forward = getattr(self.target, "forward", None)
        positions = getattr(forward, "last_positions", 0)
        packed = bool(getattr(forward, "packed", False))
        pass_id = 0
        if batch[0].proposal is not None:
            self._passes += 1
            pass_id = self._passes
            block = max(len(w.proposal.tokens) for w in batch) + 1  # type: ignore[union-attr]
            positions = positions or len(batch) * block
            self.stats.record(len(batch), block, compute_ms, positions)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("verify pass %d: blocks %s, %d positions, %.1f ms", pass_id,
                          sorted(len(w.proposal.tokens) + 1 for w in batch), positions, compute_ms)  # type: ignore[union-attr]
            seconds = end - start
            self._pass_s = seconds if self._pass_s is None else self._pass_s + PASS_EMA * (seconds - self._pass_s)
        else:
            self.stats.record_prefill(compute_ms)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("prefill of %d tokens: %.1f ms, starting %.1f ms after the last pass ended",
                          len(batch[0].session.prompt_ids), compute_ms, 1000 * idle_before)
        with self._cv:
            for w in batch:
                self._delivered_at[w.session.session_id] = end
            for sid in [sid for sid in self._delivered_at if sid not in self.target.sessions]:
                del self._delivered_at[sid]  # closed sessions (forget() is only a prompt for the waiting loop)
        if self.telemetry.metrics_on:
            self._record(batch, start, compute_ms / 1000)
        for w, result in zip(batch, results):
            w.future.set_result((result, StepTiming((start - w.enqueued) * 1000, compute_ms, len(batch), block,
                                                    positions, packed, pass_id)))

    def _record(self, batch: list[_Work], start: float, seconds: float) -> None:
        m = self.telemetry.target
        if batch[0].proposal is None:
            m.forward_passes.add(1, m.prefill_attrs)
            m.prefill_duration.record(seconds)
        else:
            m.forward_passes.add(1, m.verify_attrs)
            m.batch_size.record(len(batch))
            m.verify_duration.record(seconds, {"specd.batch_size": batch_bucket(len(batch))})
        for w in batch:
            m.queue_duration.record(start - w.enqueued)
