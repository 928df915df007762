"""Several `specd bench-load` runs made apart (other invocations, other commits) as one report.

    PYTHONPATH=. python scripts/merge_bench_load.py OUT REPORT.json [REPORT.json ...]

Each cell is the median over the reports, as `specd bench-load --runs N` takes it over its runs,
and the checks against the issue's targets are made on those medians, and also on each report's
own cells, then their median (`paired`: each run's ratios pair configurations measured side by
side); the ramp (its plot of k over time) is the last report's
(`coordinator.bench_load.merge_reports`). Reports made with different `--first-run` orders
balance the order of the cells. Writes
OUT/bench-load.{json,md} and the plots, and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from coordinator.bench_load import merge_reports, plots, render


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("reports", type=Path, nargs="+")
    args = parser.parse_args()
    try:
        merged = merge_reports([json.loads(p.read_text()) for p in args.reports])
    except ValueError as err:
        parser.error(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-load.json").write_text(json.dumps(merged, indent=1))
    markdown = render(merged)
    (args.out / "bench-load.md").write_text(markdown)
    plots(merged, args.out)
    print(markdown)


if __name__ == "__main__":
    main()
