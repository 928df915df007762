"""Held cells: one stack, depth configurations back to back at one concurrency, several repetitions.

    python scripts/held_cells.py KIND CONCURRENCY CONFIGS [--seconds 15 | --requests N] [--reps 3]

CONFIGS is a comma list of depths ("0" is speculation off, "auto" the controller, a number a fixed
k), e.g. `python scripts/held_cells.py extract 16 0,2,auto`. Per cell it prints tokens/s, the k
chosen per step, drafted and accepted tokens, tokens per step, the p50 time to first token, the
CPU use of each service (and the coordinator's per session step), the target's verify passes
(count, mean rows, mean time) and its prefills (count, mean time), each with its share of the
wall time. `specd bench-load` runs every kind and level once per run; this repeats a few cells
on one stack, where the swing between runs would hide a few percent.

With `--requests N` a cell is fixed work instead of a timed window: CONCURRENCY client threads
send the kind's prompts in turn until CONCURRENCY + N requests have ended (the load held to the
end, no drain: `LoadGenerator.closed_loop_held`), tokens/s every token streamed between the
CONCURRENCY-th end (the opening wave's) and the last over that time.
Greedy outputs are the same in every configuration, so every cell does about the same work, and
which phase of the sessions' prefill waves a window happens to catch no longer moves the figure.
It also prints the medians of the same cells measured from the start (the window until
2026-12-05, which charged configurations whose sessions fall out of step), and of each cell's
verify time per token streamed: the work the depth decides, apart from the prefills, which at
16 code edits are two thirds of the wall time and swing 10 % from cell to cell.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import psutil

from coordinator.bench_load import wait_idle
from coordinator.loadgen import LoadGenerator, LoadSpec, summarize
from coordinator.target_work import CellWork, cell_work, target_work
from specd.launcher import start_stack
from specd.models import load_model, save_tiny_random_model
from specd.workloads import default_prompts_path, load_prompts, prompts_of_kind
from specdec.v1 import target_pb2_grpc


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def passes_line(work: CellWork, wall_s: float, tokens: int) -> str:
    """The cell's verify passes: how many, their mean rows, their mean time, the share of the
    wall time the target spent in them (what the scheduler's batching left on the table) and
    their time per token streamed; then its prefills alike (where no depth choice helps)."""
    prefill = (f"; prefills {work.prefills}, mean {work.prefill_ms / work.prefills:.1f} ms, in prefills "
               f"{work.prefill_ms / 10 / wall_s:.0f} %" if work.prefills else "")
    if work.passes <= 0:
        return "no verify passes" + prefill
    return (f"verify passes {work.passes}, mean rows {work.rows:.1f}, mean {work.verify_ms / work.passes:.1f} ms, "
            f"in passes {work.verify_ms / 10 / wall_s:.0f} % of the wall time, "
            f"{work.verify_ms_a_token(tokens):.2f} ms a token{prefill}")


def rep_order(configs: list[str], rep: int, mirror: bool) -> list[str]:
    """The configurations of repetition `rep` in the order they run: as given, or with `mirror`
    reversed in every other repetition (A B, B A, ...), so that a drift of the machine over the
    minutes of a run (prefills of the same prompts grew from 194 to 234 ms over four cells of
    one run) costs each configuration alike instead of the later one."""
    return list(reversed(configs)) if mirror and rep % 2 else list(configs)


def medians_line(rates: dict[str, list[float]], unit: str = "tok/s", digits: int = 1) -> str:
    """Each configuration's median over the repetitions, and its ratio to the first's."""
    first = statistics.median(next(iter(rates.values())))
    return "medians: " + ", ".join(f"{depth} {statistics.median(r):.{digits}f} {unit} ({statistics.median(r) / first:.2f}x)"
                                   for depth, r in rates.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind")
    parser.add_argument("concurrency", type=int)
    parser.add_argument("configs", help="comma list: 0 (off), auto, or a fixed k")
    parser.add_argument("--seconds", type=float, default=15.0, help="window per cell (default 15)")
    parser.add_argument("--requests", type=int, default=0,
                        help="fixed-work cells: this many requests per cell instead of a --seconds window")
    parser.add_argument("--from-start", action="store_true",
                        help="fixed-work cells: open the window at the start, not after a lead-in of CONCURRENCY "
                             "requests (the window until 2026-12-05)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32, help="cap per request, as bench-load's default")
    parser.add_argument("--after", default="",
                        help="comma list of kinds to run first, unmeasured (each config once, as the cells): "
                             "the state a kind meets in `specd bench-load`, which runs the kinds in turn")
    parser.add_argument("--method", default="ngram", help="drafting method of the stack and every cell (default ngram)")
    parser.add_argument("--tiny-draft", action="store_true",
                        help="give the draft service bench-load's useless draft, a tiny random model (use with "
                             "--method draft_model)")
    parser.add_argument("--debug-log", action="store_true",
                        help="run the coordinator at --log-level DEBUG (each session's depth choices, with the cost "
                             "model's verify estimates and rates); the log directory is printed at the start")
    parser.add_argument("--target-args", default="",
                        help="extra arguments for the target service, space-separated (e.g. \"--straggler-wait-ms 120\")")
    parser.add_argument("--mirror", action="store_true",
                        help="reverse the configurations' order in every other repetition (A B, B A, ...): a drift "
                             "over the run then costs each alike; without it each repetition runs them as given "
                             "(to measure a configuration after another, e.g. auto after fixed k = 4)")
    parser.add_argument("--show-steps", action="store_true",
                        help="also print each request's k per step and accepted tokens, in finishing order")
    args = parser.parse_args()
    every_prompt = load_prompts(default_prompts_path())
    try:
        prompts = prompts_of_kind(every_prompt, args.kind, args.max_tokens)
        after = {kind: prompts_of_kind(every_prompt, kind, args.max_tokens)
                 for kind in filter(None, args.after.split(","))}
    except ValueError as err:
        parser.error(str(err))
    target = load_model()
    encoded = {p.id: target.encode(p.prompt, chat=p.chat) for p in prompts}
    log_dir = Path(tempfile.mkdtemp(prefix="held-cells-"))
    print(f"stack logs in {log_dir}", flush=True)
    tiny = (save_tiny_random_model(log_dir / "tiny-draft", vocab_size=target.vocab_size, hidden_size=64,
                                   tokenizer_from=target.tokenizer, max_position_embeddings=8192)
            if args.tiny_draft else None)
    stack = start_stack(log_dir, draft_model=str(tiny) if tiny else None, method=args.method, k="auto",
                        target_args=args.target_args.split(),
                        coordinator_args=["--log-level", "DEBUG"] if args.debug_log else [])
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.target.address))
    services = {name: psutil.Process(getattr(stack, name).proc.pid) for name in ("target", "draft", "coordinator")}
    try:
        gen = LoadGenerator(stack.coordinator.address, prompts, encode=lambda p: encoded[p.id])
        gen.closed_loop(args.concurrency, args.concurrency, LoadSpec(args.method, "auto", max_tokens=8))  # warm-up
        for kind, earlier in after.items():
            ids = {p.id: target.encode(p.prompt, chat=p.chat) for p in earlier}
            prelude = LoadGenerator(stack.coordinator.address, earlier, encode=lambda p: ids[p.id])
            for depth in args.configs.split(","):
                spec = LoadSpec.for_depth(args.method, depth, args.max_tokens)
                prelude.closed_loop(args.concurrency, args.requests or 2 * args.concurrency, spec)
                wait_idle(stub)
            prelude.close()
            print(f"ran {kind} first ({args.configs}), unmeasured", flush=True)
        rates: dict[str, list[float]] = {depth: [] for depth in args.configs.split(",")}
        from_start: dict[str, list[float]] = {depth: [] for depth in rates}
        verify_per_token: dict[str, list[float]] = {depth: [] for depth in rates}
        for rep in range(args.reps):
            for depth in rep_order(list(rates), rep, args.mirror):
                spec = LoadSpec.for_depth(args.method, depth, args.max_tokens)
                before, start = {n: cpu_seconds(p) for n, p in services.items()}, time.time()
                passes_before = target_work(stub)
                if args.requests:
                    lead_in = 0 if args.from_start else args.concurrency
                    records, window = gen.closed_loop_held(args.concurrency, args.requests, spec, lead_in)
                    wall = window[1]
                else:
                    records, window = gen.closed_loop_for(args.concurrency, args.seconds, spec, 0.2)
                    wall = window[1]
                elapsed = time.time() - start
                used = {n: cpu_seconds(p) - before[n] for n, p in services.items()}
                cpu = {n: round(100 * s / elapsed) for n, s in used.items()}
                wait_idle(stub)
                work = cell_work(passes_before, target_work(stub))
                tokens = sum(r.tokens for r in records)
                verify_per_token[depth].append(work.verify_ms_a_token(tokens))
                s = summarize(records, wall, window=window)
                rates[depth].append(s["tokens_per_s"])
                if window[0] > 0:  # the same records over the window from the start, as until 2026-12-05
                    from_start[depth].append(summarize(records, wall, window=(0.0, window[1]))["tokens_per_s"])
                ks = sorted(Counter(k for r in records for k in r.k_per_step).items())
                drafted = sum(r.num_draft_tokens for r in records)
                accepted = sum(r.num_accepted_tokens for r in records)
                steps = sum(len(r.k_per_step) for r in records)
                ttft = sorted(r.ttft for r in records if r.ttft is not None)
                print(f"rep {rep} {args.kind} c{args.concurrency} {depth}: {s['tokens_per_s']:.1f} tok/s, "
                      f"mean k {s['mean_k']:.2f}, k per step {ks}", flush=True)
                print(f"    drafted {drafted}, accepted {accepted} ({accepted / max(drafted, 1):.2f}), tokens/step "
                      f"{tokens / max(steps, 1):.2f}, ttft p50 "
                      f"{ttft[len(ttft) // 2] * 1000 if ttft else float('nan'):.0f} ms, CPU % {cpu}, coordinator "
                      f"{1000 * used['coordinator'] / max(steps, 1):.2f} ms CPU a step", flush=True)
                print(f"    {passes_line(work, elapsed, tokens)}", flush=True)
                if args.show_steps:
                    for r in sorted(records, key=lambda r: r.done or r.sent):
                        print(f"      {r.prompt_id}: accepted {r.num_accepted_tokens}/{r.num_draft_tokens}, "
                              f"k per step {r.k_per_step}", flush=True)
        print(medians_line(rates), flush=True)
        if all(from_start.values()):
            print("from the start, " + medians_line(from_start), flush=True)
        print("verify time a token streamed (the decode work alone, without the prefills' swing), "
              + medians_line(verify_per_token, "ms", 2), flush=True)
        gen.close()
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
