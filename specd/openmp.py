"""OpenMP defaults for processes that run the model on a thread other than the main one.

The target service runs every forward pass on its scheduler thread, not on the main thread. On
a 2-core machine libgomp then manages more threads than there are cores (the main thread's team
from model loading, plus the scheduler thread's team), and in that case it "throttles" its
workers: they spin only briefly after each parallel region and then sleep on a futex, so every
one of the hundreds of matrix multiplies in a pass pays a wake-up. Measured on the bundled model
(8 sessions x 1 token, one pass): 82 ms on the main thread, 100 ms on a second thread, 84 ms on
the second thread with these settings; in the stack, passes of 2-8 rows went from about 113 ms to
about 95 ms and aggregate tokens/s at concurrency 8 rose by a fifth (docs/benchmarks.md).

OMP_WAIT_POLICY=ACTIVE turns the throttling off; GOMP_SPINCOUNT bounds the spinning (about a
millisecond), so idle workers still go to sleep and leave the cores to the other services.
libgomp reads both when it loads, so they must be set before torch is imported.
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
