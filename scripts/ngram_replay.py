"""What the n-gram proposer would do on the benchmark prompts, replayed over the target's greedy
outputs: no stack, no timing, the same figures on every machine.

    python scripts/ngram_replay.py [--kinds chat,code] [--max-tokens 32] [--depths 1,2,4,8,16]

Greedy outputs do not depend on what was drafted (exactness), and the n-gram proposer's block is
a function of the context alone, so every step of a fixed k can be replayed: at each step the
block the proposer finds for the context so far (none where the context holds no match), kept up
to its first disagreement with the output, plus the target's own token. Per kind it prints the
output tokens, the share of steps whose context holds a match, the conditional acceptance per
draft position (accepted / tried, position i tried only when 0..i-1 went through), and the verify
passes each fixed k needs against plain decoding. For the question a bench cell answers only
through the machine's swing: how much could drafting save on these prompts, and where?
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Sequence

from coordinator.bench import HF_TARGET, hf_systems
from draft_service.proposers.ngram import replay_fixed_k
from specd.models import load_model
from specd.workloads import default_prompts_path, load_prompts


def position_rates(steps: Sequence[tuple[int, int]], depth: int) -> list[tuple[int, int]]:
    """(accepted, tried) per draft position 0..depth-1 over the steps' blocks."""
    counts = [[0, 0] for _ in range(depth)]
    for drafted, accepted in steps:
        for i in range(min(accepted + 1, drafted, depth)):
            counts[i][1] += 1
            counts[i][0] += i < accepted
    return [(a, n) for a, n in counts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="", help="comma list of workload kinds (default: all)")
    parser.add_argument("--max-tokens", type=int, default=32, help="cap per request, as bench-load's default")
    parser.add_argument("--depths", default="1,2,4,8,16", help="fixed k to replay")
    args = parser.parse_args()
    depths = [int(k) for k in args.depths.split(",")]
    prompts = load_prompts(default_prompts_path())
    kinds = args.kinds.split(",") if args.kinds else sorted({p.kind for p in prompts})
    target = load_model()
    transformers = hf_systems(target, [HF_TARGET], 0)[0]  # target-only greedy decoding, as the benches' baseline
    by_kind: dict[str, list[tuple[list[int], list[int]]]] = defaultdict(list)
    for p in prompts:
        if p.kind in kinds:
            ids = target.encode(p.prompt, chat=p.chat)
            output, _ = transformers.run(p.with_max_tokens(min(p.max_tokens, args.max_tokens)), ids)
            by_kind[p.kind].append((ids, output))
            print(f"generated {p.id}", file=sys.stderr, flush=True)
    deepest = max(depths)
    print(f"| kind | tokens | steps with a match (k = {deepest}) | accepted / tried per position "
          f"| passes: off | " + " | ".join(f"k{k}" for k in depths) + " |")
    print("|---|---|---|---|---|" + "---|" * len(depths))
    for kind in kinds:
        runs = by_kind[kind]
        tokens = off = sum(len(output) for _, output in runs)  # off: a prefill and one pass per later token
        deep = [s for prompt, output in runs for s in replay_fixed_k(prompt, output, deepest)]
        matched = sum(1 for drafted, _ in deep if drafted)
        rates = [f"{a}/{n}" for a, n in position_rates(deep, min(deepest, 4)) if n]
        passes = [len(runs) + sum(len(replay_fixed_k(prompt, output, k)) for prompt, output in runs) for k in depths]
        print(f"| {kind} | {tokens} | {matched}/{len(deep)} | {' '.join(rates)} | {off} | "
              + " | ".join(f"{n} ({off / n:.2f}x)" for n in passes) + " |")


if __name__ == "__main__":
    main()
