"""Several `specd bench-load` runs made apart (other invocations, other commits) as one report.

    PYTHONPATH=. python scripts/merge_bench_load.py OUT REPORT.json [REPORT.json ...]

Each cell is the median over the reports, as `specd bench-load --runs N` takes it over its runs,
and the checks against the issue's targets are made on those medians; the ramp (its plot of k
over time) is the last report's. Writes OUT/bench-load.{json,md} and the plots, and prints the
markdown. The reports must share their kinds, levels and configurations.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from coordinator.bench_load import _plots, _report, render


def merge(reports: list[dict]) -> dict:
    """One report from several, each cell the median over them."""
    first = reports[0]
    kinds = list(first["tokens_per_s"])
    levels = [int(c) for c in first["settings"]["concurrency"]]
    names = list(next(iter(first["tokens_per_s"][kinds[0]].values())))
    fixed = [int(k) for k in first["settings"]["fixed_k"]]
    tps: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    p50: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    mean_k: dict = defaultdict(lambda: defaultdict(list))
    hf: dict = defaultdict(list)
    useless: dict = defaultdict(list)
    for report in reports:
        if list(report["tokens_per_s"]) != kinds or [int(c) for c in report["settings"]["concurrency"]] != levels:
            raise SystemExit("the reports differ in their kinds or concurrency levels; merge like with like")
        for kind in kinds:
            for c in levels:
                for name in names:
                    tps[kind][c][name].append(report["tokens_per_s"][kind][str(c)][name])
                    p50[kind][c][name].append(report["itl_ms_p50"][kind][str(c)][name])
                mean_k[kind][c].append(report["auto_mean_k"][kind][str(c)])
            hf[kind].append(report["transformers_target_only_tokens_per_s"][kind])
        for name, value in report["useless_draft_c1_tokens_per_s"].items():
            useless[name].append(value)
    settings = dict(first["settings"], runs=len(reports))
    args = SimpleNamespace(**settings)
    configs = [(name, "") for name in names]
    return _report(kinds, levels, fixed, configs, tps, p50, mean_k, hf, useless, reports[-1]["ramp"], args,
                   sum(r["errors"] for r in reports))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("reports", type=Path, nargs="+")
    args = parser.parse_args()
    merged = merge([json.loads(p.read_text()) for p in args.reports])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-load.json").write_text(json.dumps(merged, indent=1))
    markdown = render(merged)
    (args.out / "bench-load.md").write_text(markdown)
    _plots(merged, args.out)
    print(markdown)


if __name__ == "__main__":
    main()
