"""Training an EAGLE-style head (draft_service/head/model.py) on self-distillation shards.

Each training example is a window of a sequence: pairs (f_i, x_{i+1}) in, f_{i+1} out. The loss
has two parts, as in EAGLE: a smooth-L1 regression of the predicted feature onto the target's,
and a cross-entropy between the target's next-token distribution (softmax of its own LM head
over the draft vocabulary at f_{i+1}) and the head's. A second pass feeds the head its own
predictions as features, the way drafting a second token does, and is trained the same way, so
the head learns to continue from its own guesses.

Held-out acceptance: acc@1 is how often the head's first token equals the target's greedy token;
acc@2 the same for a token drafted from the head's own feature. est. acceptance length at k = 4
is 1 + a1 + a1 a2 + a1 a2^2 + a1 a2^3, assuming later tokens behave like the second.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from draft_service.head.checkpoint import save_head
from draft_service.head.model import DraftHead, HeadConfig, parameter_count
from specd.models import LoadedModel
from specd.train_draft.loop import train_for
from specd.train_draft.selfdistill import Example, load_shards
from specd.vocab import vocab_hash

WINDOW = 192
BATCH = 16
LR = 8e-4
CLS_WEIGHT = 0.5
HELD_OUT_FRACTION = 0.05


def estimated_acceptance_length(a1: float, a2: float, k: int = 4) -> float:
    """Expected tokens per verify step (accepted drafts + the target's own) when the first draft
    token is accepted with probability a1 and each later one with a2."""
    total, run = 1.0, 1.0
    for j in range(k):
        run *= a1 if j == 0 else a2
        total += run
    return total


def draft_vocabulary(examples: Sequence[Example], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent token ids in the data (sorted ids); everything when size is 0."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        counts += torch.bincount(ex.tokens, minlength=vocab_size)
    return torch.topk(counts, size).indices.sort().values


@dataclass
class Batch:
    features: torch.Tensor  # [B, W, d] f_i
    embeds: torch.Tensor  # [B, W, d] embed(x_{i+1})
    targets: torch.Tensor  # [B, W, d] f_{i+1}
    positions: torch.Tensor  # [W] (windows start at their own offsets; see make_batch)
    mask: torch.Tensor  # [B, W] bool: real pairs


def make_batch(examples: Sequence[Example], embed: torch.Tensor, rng: random.Random, window: int = WINDOW,
               batch: int = BATCH) -> Batch:
    """Random windows, built on embed's device (examples whose features already live there, as
    train_head puts them on a GPU, are sliced without a host copy)."""
    device, d = embed.device, embed.shape[1]
    feats = torch.zeros(batch, window, d, device=device)
    targets = torch.zeros(batch, window, d, device=device)
    next_ids = torch.zeros(batch, window, dtype=torch.long)
    mask = torch.zeros(batch, window, dtype=torch.bool)
    for b in range(batch):
        ex = examples[rng.randrange(len(examples))]
        pairs = ex.tokens.shape[0] - 1
        start = rng.randrange(max(1, pairs - window + 1))
        n = min(window, pairs - start)
        feats[b, :n] = ex.features[start: start + n]
        targets[b, :n] = ex.features[start + 1: start + 1 + n]
        next_ids[b, :n] = ex.tokens[start + 1: start + 1 + n]
        mask[b, :n] = True
    mask = mask.to(device)
    embs = embed[next_ids.to(device)] * mask[..., None]
    # Rotary positions are relative inside attention, so one shared range per window is exact.
    return Batch(feats, embs, targets, torch.arange(window, device=device), mask)


def head_losses(head: DraftHead, lm: torch.Tensor, b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Regression plus cross-entropy, for the first pass and for a pass on the head's own features."""
    with torch.no_grad():
        target_logp = F.log_softmax(b.targets @ lm.T, dim=-1)
        target_tok = target_logp.argmax(-1)
    total = torch.zeros((), device=b.features.device)
    stats: dict[str, float] = {}
    features = b.features
    m = b.mask.float()
    denom = m.sum().clamp(min=1)
    for step in (1, 2):
        pred = head(b.embeds, features, b.positions)
        reg = (F.smooth_l1_loss(pred, b.targets, reduction="none").mean(-1) * m).sum() / denom
        logq = F.log_softmax(pred @ lm.T, dim=-1)
        cls = (-(target_logp.exp() * logq).sum(-1) * m).sum() / denom
        total = total + reg + CLS_WEIGHT * cls
        with torch.no_grad():
            stats[f"acc{step}"] = float(((logq.argmax(-1) == target_tok).float() * m).sum() / denom)
            stats[f"reg{step}"], stats[f"cls{step}"] = float(reg), float(cls)
        # pass 2: pair i reads the head's prediction of f_i (made from pair i - 1) instead of f_i
        features = torch.cat([b.features[:, :1], pred[:, :-1].detach()], dim=1)
    return total, stats


def evaluate(head: DraftHead, lm: torch.Tensor, examples: Sequence[Example], embed: torch.Tensor,
             batch: int = BATCH) -> dict[str, float]:
    rng = random.Random(1234)
    sums: dict[str, float] = {}
    n = max(1, 4 * BATCH // batch)  # the same number of held-out windows whatever the batch size
    for _ in range(n):
        _, stats = head_losses(head, lm, make_batch(examples, embed, rng, batch=batch))
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v / n
    sums["est_acceptance_length_k4"] = estimated_acceptance_length(sums["acc1"], sums["acc2"])
    return sums


def split_held_out(examples: Sequence[Example], seed: int) -> tuple[list[Example], list[Example]]:
    """(training, held-out) sequences: a fixed random 5 % held out."""
    examples = [ex for ex in examples if ex.tokens.shape[0] >= 8]
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_held = max(1, int(len(examples) * HELD_OUT_FRACTION))
    return [examples[i] for i in order[n_held:]], [examples[i] for i in order[:n_held]]


def train_head(target: LoadedModel, shards: Sequence[Path], out: Path, args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    train, held = split_held_out(load_shards(shards), args.seed)
    model = target.model
    embed = model.get_input_embeddings().weight.detach().float()
    full_lm = model.get_output_embeddings().weight.detach().float()
    config = HeadConfig.of_target(model.config)
    state = {"draft_vocab": draft_vocabulary(train, args.draft_vocab, config.vocab_size)}
    head = DraftHead(config)
    head.init_from_target_layer(model.get_decoder().layers[-1], model.get_decoder().norm)
    head.to(target.device)  # trains on the target's device: a GPU when --device cuda (the default when present)
    tokens = sum(int(ex.tokens.shape[0]) for ex in train)
    print(f"head: {parameter_count(head) / 1e6:.2f} M parameters; {len(train)} training / {len(held)} held-out "
          f"sequences ({tokens} tokens); draft vocabulary {state['draft_vocab'].numel()}", file=sys.stderr)
    rng = random.Random(args.seed)
    lm = full_lm[state["draft_vocab"].to(full_lm.device)].contiguous()
    if target.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the head trains fine in TF32; the data was made in float32
    if target.device.type != "cpu":  # the data fits a GPU's memory; windows are then cut there
        train = [Example(ex.tokens, ex.features.to(target.device)) for ex in train]
        held = [Example(ex.tokens, ex.features.to(target.device)) for ex in held]
    batch = args.train_batch or BATCH

    def loss_fn():
        return head_losses(head, lm, make_batch(train, embed, rng, batch=batch))

    result = train_for(head, loss_fn, lambda: evaluate(head, lm, held, embed, batch), out, args.minutes, args.lr or LR,
                       "training head", extra_state=state)
    draft_vocab = state["draft_vocab"]  # a resumed run keeps the vocabulary it started with
    final = result.held_out
    save_head(out, head.cpu(), draft_vocab.cpu(), {
        "name": f"{target.name}-head", "target_model": target.name,
        "target_vocab_hash": vocab_hash(target.tokenizer, target.vocab_size), "kind": "head", "steps": result.steps,
        "train_minutes": round(result.minutes, 1), "train_tokens": tokens,
        "held_out": {k: round(v, 4) for k, v in final.items()},
    })
    print(f"saved the head to {out} after {result.steps} steps: held-out acc@1 {final['acc1']:.3f}, "
          f"acc@2 {final['acc2']:.3f}, est. acceptance length at k=4 {final['est_acceptance_length_k4']:.2f}",
          file=sys.stderr)
    return 0
