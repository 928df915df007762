"""Batches verify requests of different sessions into shared forward passes, on one model thread.

Session handlers (one thread per gRPC stream) submit work and block on its result. The model
thread takes the oldest request; a prefill runs alone, a verify waits up to `batch_wait_ms` for
other sessions' verifies (less when every open session is already queued) and runs them together,
up to `max_batch_size`.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from draft_service.proposers.base import Proposal
from specd.telemetry import Telemetry, batch_bucket, noop_telemetry
from target_service.rejection_sampler import VerifyOutcome
from target_service.verifier import TargetModel, TargetSession


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


class BatchStats:
    """Batch sizes seen and verify latency by (batch size, block length)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batch_sizes: dict[int, int] = defaultdict(int)
        self.latency: dict[tuple[int, int], tuple[int, float]] = {}  # -> (count, total ms)

    def record(self, batch_size: int, block_length: int, ms: float) -> None:
        with self.lock:
            self.batch_sizes[batch_size] += 1
            count, total = self.latency.get((batch_size, block_length), (0, 0.0))
            self.latency[(batch_size, block_length)] = (count + 1, total + ms)

    def mean_batch_size(self) -> float:
        with self.lock:
            passes = sum(self.batch_sizes.values())
            return sum(b * c for b, c in self.batch_sizes.items()) / passes if passes else 0.0


class VerifyScheduler:
    def __init__(self, target: TargetModel, max_batch_size: int = 16, batch_wait_ms: float = 5.0,
                 telemetry: Telemetry | None = None):
        self.target = target
        self.telemetry = telemetry or noop_telemetry()
        self.max_batch_size = max_batch_size
        self.batch_wait = batch_wait_ms / 1000.0
        self.stats = BatchStats()
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

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._execute(batch)

    def _next_batch(self) -> list[_Work] | None:
        with self._cv:
            while not self._queue and not self._stopped:
                self._cv.wait()
            if self._stopped and not self._queue:
                return None
            head = self._queue[0]
            if head.proposal is None:
                return [self._queue.popleft()]
            deadline = time.perf_counter() + self.batch_wait
            while True:
                verifies = sum(1 for w in self._queue if w.proposal is not None)
                everyone_here = verifies >= len(self.target.sessions)
                remaining = deadline - time.perf_counter()
                if verifies >= self.max_batch_size or everyone_here or remaining <= 0:
                    break
                self._cv.wait(remaining)
            batch: list[_Work] = []
            rest: deque[_Work] = deque()
            while self._queue:
                w = self._queue.popleft()
                (batch if w.proposal is not None and len(batch) < self.max_batch_size else rest).append(w)
            self._queue = rest
            return batch

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
        compute_ms = (time.perf_counter() - start) * 1000
        if batch[0].proposal is not None:
            block = max(len(w.proposal.tokens) for w in batch) + 1  # type: ignore[union-attr]
            self.stats.record(len(batch), block, compute_ms)
        if self.telemetry.metrics_on:
            self._record(batch, start, compute_ms / 1000)
        for w, result in zip(batch, results):
            w.future.set_result((result, StepTiming((start - w.enqueued) * 1000, compute_ms, len(batch))))

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
