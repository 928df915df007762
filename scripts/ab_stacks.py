"""Two stacks from two checkouts, up at once, their cells alternating: an A/B of a change to the services.

    PYTHONPATH=. python scripts/ab_stacks.py BEFORE_ROOT AFTER_ROOT --kind code_edit --depth 0 [--concurrency 1] [--reps 4]

BEFORE_ROOT and AFTER_ROOT are checkouts (e.g. `git worktree add /tmp/before HEAD~1`, with
`specdec/` generated there too); each stack's services run from theirs. Every repetition runs one
cell on each stack, in alternating order, so that both see the same swings of the machine. A cell
is the kind's prompts once at concurrency 1, or three requests per client above it, 32 tokens
each. Prints tokens/s, p50 inter-token latency and the target's CPU (cores) per cell, then the
medians and their ratio. docs/benchmarks.md, "One OpenMP team in the target", has figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from specd.openmp import apply_openmp_defaults

apply_openmp_defaults()  # the services inherit it, as under the CLI

import psutil  # noqa: E402

import specd.launcher as launcher  # noqa: E402
from coordinator.loadgen import LoadGenerator, LoadSpec  # noqa: E402
from specd.models import encode_prompt, load_tokenizer  # noqa: E402
from specd.workloads import default_prompts_path, load_prompts  # noqa: E402


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--kind", default="code_edit")
    parser.add_argument("--depth", default="0", help='"0" (speculation off), a fixed k, or "auto"')
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    prompts = [p.with_max_tokens(32) for p in load_prompts(default_prompts_path()) if p.kind == args.kind]
    encoded = {p.id: encode_prompt(tokenizer, p.prompt, p.chat) for p in prompts}

    requests = len(prompts) if args.concurrency == 1 else 3 * args.concurrency
    spec = LoadSpec.for_depth("ngram", args.depth, 32)
    stacks = {}
    try:
        for name, root in (("before", args.before), ("after", args.after)):
            launcher.ROOT = root.resolve()  # the services run `python -m specd.cli` from there
            stacks[name] = launcher.start_stack(Path(tempfile.mkdtemp(prefix=f"specd-ab-{name}-")), k="auto")
        gens = {n: LoadGenerator(s.coordinator.address, prompts, encode=lambda p: encoded[p.id]) for n, s in stacks.items()}
        for gen in gens.values():  # warm-up
            gen.closed_loop(1, 1, LoadSpec.for_depth("ngram", args.depth, 8))
        tps: dict[str, list[float]] = {n: [] for n in stacks}
        for rep in range(args.reps):
            for name in list(stacks) if rep % 2 == 0 else list(stacks)[::-1]:
                target = psutil.Process(stacks[name].target.proc.pid)
                before = cpu_seconds(target)
                records, wall = gens[name].closed_loop(args.concurrency, requests, spec)
                tokens = sum(r.tokens for r in records)
                tps[name].append(tokens / wall)
                itl = statistics.median(g for r in records for g in r.inter_token_latencies()) * 1e3
                print(f"rep {rep + 1} {name:6s}: {tokens / wall:.2f} tok/s, itl p50 {itl:.1f} ms, "
                      f"target {(cpu_seconds(target) - before) / wall:.2f} cores", flush=True)
        medians = {n: statistics.median(v) for n, v in tps.items()}
        print(f"medians: before {medians['before']:.2f}, after {medians['after']:.2f} tok/s; "
              f"after / before {medians['after'] / medians['before']:.3f}")
    finally:
        for stack in stacks.values():
            stack.stop()


if __name__ == "__main__":
    main()
