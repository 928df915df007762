"""How a batched verify pass reads its sessions' KV rows: as one slice or by a gather.

    python scripts/bench_batch_rows.py [--batch 16] [--cached 200,600] [--reps 3]

Times one pass of the bundled target (plain decoding, one new token per row) over `--batch`
sessions with `--cached` tokens each, three ways, interleaved, median of 7 passes each:
- slots 0..B-1 in order: the cache view reads them as a slice;
- slots 0..B-1 shuffled (the order the scheduler batches sessions in): sorted by slot before
  the pass (`slot_order`), so also a slice;
- slots 0, 2, 4, ...: not a run of slots, so every layer gathers the batch's K and V (what every
  shuffled batch cost before the rows were sorted).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

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
    spread = list(range(0, 2 * args.batch, 2))
    print(f"batch {args.batch}, one new token per row, median of 7 passes (ms)")
    for cached in cached_levels:
        for rep in range(args.reps):
            print(f"cached {cached} rep {rep + 1}: in order {pass_ms(forward, ordered, cached):.1f} | "
                  f"shuffled {pass_ms(forward, shuffled, cached):.1f} | "
                  f"gathered {pass_ms(forward, spread, cached):.1f}", flush=True)


if __name__ == "__main__":
    main()
