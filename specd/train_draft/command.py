"""`specd train-draft`: make self-distillation data for a target, then train a draft on it.

    specd train-draft --target smollm2 --out drafts/smollm2-head --kind head --minutes 20

Both phases resume: data shards already in OUT/data (or --data) are kept and generation goes on
until --data-tokens; training continues from OUT/checkpoint.pt. The log (OUT/train.log, one JSON
object a line) records loss and held-out acceptance; OUT/command.txt the command that made it.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger(__name__)


def add_train_draft_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2", help="the target model the draft serves (default: the bundled smollm2)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the draft, its log and its data go")
    p.add_argument("--kind", choices=("head", "small"), default="head",
                   help="head: an EAGLE-style head on the target's features (the method `head`); small: a small "
                        "causal LM sharing the target's tokenizer, embeddings and LM head (the method `draft_model`)")
    p.add_argument("--minutes", type=float, default=20.0, help="training time budget (default 20)")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="self-distillation shards to use and extend (default: OUT/data)")
    p.add_argument("--data-tokens", type=int, default=150_000,
                   help="generate data until the shards hold this many tokens (default 150000)")
    p.add_argument("--data-minutes", type=float, default=30.0, help="time budget for making data (default 30)")
    p.add_argument("--prompts", type=int, default=6000, help="training prompts to build (default 6000)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generation batch (default 32)")
    p.add_argument("--temperatures", default="0,0.7", type=_floats, metavar="T,T",
                   help="sampling temperatures of the data, shard by shard in turn (default 0,0.7; 0 is greedy)")
    p.add_argument("--train-batch", type=int, default=None,
                   help="head: windows per training step (default 16; more on a GPU)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 8e-4 for a head, 3e-4 small)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="draft vocabulary: the target's most emitted tokens (default 8192; 0: the whole vocabulary)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0)


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected one or more temperatures >= 0, got {text!r}")
    return values


def run_train_draft(args: argparse.Namespace, argv: list[str]) -> int:
    """argv: the command line after `specd`, recorded in OUT/command.txt."""
    from specd.models import load_model
    from specd.train_draft.corpus import build_prompts
    from specd.train_draft.selfdistill import make_shards

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text("specd " + " ".join(shlex.quote(a) for a in argv) + "\n")
    data_dir = Path(args.data) if args.data else out / "data"
    target = load_model(args.target, device=args.device)
    print(f"building {args.prompts} training prompts from local text ...", file=sys.stderr)
    prompts = build_prompts(args.prompts, seed=args.seed)
    bar = tqdm(total=args.data_tokens, desc="self-distillation data", unit="tok", file=sys.stderr)

    def on_shard(done: int, total: int, tokens: int) -> None:
        bar.n = min(tokens, args.data_tokens)
        bar.set_postfix(prompts=f"{done}/{total}")
        bar.refresh()

    start = time.monotonic()
    shards = make_shards(target, prompts, data_dir, args.data_minutes, args.data_tokens, batch_size=args.batch_size,
                         temperatures=args.temperatures, seed=args.seed, progress=on_shard)
    bar.close()
    print(f"data: {len(shards)} shards in {data_dir} ({time.monotonic() - start:.0f} s this run)", file=sys.stderr)
    if args.kind == "head":
        from specd.train_draft.train_head import train_head

        return train_head(target, shards, out, args)
    from specd.train_draft.train_small import train_small

    return train_small(target, shards, out, args)


def main(argv: list[str] | None = None) -> int:
    """`python -m specd.train_draft.command ...`: the same as `specd train-draft ...`, importing
    only what training needs (no gRPC packages: a bare GPU machine with torch and transformers)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="specd train-draft", description=__doc__.split("\n")[0])
    add_train_draft_flags(parser)
    return run_train_draft(parser.parse_args(argv), ["train-draft", *argv])


if __name__ == "__main__":
    sys.exit(main())
