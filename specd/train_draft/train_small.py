"""Training a small causal LM draft (`--kind small`) on self-distillation shards.

The draft is the target's own architecture cut to two decoder layers, started from the target's
first and last layers, with the target's embeddings, final norm and LM head (frozen, tied as in
the target). The loss is the cross-entropy between the target's next-token distribution (its LM
head on the stored feature, over the draft vocabulary) and the draft's. The result is a plain
transformers folder: serve it with `--method draft_model --model DIR`.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from specd.models import LoadedModel
from specd.train_draft.loop import train_for
from specd.train_draft.selfdistill import Example, load_shards
from specd.train_draft.train_head import draft_vocabulary, split_held_out

LAYERS_KEPT = (0, -1)
WINDOW = 192
BATCH = 8
LR = 3e-4


def small_from_target(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the target with only LAYERS_KEPT; embeddings and LM head frozen."""
    small = copy.deepcopy(model)
    decoder = small.get_decoder()
    decoder.layers = torch.nn.ModuleList([decoder.layers[i] for i in LAYERS_KEPT])
    for i, layer in enumerate(decoder.layers):
        layer.self_attn.layer_idx = i
    small.config.num_hidden_layers = len(LAYERS_KEPT)
    if hasattr(small.config, "layer_types") and small.config.layer_types:
        small.config.layer_types = [small.config.layer_types[i] for i in LAYERS_KEPT]
    small.get_input_embeddings().weight.requires_grad_(False)
    small.get_output_embeddings().weight.requires_grad_(False)
    return small


def window_batch(examples: Sequence[Example], rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, W], target features [B, W, d], mask [B, W]) of random windows."""
    d = examples[0].features.shape[1]
    tokens = torch.zeros(BATCH, WINDOW, dtype=torch.long)
    feats = torch.zeros(BATCH, WINDOW, d)
    mask = torch.zeros(BATCH, WINDOW, dtype=torch.bool)
    for b in range(BATCH):
        ex = examples[rng.randrange(len(examples))]
        start = rng.randrange(max(1, ex.tokens.shape[0] - WINDOW + 1))
        n = min(WINDOW, ex.tokens.shape[0] - start)
        tokens[b, :n] = ex.tokens[start: start + n]
        feats[b, :n] = ex.features[start: start + n].float()
        mask[b, :n] = True
    return tokens, feats, mask


def small_loss(small: torch.nn.Module, lm: torch.Tensor, batch) -> tuple[torch.Tensor, dict[str, float]]:
    tokens, feats, mask = (t.to(lm.device) for t in batch)
    with torch.no_grad():
        target_logp = F.log_softmax(feats @ lm.T, dim=-1)
    hidden = small.get_decoder()(input_ids=tokens, attention_mask=mask.long()).last_hidden_state
    logq = F.log_softmax(hidden @ lm.T, dim=-1)
    m = mask.float()
    denom = m.sum().clamp(min=1)
    loss = (-(target_logp.exp() * logq).sum(-1) * m).sum() / denom
    acc = float(((logq.argmax(-1) == target_logp.argmax(-1)).float() * m).sum() / denom)
    return loss, {"acc1": acc, "cls": loss.item()}


def train_small(target: LoadedModel, shards: Sequence[Path], out: Path, args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    train, held = split_held_out(load_shards(shards), args.seed)
    small = small_from_target(target.model)
    vocab = draft_vocabulary(train, args.draft_vocab, target.vocab_size)
    lm = target.model.get_output_embeddings().weight.detach().float()[vocab.to(target.device)].contiguous()
    rng = random.Random(args.seed)

    def evaluate() -> dict[str, float]:
        eval_rng = random.Random(1234)
        return small_loss(small, lm, window_batch(held, eval_rng))[1]

    result = train_for(small, lambda: small_loss(small, lm, window_batch(train, rng)), evaluate, out, args.minutes,
                       args.lr or LR, "training small draft")
    small.eval().cpu()
    small.save_pretrained(out / "model")
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(out / "model")
    print(f"saved the small draft to {out / 'model'} after {result.steps} steps: held-out acc@1 "
          f"{result.held_out['acc1']:.3f}; serve it with --method draft_model --model {out / 'model'}", file=sys.stderr)
    return 0
