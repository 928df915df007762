"""The `specd` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from specd.errors import InvalidArgument


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-model", default=None, help="hub id, local folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--method", default="ngram", choices=["none", "ngram", "suffix", "draft_model"], help="drafting method (default: ngram)")
    p.add_argument("--draft-model", default=None, help="draft model for --method draft_model: hub id, folder, .gguf, or 'target'")
    p.add_argument("--k", type=int, default=8, help="draft tokens per verify step (default: 8)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="weights dtype (default: float32)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="speculative decoding server and tools")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text, streaming tokens as they are accepted")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send PROMPT as one user message through the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_model_flags(gen)
    _add_sampling_flags(gen)

    bench = sub.add_parser("bench", help="benchmark methods against transformers' baselines on a prompts file")
    from coordinator.bench import add_bench_flags

    add_bench_flags(bench)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from coordinator.embedded import EngineOptions, build_engine
    from coordinator.engine import truncate_at_stop_string
    from specd.sampling import SamplingParams
    from specd.text import TextStream

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    ).validate()
    opts = EngineOptions(args.target_model, args.method, args.draft_model, args.k, args.device, args.dtype)
    engine, target = build_engine(opts)
    gen = engine.generate(target.encode(args.prompt, chat=args.chat), params)
    stream = TextStream(target.decode)
    if args.json:
        gen.run()
    else:
        shown = ""
        for chunk in gen:
            delta = stream.push(chunk)
            # Hold back text that might turn out to be the start of a stop string.
            visible = truncate_at_stop_string(shown + delta, params.stop) if params.stop else shown + delta
            sys.stdout.write(visible[len(shown):])
            sys.stdout.flush()
            shown = visible
        sys.stdout.write("\n")
    text = truncate_at_stop_string(target.decode(gen.token_ids), params.stop)
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": gen.token_ids,
            "prompt_tokens": len(gen.prompt_ids),
            "finish_reason": gen.finish_reason,
            "time_to_first_token_s": round(gen.time_to_first_token or 0.0, 4),
            "duration_s": round(gen.duration or 0.0, 4),
            "stats": gen.stats.to_dict(),
        }))
    else:
        s = gen.stats
        print(
            f"[{len(gen.token_ids)} tokens, finish={gen.finish_reason}, {len(gen.token_ids) / max(gen.duration or 1e-9, 1e-9):.1f} tok/s, "
            f"acceptance={s.acceptance_rate:.2f}, mean acceptance length={s.mean_acceptance_length:.2f}, "
            f"target passes={s.target_forward_passes}]",
            file=sys.stderr,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            from coordinator.bench import run_bench

            return run_bench(args)
    except InvalidArgument as exc:
        print(f"specd: invalid argument: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"specd: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
