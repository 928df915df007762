"""The verify scheduler's batching, against a fake target whose passes take a fixed time."""

from __future__ import annotations

import logging
import threading
import time
import types

import pytest

from draft_service.proposers.base import Proposal
from target_service.rejection_sampler import VerifyOutcome
from target_service.scheduler import VerifyScheduler, awaited_sessions, next_prefill, straggler_wait_s

PASS_S = 0.06


class FakeSession:
    def __init__(self, session_id: int):
        self.session_id = session_id
        self.prompt_ids = [1, 2, 3]

    def check_block(self, proposal: Proposal) -> None:
        pass


class FakeTarget:
    """Passes that take PASS_S whatever their size, and a log of each pass's session ids."""

    def __init__(self, n: int):
        self.sessions = {i: FakeSession(i) for i in range(n)}
        self.passes: list[list[int]] = []

    def verify_batch(self, items):
        time.sleep(PASS_S)
        self.passes.append(sorted(s.session_id for s, _ in items))
        return [VerifyOutcome(0, [1]) for _ in items]


def test_straggler_wait_is_half_a_pass_within_floor_and_cap() -> None:
    assert straggler_wait_s(None, 0.002, 0.04) == 0.002  # no pass timed yet
    assert straggler_wait_s(0.05, 0.002, 0.04) == pytest.approx(0.025)
    assert straggler_wait_s(0.2, 0.002, 0.04) == 0.04
    assert straggler_wait_s(0.001, 0.002, 0.04) == 0.002


def test_awaited_sessions_are_recent_and_not_queued() -> None:
    delivered = {1: 10.00, 2: 10.00, 3: 9.90}
    assert awaited_sessions([1, 2, 3, 4], {1}, delivered, now=10.01, horizon_s=0.03) == {2}
    assert awaited_sessions([1, 3], set(), delivered, now=10.05, horizon_s=0.03) == set()


def run_two_sessions(straggler_wait_ms: float, late_s: float = 0.010, steps: int = 6) -> list[list[int]]:
    """Session 0 comes straight back after each result; session 1 comes back `late_s` later (a
    draft round trip). Returns the target's passes, after a first pass that times the model."""
    target = FakeTarget(2)
    scheduler = VerifyScheduler(target, max_batch_size=8, batch_wait_ms=2.0,  # type: ignore[arg-type]
                                straggler_wait_ms=straggler_wait_ms)
    try:
        def loop(sid: int, delay: float) -> None:
            for _ in range(steps):
                time.sleep(delay)
                scheduler.verify(target.sessions[sid], Proposal([5]))

        threads = [threading.Thread(target=loop, args=(0, 0.0)), threading.Thread(target=loop, args=(1, late_s))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    finally:
        scheduler.stop()
    return target.passes[2:]  # the first passes ran before any pass was timed


def test_a_session_a_draft_round_trip_behind_joins_the_pass() -> None:
    passes = run_two_sessions(straggler_wait_ms=40.0)[:-1]  # the last: whichever session is a step behind
    assert passes and all(p == [0, 1] for p in passes), passes


def test_without_the_straggler_wait_the_sessions_take_turns() -> None:
    passes = run_two_sessions(straggler_wait_ms=0.0)
    assert sum(1 for p in passes if len(p) == 1) >= len(passes) // 2, passes


def test_next_prefill_is_the_oldest_prefill_until_the_limit_of_prefills_ahead_of_verifies() -> None:
    assert next_prefill([False, False], 0, 16) is None
    assert next_prefill([False, True, False, True], 0, 16) == 1  # ahead of the older verify
    assert next_prefill([False, True], 15, 16) == 1
    assert next_prefill([False, True], 16, 16) is None  # the waiting verifies' turn
    assert next_prefill([True, True], 16, 16) == 0  # nothing waits behind prefills


class GatedTarget(FakeTarget):
    """Logs prefills too ("p<id>"); its first pass blocks until `gate` is set."""

    def __init__(self, n: int):
        super().__init__(n)
        self.gate = threading.Event()
        self.entered = threading.Event()  # the model thread is in its first pass
        self.order: list[str] = []

    def prefill(self, session):
        self.entered.set()
        self.gate.wait(10)
        self.order.append(f"p{session.session_id}")
        return 7

    def verify_batch(self, items):
        self.gate.wait(10)
        self.order.append("v" + ",".join(str(s.session_id) for s, _ in sorted(items, key=lambda i: i[0].session_id)))
        return [VerifyOutcome(0, [1]) for _ in items]


def run_queued(submissions: list[tuple[str, int]], max_batch_size: int = 8) -> list[str]:
    """Holds the model on a first prefill of session 0 while `submissions` ("prefill"/"verify",
    session id) queue up in this order, then lets it run; returns what ran, in order."""
    target = GatedTarget(1 + max(sid for _, sid in submissions))
    scheduler = VerifyScheduler(target, max_batch_size=max_batch_size, batch_wait_ms=1.0,  # type: ignore[arg-type]
                                straggler_wait_ms=0.0)
    threads = [threading.Thread(target=scheduler.prefill, args=(target.sessions[0],))]
    for kind, sid in submissions:
        call = scheduler.prefill if kind == "prefill" else scheduler.verify
        args = (target.sessions[sid],) if kind == "prefill" else (target.sessions[sid], Proposal([5]))
        threads.append(threading.Thread(target=call, args=args))
    try:
        threads[0].start()
        assert target.entered.wait(5)
        for queued, t in enumerate(threads[1:], start=1):
            t.start()
            deadline = time.time() + 5
            while scheduler.queue_depth < queued and time.time() < deadline:
                time.sleep(0.001)  # queued in submission order
        target.gate.set()
        for t in threads:
            t.join(10)
    finally:
        scheduler.stop()
    return target.order[1:]


def test_queued_prefills_run_before_an_older_verify_and_then_every_row_joins_one_pass() -> None:
    order = run_queued([("verify", 1), ("verify", 2), ("prefill", 3), ("verify", 4), ("prefill", 5)])
    assert order == ["p3", "p5", "v1,2,4"]


def test_at_debug_level_every_prefill_and_verify_pass_is_logged(caplog) -> None:
    """The lines `held_cells.py --target-args "--log-level DEBUG"` reads to split a cell's time."""
    with caplog.at_level(logging.DEBUG, logger="target_service.scheduler"):
        order = run_queued([("verify", 1), ("prefill", 2)])
    assert order == ["p2", "v1"]
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("prefill of 3 tokens: ") for line in lines) == 2  # session 0's, then 2's
    assert any(line.startswith("verify pass of 1 rows, 3 open") for line in lines), lines
    assert any(line.startswith("verify pass 1: blocks [") and line.endswith(" ms") for line in lines), lines


def test_verifies_wait_for_no_more_than_a_batch_of_prefills_ahead_of_them() -> None:
    order = run_queued([("verify", 1), ("prefill", 2), ("prefill", 3), ("prefill", 4)], max_batch_size=2)
    assert order == ["p2", "p3", "v1", "p4"]


def test_the_model_thread_takes_the_torch_threads_the_serial_main_thread_gave_up() -> None:
    """specd/openmp.py: the main thread keeps no OpenMP team; the scheduler's thread runs every
    pass with the threads the main thread had."""
    import torch

    from specd.openmp import serial_until_model_thread

    seen: list[int] = []

    class ThreadCountingTarget(FakeTarget):
        def verify_batch(self, items):
            seen.append(torch.get_num_threads())
            return super().verify_batch(items)

    before = torch.get_num_threads()
    try:
        assert serial_until_model_thread("cpu") == before
        assert torch.get_num_threads() == 1
        target = ThreadCountingTarget(1)
        scheduler = VerifyScheduler(target, torch_threads=before + 1)  # type: ignore[arg-type]
        try:
            scheduler.verify(target.sessions[0], Proposal([5]))  # type: ignore[arg-type]
        finally:
            scheduler.stop()
        assert seen == [before + 1]
        assert torch.get_num_threads() == 1, "the main thread stays serial"
    finally:
        torch.set_num_threads(before)


def test_the_model_thread_tunes_few_row_products_with_its_own_threads_before_its_first_pass(monkeypatch) -> None:
    """`tune_few_rows` runs on the scheduler's thread, at the torch threads the passes get
    (MKL's few-row products and oneDNN's use different thread counts), before any pass."""
    import torch
    from torch import nn

    from specd import cpu_kernels

    if not cpu_kernels.onednn_linear_works():
        pytest.skip("this torch build has no oneDNN linear op")
    tuned_on: list[tuple[str, int]] = []

    def tune(module, *args, **kwargs):
        tuned_on.append((threading.current_thread().name, torch.get_num_threads()))
        return 0

    monkeypatch.setattr(cpu_kernels, "tune_few_rows", tune)

    class WithHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 16)

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    class ModelTarget(FakeTarget):
        def __init__(self) -> None:
            super().__init__(1)
            self.model = types.SimpleNamespace(model=WithHead())
            cpu_kernels.use_linear_kernel(self.model.model, "onednn")

        def verify_batch(self, items):
            assert tuned_on, "a pass ran before the kernels were tuned"
            return super().verify_batch(items)

    before = torch.get_num_threads()
    target = ModelTarget()
    scheduler = VerifyScheduler(target, torch_threads=before + 1)  # type: ignore[arg-type]
    try:
        scheduler.verify(target.sessions[0], Proposal([5]))  # type: ignore[arg-type]
    finally:
        scheduler.stop()
        torch.set_num_threads(before)
    assert tuned_on == [("specd-model", before + 1)]
