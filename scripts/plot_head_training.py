"""Plot held-out figures of `specd train-draft` logs against training time, one line per log.

    python scripts/plot_head_training.py --log "CPU, 150 k tokens" old/train.log \
        --log "H200, 1.8 M tokens" draft_service/head/smollm2/train.log --out docs/img/head-training.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_log(path: Path) -> list[dict]:
    """The periodic rows of a train.log (the final row has no time and is left out)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "minutes" in r]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--log", nargs=2, action="append", metavar=("LABEL", "PATH"), required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    fig, (acc, length) = plt.subplots(1, 2, figsize=(10, 4))
    for label, path in args.log:
        rows = read_log(Path(path))
        minutes = [r["minutes"] for r in rows]
        acc.plot(minutes, [r["held_acc1"] for r in rows], marker=".", label=label)
        length.plot(minutes, [r["held_est_acceptance_length_k4"] for r in rows], marker=".", label=label)
    acc.set(xscale="log", xlabel="training minutes", ylabel="held-out acc@1", title="first draft token = target's")
    length.set(xscale="log", xlabel="training minutes", ylabel="est. acceptance length at k = 4",
               title="held-out estimate (all positions)")
    for ax in (acc, length):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
