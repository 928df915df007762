"""What a verify pass costs padded and packed, for batches whose rows bring blocks of different lengths.

    python scripts/bench_packed_passes.py [--batch 16] [--cached 300] [--reps 2] [--prefill 200,600]
                                          [--mix NAME ...]

Times one pass of the bundled target over `--batch` sessions with `--cached` tokens each, for
several mixes of block lengths (plain decoding, one session verifying a block of 3 or 9 among
decode rows, a quarter or half of the batch speculating, every row at 3, mixes of 4 to 7 and of
fixed k = 4 where some drafts came back short, every row at 5 and blocks as ragged as auto's
at 16 code edits with as many positions), three ways, interleaved, median of 7 passes each:
padded to the longest block (`BatchedForward(packed=False)`), packed
(target_service/packed_attention.py) and packed with attention by rows (each row's first token
in one call, the rest of each block in a call of its own: `grid_length` held at 1). Before
timing, it checks that padded and packed give every row the same greedy tokens. Odd repetitions
run the mixes in reverse order, and the medians over the repetitions close the table: the
machine's speed drifts by a quarter over a few minutes, and two repetitions in one order once
showed a pass with a third of its rows at k = 0 costing as much as every row at k = 2, which
five mirrored ones did not (docs/benchmarks.md, 2026-12-06). `--mix` times only the named
mixes. Then a prefill of `--prefill` tokens from position 0, with the fused causal
attention (`causal_attention`) and through the model's own attention with the explicit mask.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch

import target_service.packed_attention as packed_attention
from specd.config import LINEAR_KERNELS
from specd.cpu_kernels import use_linear_kernel
from specd.models import load_model
from target_service.batch_forward import BatchedForward, RowInput


def mixes(batch: int) -> dict[str, list[int]]:
    quarter, half = max(batch // 4, 1), max(batch // 2, 1)
    return {
        "plain": [1] * batch,
        "one row at 3": [3] + [1] * (batch - 1),
        "one row at 9": [9] + [1] * (batch - 1),
        "a quarter at 3": [3] * quarter + [1] * (batch - quarter),
        "half at 5": [5] * half + [1] * (batch - half),
        "every row at 3": [3] * batch,
        # fixed k = 2 at 16 code edits, but a third of the rows (edit-03's) at k = 0, as auto ran them
        "two thirds at 3": [1 if b % 3 == 2 else 3 for b in range(batch)],
        "4 to 7": [4 + b % 4 for b in range(batch)],
        "k4, some short": [(5, 5, 3, 5, 1, 5, 5, 2)[b % 8] for b in range(batch)],
        "k4, one at 12": [12] + [(5, 5, 3, 5, 1, 5, 5, 2)[b % 8] for b in range(1, batch)],
        # as many positions as "every row at 5", in blocks like auto's at 16 code edits
        "every row at 5": [5] * batch,
        # auto's blocks at 16 code edits on 2026-12-06: a third of the rows at k = 0, the rest at 2-5
        "auto's code edits": [(1, 1, 1, 1, 1, 1, 3, 3, 4, 5, 5, 5, 6, 6, 3, 3)[b % 16] for b in range(batch)],
        "ragged, as at 5": [(2, 2, 2, 2, 2, 2, 2, 2, 3, 4, 6, 7, 9, 10, 12, 13)[b % 16] for b in range(batch)],
    }


def rows_for(blocks: list[int], cached: int) -> list[RowInput]:
    return [RowInput(slot, cached, [5 + i for i in range(n)]) for slot, n in enumerate(blocks)]


def pass_ms(forward: BatchedForward, rows: list[RowInput], passes: int = 7) -> float:
    forward.run(rows)  # warm
    return statistics.median(timeit.repeat(lambda: forward.run(rows), number=1, repeat=passes)) * 1000


def by_rows_ms(forward: BatchedForward, rows: list[RowInput]) -> float:
    """`pass_ms` of a packed pass whose attention runs each row's extra tokens in a call of its own."""
    chosen = packed_attention.grid_length
    packed_attention.grid_length = lambda lengths, row_call=0.0: 1
    try:
        return pass_ms(forward, rows)
    finally:
        packed_attention.grid_length = chosen


def mirrored(names: list[str], rep: int) -> list[str]:
    """The mixes in order on even repetitions and in reverse on odd ones, so that a drift of the
    machine's speed over the run charges every mix alike in the medians."""
    return list(reversed(names)) if rep % 2 else names


def pass_line(name: str, blocks: list[int], ms: tuple[float, float, float]) -> str:
    padded, packed, by_rows = ms
    return (f"{name:<15} ({sum(blocks):>3} positions): padded {padded:6.1f} | packed {packed:6.1f} "
            f"(grid of {packed_attention.grid_length(blocks)}) | by rows {by_rows:6.1f}")


def prefill_ms(forward: BatchedForward, tokens: int, causal: bool, passes: int = 5) -> float:
    forward.wrapped = causal  # without the wrapper's causal path: the model's own attention and the mask
    slot = forward.pool.allocate()
    ids = [(7 * i) % 1000 + 5 for i in range(tokens)]
    row = [RowInput(slot, 0, ids)]
    forward.run(row, keep_last=1)
    ms = statistics.median(timeit.repeat(lambda: forward.run(row, keep_last=1), number=1, repeat=passes)) * 1000
    forward.pool.release(slot)
    forward.wrapped = True
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--cached", type=int, default=300, help="cached tokens per row")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--prefill", default="200,600", help="comma list of prompt lengths for the prefill timing")
    parser.add_argument("--mix", action="append", default=None, choices=list(mixes(16)),
                        help="time only this mix (repeatable; default all)")
    parser.add_argument("--linear-kernel", choices=LINEAR_KERNELS, default="onednn",
                        help="kernel of the linear layers, as the target service's flag (default onednn)")
    args = parser.parse_args()
    model = load_model()
    use_linear_kernel(model.model, args.linear_kernel)
    packed = BatchedForward(model, packed=True)
    padded = BatchedForward(model, packed=False)
    padded.pool = packed.pool  # one pool: both read the same cached rows
    packed.pool.ensure_capacity(args.cached + 16)
    for _ in range(args.batch):
        packed.pool.allocate()
    selected = {name: blocks for name, blocks in mixes(args.batch).items() if args.mix is None or name in args.mix}
    for name, blocks in selected.items():
        a, b = packed.run(rows_for(blocks, args.cached)), padded.run(rows_for(blocks, args.cached))
        if not all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(a, b)):
            raise SystemExit(f"{name}: packed and padded passes disagree on a greedy token")
    print(f"batch {args.batch}, {args.cached} cached tokens per row, median of 7 passes (ms)")
    timings: dict[str, list[tuple[float, float, float]]] = {name: [] for name in selected}
    for rep in range(args.reps):
        for name in mirrored(list(selected), rep):
            blocks, rows = selected[name], rows_for(selected[name], args.cached)
            timings[name].append((pass_ms(padded, rows), pass_ms(packed, rows), by_rows_ms(packed, rows)))
            print(f"rep {rep + 1} {pass_line(name, blocks, timings[name][-1])}", flush=True)
    if args.reps > 1:
        print(f"medians over {args.reps} repetitions")
        for name, blocks in selected.items():
            padded_ms, packed_ms, rows_ms = (statistics.median(t[i] for t in timings[name]) for i in range(3))
            print(f"      {pass_line(name, blocks, (padded_ms, packed_ms, rows_ms))}", flush=True)
    lengths = [int(n) for n in args.prefill.split(",") if n]
    if lengths:
        packed.pool.ensure_capacity(max(lengths) + 16)
        print("prefill from position 0, median of 5 passes (ms)")
    for rep in range(args.reps):
        for n in lengths:
            print(f"rep {rep + 1} prefill {n:>4} tokens: masked {prefill_ms(packed, n, False):6.1f} | "
                  f"causal {prefill_ms(packed, n, True):6.1f}", flush=True)


if __name__ == "__main__":
    main()
