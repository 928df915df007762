"""Forward-pass time of the bundled target with torch's and oneDNN's linear kernels, in one process.

oneDNN runs twice: on its packed weights for every product, and tuned (`tune_few_rows`:
products of as few rows as torch's kernel ran faster in whole passes here on torch's, what the
target runs). The dense-weight oneDNN figures of docs/benchmarks.md, "Packed oneDNN weights", came from
an earlier form of this script.

    python scripts/bench_linear_kernels.py [--reps 3] [--iters 9] [--cached 400]

Per pass shape (sessions x new tokens per session) and kernel: the median over `iters` passes,
then the median over `reps` repetitions in which the kernels alternate, so that both see the same
machine state. Each kernel runs with the padding BatchedForward gives it (torch's pads passes of
2-4 rows to 5, oneDNN's pads nothing). docs/benchmarks.md, "oneDNN linear layers", has the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specd.openmp import apply_openmp_defaults

apply_openmp_defaults()  # before torch loads, as the services do

from specd.cpu_kernels import tune_few_rows, use_linear_kernel  # noqa: E402
from specd.models import load_model  # noqa: E402
from target_service.batch_forward import BatchedForward, RowInput  # noqa: E402

SHAPES = ((1, 1), (1, 2), (1, 3), (1, 5), (1, 9), (2, 1), (4, 1), (4, 3), (16, 1))


def pass_ms(forward: BatchedForward, rows: list[RowInput], iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        forward.run(rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--cached", type=int, default=400, help="tokens in each session's cache")
    args = parser.parse_args()
    target = load_model()
    forward = BatchedForward(target)
    sessions = max(b for b, _ in SHAPES)
    prompt = list(range(1000, 1000 + args.cached))
    for slot in [forward.pool.allocate() for _ in range(sessions)]:
        forward.run([RowInput(slot, 0, prompt)], keep_last=1)
    kernels = ("aten", "onednn", "onednn-tuned")
    results: dict[str, dict[tuple[int, int], list[float]]] = {k: {} for k in kernels}
    for rep in range(args.reps):
        for kernel in kernels if rep % 2 == 0 else kernels[::-1]:
            use_linear_kernel(target.model, kernel.removesuffix("-tuned"))
            if kernel == "onednn-tuned":
                print(f"tuned: products of up to {tune_few_rows(target.model)} rows on torch's kernel", flush=True)
            for batch, n_new in SHAPES:
                rows = [RowInput(slot, args.cached, [5] * n_new) for slot in range(batch)]
                forward.run(rows)  # warm the kernel's shape
                results[kernel].setdefault((batch, n_new), []).append(pass_ms(forward, rows, args.iters))
            print(f"rep {rep + 1}/{args.reps}: {kernel} done", flush=True)
    print(f"\npass time, ms (median of {args.reps} repetitions of the median of {args.iters} passes), "
          f"{args.cached} cached tokens per session")
    print("| sessions x new tokens | torch (MKL) | oneDNN, packed | oneDNN, few rows tuned | tuned / packed | tuned / torch |")
    print("|---|---|---|---|---|---|")
    for shape in SHAPES:
        aten, packed, tuned = (statistics.median(results[k][shape]) for k in kernels)
        print(f"| {shape[0]} x {shape[1]} | {aten:.1f} | {packed:.1f} | {tuned:.1f} | {tuned / packed:.2f} | "
              f"{tuned / aten:.2f} |")


if __name__ == "__main__":
    main()
