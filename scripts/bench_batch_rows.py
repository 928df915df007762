"""How a batched verify pass reads its sessions' KV rows: as one slice or by a gather.

    python scripts/bench_batch_rows.py [--batch 16] [--cached 200,600] [--reps 3]

Times one pass of the bundled target (plain decoding, one new token per row) over `--batch`
sessions with `--cached` tokens each, in several slot layouts, interleaved, median of 7 passes
each:
- slots 0..B-1 in order: the cache view reads them as a slice;
- slots 0..B-1 shuffled (the order the scheduler batches sessions in): sorted by slot before
  the pass (`slot_order`), so also a slice;
- slots 0..B-1 but one (B - 1 rows, a session missing from the pass: its request just ended,
  or it came back late), read as the slice 0..B-1, the gap included (`covering_rows`), and
  gathered (every layer copies the batch's K and V first), as every such pass did before;
- slots 0..B-1 but every fourth (3B/4 rows, four gaps): read as one slice and gathered.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from contextlib import contextmanager
from typing import Iterator

import target_service.kv_pool as kv_pool
from specd.models import load_model
from target_service.batch_forward import BatchedForward, RowInput


def pass_ms(forward: BatchedForward, slots: list[int], cached: int, passes: int = 7) -> float:
    rows = [RowInput(slot, cached, [5]) for slot in slots]
    forward.run(rows)
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        forward.run(rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


@contextmanager
def gathered() -> Iterator[None]:
    """Passes inside read rows that are not one run of slots by a gather, as before `covering_rows`."""
    chosen = kv_pool.covering_rows
    kv_pool.covering_rows = lambda slots, most=kv_pool.COVER_MOST: None
    try:
        yield
    finally:
        kv_pool.covering_rows = chosen


def gathered_ms(forward: BatchedForward, slots: list[int], cached: int) -> float:
    with gathered():
        return pass_ms(forward, slots, cached)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--cached", default="200,600", help="comma list of cached tokens per row")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    forward = BatchedForward(load_model())
    cached_levels = [int(c) for c in args.cached.split(",")]
    forward.pool.ensure_capacity(max(cached_levels) + 8)
    for _ in range(2 * args.batch):
        forward.pool.allocate()
    ordered = list(range(args.batch))
    shuffled = ordered[:]
    random.Random(0).shuffle(shuffled)
    one_gap = [slot for slot in ordered if slot != args.batch // 2]
    several_gaps = [slot for slot in ordered if slot % 4 != 1]
    print(f"batch {args.batch}, one new token per row, median of 7 passes (ms)")
    for cached in cached_levels:
        for rep in range(args.reps):
            print(f"cached {cached} rep {rep + 1}: in order {pass_ms(forward, ordered, cached):.1f} | "
                  f"shuffled {pass_ms(forward, shuffled, cached):.1f} | "
                  f"one gap: slice {pass_ms(forward, one_gap, cached):.1f}, "
                  f"gathered {gathered_ms(forward, one_gap, cached):.1f} | "
                  f"every fourth missing: slice {pass_ms(forward, several_gaps, cached):.1f}, "
                  f"gathered {gathered_ms(forward, several_gaps, cached):.1f}", flush=True)


if __name__ == "__main__":
    main()
