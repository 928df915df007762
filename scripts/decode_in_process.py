"""One session's plain decoding in one process: transformers against the target's own passes.

    PYTHONPATH=. python scripts/decode_in_process.py [--kind code_edit] [--tokens 32] [--reps 5]

Prints, for the kind's first prompt: transformers' `generate` (tokens/s, the prefill included),
transformers' forward with its cache one token at a time (ms a step), and the target service's
`TargetModel` verifying empty blocks (ms a step) as the service runs it: oneDNN linear layers,
OpenMP settings (`specd.openmp`), the main thread serial and the passes on a second thread with
the cores. Against the stack's own passes at concurrency 1 (`scripts/held_cells.py KIND 1 0`,
the target's mean pass), the difference is what the work beside a pass costs it on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from specd.openmp import apply_openmp_defaults

apply_openmp_defaults()  # libgomp reads these when torch loads it, as in the services

import torch  # noqa: E402

from draft_service.proposers.base import Proposal  # noqa: E402
from specd.cpu_kernels import tune_few_rows, use_linear_kernel  # noqa: E402
from specd.models import load_model  # noqa: E402
from specd.openmp import serial_until_model_thread  # noqa: E402
from specd.sampling import SamplingParams  # noqa: E402
from specd.workloads import default_prompts_path, load_prompts, prompts_of_kind  # noqa: E402
from target_service.verifier import TargetModel  # noqa: E402


def transformers_generate_s(model, ids: list[int], tokens: int) -> float:
    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=tokens,
                       min_new_tokens=tokens, pad_token_id=0)
    return time.perf_counter() - start


def transformers_step_s(model, ids: list[int], tokens: int) -> float:
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        start = time.perf_counter()
        for _ in range(tokens - 1):
            token = int(out.logits[0, -1].argmax())
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        return (time.perf_counter() - start) / (tokens - 1)


def target_step_s(target: TargetModel, ids: list[int], tokens: int) -> float:
    with torch.inference_mode():
        session = target.open_session(ids, SamplingParams(max_tokens=tokens))
        target.prefill(session)
        start = time.perf_counter()
        for _ in range(tokens - 1):
            target.verify_batch([(session, Proposal())])
        elapsed = (time.perf_counter() - start) / (tokens - 1)
        session.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="code_edit")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    prompt = prompts_of_kind(load_prompts(default_prompts_path()), args.kind, args.tokens)[0]
    threads = serial_until_model_thread("cpu")
    loaded = load_model(None)
    ids = list(loaded.tokenizer(prompt.prompt)["input_ids"])
    results: dict[str, list[float]] = {"generate": [], "forward": [], "target": []}

    def model_thread() -> None:  # the service's scheduler thread: one OpenMP team, all the cores
        if threads:
            torch.set_num_threads(threads)
        for rep in range(args.reps + 1):  # transformers as loaded (torch's kernels); round 0 warms up
            generate_s = transformers_generate_s(loaded.model, ids, args.tokens)
            forward_s = transformers_step_s(loaded.model, ids, args.tokens)
            if rep:
                results["generate"].append(generate_s)
                results["forward"].append(forward_s)
            print(f"transformers round {rep}/{args.reps}", flush=True)
        use_linear_kernel(loaded.model, "onednn")  # then the target as the service runs it
        tune_few_rows(loaded.model)
        target = TargetModel(loaded)
        for rep in range(args.reps + 1):
            target_s = target_step_s(target, ids, args.tokens)
            if rep:
                results["target"].append(target_s)
            print(f"target round {rep}/{args.reps}", flush=True)

    worker = threading.Thread(target=model_thread)
    worker.start()
    worker.join()
    print(f"{args.kind}, {len(ids)} prompt tokens, {args.tokens} tokens, medians of {args.reps}:")
    print(f"  transformers generate: {args.tokens / statistics.median(results['generate']):.1f} tokens/s")
    print(f"  transformers forward with its cache: {1000 * statistics.median(results['forward']):.1f} ms a step")
    print(f"  the target's passes (oneDNN, the service's threads): {1000 * statistics.median(results['target']):.1f} "
          "ms a step")


if __name__ == "__main__":
    main()
