"""Each request's depth per step, side by side for several configurations, at concurrency 1.

    python scripts/k_per_request.py KIND CONFIGS [--repeats 3] [--max-tokens 32]

CONFIGS is a comma list of depths ("0" is speculation off, "auto" the controller, a number a fixed
k). Every prompt of KIND runs once per configuration, the configurations alternating, `repeats`
times, on one stack; per request it prints the drafted tokens of each step (what the coordinator
reports as k per step), drafted and accepted tokens and the request's time, then the median time
per prompt and configuration. For the question a bench cell cannot answer: does auto do what a
fixed k does on these prompts, or something else?
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from coordinator.loadgen import LoadGenerator, LoadSpec
from specd.launcher import start_stack
from specd.models import load_model
from specd.workloads import default_prompts_path, load_prompts, prompts_of_kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind")
    parser.add_argument("configs", help="comma list: 0 (off), auto, or a fixed k")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32, help="cap per request, as bench-load's default")
    args = parser.parse_args()
    try:
        prompts = prompts_of_kind(load_prompts(default_prompts_path()), args.kind, args.max_tokens)
    except ValueError as err:
        parser.error(str(err))
    target = load_model()
    encoded = {p.id: target.encode(p.prompt, chat=p.chat) for p in prompts}
    stack = start_stack(Path(tempfile.mkdtemp(prefix="k-per-request-")), method="ngram", k="auto")
    times: dict[tuple[str, str], list[float]] = {}
    try:
        gen = LoadGenerator(stack.coordinator.address, prompts, encode=lambda p: encoded[p.id])
        gen.closed_loop(1, len(prompts), LoadSpec("ngram", "auto", max_tokens=8))  # warm-up
        for _ in range(args.repeats):
            for depth in args.configs.split(","):
                spec = LoadSpec.for_depth("ngram", depth, args.max_tokens)
                records, _ = gen.closed_loop(1, len(prompts), spec)
                for r in records:
                    elapsed = (r.done or r.sent) - r.sent
                    times.setdefault((r.prompt_id, depth), []).append(elapsed)
                    print(f"{depth:>5} {r.prompt_id}: {elapsed:.2f} s, drafted {r.num_draft_tokens}, accepted "
                          f"{r.num_accepted_tokens}, k per step {r.k_per_step}", flush=True)
        gen.close()
    finally:
        stack.stop()
    print("\nmedian request time, s")
    for (prompt_id, depth), values in sorted(times.items()):
        print(f"  {prompt_id} {depth}: {statistics.median(values):.2f} ({len(values)} requests)")


if __name__ == "__main__":
    main()
