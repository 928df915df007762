"""OpenMP defaults for processes that run the model on a thread other than the main one.

The target service runs every forward pass on its scheduler thread, not on the main thread. On
a 2-core machine libgomp then manages more threads than there are cores (the main thread's team
from model loading, plus the scheduler thread's team), and in that case it "throttles" its
workers: they spin only briefly after each parallel region and then sleep on a futex, so every
one of the hundreds of matrix multiplies in a pass pays a wake-up. Measured on the bundled model
(8 sessions x 1 token, one pass): 82 ms on the main thread, 100 ms on a second thread, 84 ms on
the second thread with these settings; in the stack, passes of 2-8 rows went from about 113 ms to
about 95 ms and aggregate tokens/s at concurrency 8 rose by a fifth (docs/benchmarks.md).

OMP_WAIT_POLICY=ACTIVE lengthens the throttled spin (libgomp's throttled count is larger under
ACTIVE) but does not end the throttling; GOMP_SPINCOUNT bounds the unthrottled spinning (about a
millisecond), so idle workers still go to sleep and leave the cores to the other services.
libgomp reads both when it loads, so they must be set before torch is imported.

What ends the throttling is one team: `serial_until_model_thread` keeps the main thread's ops on
one thread (no team) while the model loads, and the model thread takes the cores back. On the
bundled model, code-edit prompts, one session, the model on a second thread: 1.4 cores busy and
98-109 ms a step with two teams, 1.98 cores and 72-105 ms with one; in the stack on a slow
period of this machine the target ran its one-session passes at 1.05 cores, 145-185 ms, against
transformers' 114-130 ms in one process (docs/benchmarks.md, "One OpenMP team in the target").
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}


def apply_openmp_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Sets each of OPENMP_DEFAULTS that the operator has not set; returns what it set."""
    applied = {name: value for name, value in OPENMP_DEFAULTS.items() if name not in environ}
    environ.update(applied)
    return applied


def serial_until_model_thread(device: str | None) -> int | None:
    """For a model on a CPU (`device` as `load_model` takes it): runs the calling thread's torch ops
    on one thread from now on and returns the intra-op thread count it had, for the thread that
    will run the model to take (`torch.set_num_threads` there: `VerifyScheduler(torch_threads=...)`).
    Elsewhere None, and nothing changes (the model's work is not on the CPU's threads).

    Call it before the model loads. Every thread that runs a parallel region owns a libgomp team
    of that many threads, and teams live as long as their threads: a main thread that loaded the
    model with two threads keeps a sleeping worker that counts against the cores for good."""
    import torch

    from specd.models import resolve_device

    if resolve_device(device).type != "cpu":
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads
