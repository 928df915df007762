"""How much a cell's place in its level's order moves its tokens/s, from a bench-load log.

    PYTHONPATH=. python scripts/slot_effects.py LOG [--first-run N] [--fixed-k 2,4]

LOG is what `specd bench-load` printed (its "run R: KIND cC off X | k2 Y | ... | auto Z" lines).
Each cell's log tokens/s is fitted as a kind-and-run term (the machine that minute) plus a
kind-and-configuration term (what the configuration does there) plus a slot term (its place in
`cell_order`), by alternating means. With cells in a Williams design's order every configuration
sits in every slot equally often, so the slot terms are told apart from the configurations'.
Prints the slots' factors and, per kind, auto against off run by run and with the slots taken out.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from collections import defaultdict

from coordinator.bench_load import cell_order

RUN_LINE = re.compile(r"run (\d+): (\S+)\s+c(\d+)\s+(.*)")


def parse_cells(lines: list[str], first_run: int = 0) -> dict[tuple[str, int, int, str], float]:
    """(kind, concurrency, run, configuration) -> tokens/s from bench-load's per-run lines."""
    cells = {}
    for line in lines:
        m = RUN_LINE.match(line)
        if not m:
            continue
        run, kind, conc = int(m[1]) - 1 + first_run, m[2], int(m[3])
        for part in m[4].split("|"):
            name, value = part.split()[:2]
            cells[(kind, conc, run, name)] = float(value)
    return cells


def fit_slots(cells: dict[tuple[str, int, int, str], float], configs: list[str],
              rounds: int = 50) -> tuple[list[float], dict[tuple[str, int, str], float]]:
    """(slot factors, per (kind, concurrency, configuration) factor): the additive fit of log
    tokens/s described above, each set of terms centred (the slots on 1.0)."""
    pairs = [(n, n) for n in configs]
    logv = {key: math.log(v) for key, v in cells.items() if v > 0}
    slot_of = {key: [n for n, _ in cell_order(pairs, key[2])].index(key[3]) for key in logv}
    machine: dict[tuple[str, int, int], float] = {}
    config: dict[tuple[str, int, str], float] = defaultdict(float)
    slot = [0.0] * len(configs)
    for _ in range(rounds):
        groups: dict[tuple, list[float]] = defaultdict(list)
        for key, y in logv.items():
            groups[key[:3]].append(y - config[(key[0], key[1], key[3])] - slot[slot_of[key]])
        machine = {g: sum(ys) / len(ys) for g, ys in groups.items()}
        groups = defaultdict(list)
        for key, y in logv.items():
            groups[(key[0], key[1], key[3])].append(y - machine[key[:3]] - slot[slot_of[key]])
        config = defaultdict(float, {g: sum(ys) / len(ys) for g, ys in groups.items()})
        by_slot: dict[int, list[float]] = defaultdict(list)
        for key, y in logv.items():
            by_slot[slot_of[key]].append(y - machine[key[:3]] - config[(key[0], key[1], key[3])])
        slot = [sum(by_slot[i]) / len(by_slot[i]) if by_slot[i] else 0.0 for i in range(len(configs))]
        mean = sum(slot) / len(slot)
        slot = [s - mean for s in slot]
    return [math.exp(s) for s in slot], {g: math.exp(v) for g, v in config.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--first-run", type=int, default=0, help="the bench's --first-run (default 0)")
    parser.add_argument("--fixed-k", default="2,4", help="the bench's --fixed-k (default 2,4)")
    args = parser.parse_args()
    configs = ["off", *(f"k{k}" for k in args.fixed_k.split(",")), "auto"]
    with open(args.log) as f:
        cells = parse_cells(f.readlines(), args.first_run)
    slots, config = fit_slots(cells, configs)
    print("slot factors:", ", ".join(f"{s:.3f}" for s in slots))
    for kind, conc in sorted({(k, c) for k, c, _, _ in cells}):
        runs = sorted({r for k, c, r, _ in cells if (k, c) == (kind, conc)})
        ratios = [cells[(kind, conc, r, "auto")] / cells[(kind, conc, r, "off")] for r in runs
                  if (kind, conc, r, "auto") in cells and (kind, conc, r, "off") in cells]
        if not ratios:
            continue
        adjusted = config[(kind, conc, "auto")] / config[(kind, conc, "off")]
        print(f"{kind:11s} c{conc:<3d} auto vs off run by run {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.3f}; slots taken out {adjusted:.3f}")


if __name__ == "__main__":
    main()
