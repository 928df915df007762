"""Self-distillation data: the target answers the training prompts, and every position's feature
(its last hidden state after the final norm) is kept, so the loss can use the target's own
logits (`lm_head(feature)`) without storing vocabulary-sized rows.

Prompts run in batches, left-padded, with a KV cache; answers are greedy or sampled, shard by
shard (temperatures 0 and 0.7 by default): greedy answers are the path greedy requests follow,
sampled ones cover more than that single path. Each shard is a `.pt` file of
sequences: token ids [n] and features [n, hidden] in float16, where feature i is the target's
state after reading tokens 0..i. Shards are written as they finish, so an interrupted run keeps
what it made and a rerun continues after the last shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specd.kv import new_cache
from specd.models import LoadedModel, encode_chat
from specd.train_draft.corpus import TrainingPrompt

MAX_PROMPT_TOKENS = 384


@dataclass
class Example:
    tokens: torch.Tensor  # [n] long
    features: torch.Tensor  # [n, hidden] float16


def encode_prompts(target: LoadedModel, prompts: Sequence[TrainingPrompt]) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = encode_chat(target.tokenizer, [{"role": "user", "content": p.text}]) if p.chat else \
            list(target.tokenizer(p.text)["input_ids"])
        out.append(ids[-MAX_PROMPT_TOKENS:])
    return out


@torch.inference_mode()
def generate_batch(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                   generator: torch.Generator) -> list[Example]:
    """Sample answers for a batch of prompts; return each prompt + answer with its features.

    Sampling and the features stay on the target's device until the batch is done (one copy to
    the host per batch, not one per row and step). `generator` must live on that device."""
    model = target.model
    base, lm_head = model.get_decoder(), model.get_output_embeddings()
    batch, width = len(prompts), max(len(p) for p in prompts)
    device = target.device
    input_ids = torch.zeros((batch, width), dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        input_ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    cache = new_cache(model)
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = base(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    prompt_features = out.last_hidden_state.half()
    step_tokens: list[torch.Tensor] = []  # [batch] per step
    step_features: list[torch.Tensor] = []  # [batch, hidden] per fed step: the state after reading that token
    answer_len = torch.zeros(batch, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    last = out.last_hidden_state[:, -1]
    eos = torch.tensor(sorted(target.eos_token_ids) or [-1], device=device)
    for _ in range(max_new_tokens):
        logits = lm_head(last).float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            token = logits.argmax(-1)
        answer_len += (~done).long()  # rows not yet done take this token (a row's answer ends with its eos)
        step_tokens.append(token)
        done |= torch.isin(token, eos)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long, device=device)], dim=1)
        positions = positions[:, -1:] + 1
        out = base(input_ids=token[:, None], attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        last = out.last_hidden_state[:, -1]
        step_features.append(last.half())
    tokens_host = torch.stack(step_tokens, dim=1).cpu()  # [batch, steps]
    fed_host = torch.stack(step_features, dim=1).cpu() if step_features else torch.zeros(batch, 0, last.shape[-1],
                                                                                        dtype=torch.half)
    prompt_host, lengths = prompt_features.cpu(), answer_len.cpu().tolist()
    seqs = []
    for b, p in enumerate(prompts):
        n = lengths[b]
        # the last token has a feature only when it was fed (not when every row was done before it)
        feats = torch.cat([prompt_host[b, width - len(p):], fed_host[b, :n]])
        tokens = torch.cat([torch.tensor(p, dtype=torch.long), tokens_host[b, :n]])[: feats.shape[0]]
        seqs.append(Example(tokens=tokens, features=feats[: tokens.shape[0]]))
    return seqs


def make_shards(target: LoadedModel, prompts: Sequence[TrainingPrompt], out_dir: Path, minutes: float,
                max_tokens: int, batch_size: int = 32, max_new_tokens: int = 160, temperatures: Sequence[float] = (0.0, 0.7),
                seed: int = 0, progress: Callable[[int, int, int], None] | None = None) -> list[Path]:
    """Generate shards of `batch_size` prompts until the shards hold `max_tokens` tokens, all
    prompts are done, or `minutes` pass. Shard n samples at temperatures[n % len(temperatures)]
    (0: greedy, the path a greedy request's drafts must follow; above 0: wider coverage).

    Continues after the shards already in out_dir. progress(done_prompts, total_prompts, tokens).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    existing = sorted(out_dir.glob("shard-*.pt"))
    encoded = encode_prompts(target, prompts)
    # Similar lengths share a batch (less padding). The order is deterministic, so a rerun skips
    # exactly the batches the existing shards hold.
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
    start_index = len(existing) * batch_size
    generator = torch.Generator(device=target.device)
    deadline = time.monotonic() + minutes * 60
    shards = list(existing)
    tokens = sum(_shard_tokens(p) for p in existing)
    if progress is not None:
        progress(min(start_index, len(prompts)), len(prompts), tokens)
    for n in range(start_index, len(order), batch_size):
        if time.monotonic() > deadline or tokens >= max_tokens:
            break
        idx = order[n: n + batch_size]
        generator.manual_seed(seed * 100_003 + len(shards))  # per shard: a resumed run samples what a fresh one would
        temperature = temperatures[len(shards) % len(temperatures)]
        seqs = generate_batch(target, [encoded[i] for i in idx], max_new_tokens, temperature, generator)
        path = out_dir / f"shard-{len(shards):05d}.pt"
        torch.save({"tokens": [s.tokens for s in seqs], "features": [s.features for s in seqs]}, path)
        shards.append(path)
        tokens += sum(int(s.tokens.shape[0]) for s in seqs)
        if progress is not None:
            progress(n + len(idx), len(prompts), tokens)
    return shards


def _shard_tokens(path: Path) -> int:
    return sum(int(t.shape[0]) for t in torch.load(path)["tokens"])


def load_shards(paths: Sequence[Path]) -> list[Example]:
    seqs: list[Example] = []
    for path in paths:
        data: dict[str, Any] = torch.load(path)
        seqs.extend(Example(t, f) for t, f in zip(data["tokens"], data["features"]))
    return seqs
