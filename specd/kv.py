"""Thin helpers over transformers' KV cache, so the rest of specd does not track its API changes."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


def new_cache(model: Any) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Roll the cache back so that it holds the first `length` positions."""
    extra = cache_length(cache) - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} positions to {length}")
    if extra:
        cache.crop(-extra)


def forward(model: Any, token_ids: list[int], cache: DynamicCache, keep_last: int = 0) -> torch.Tensor:
    """Run token_ids through the model on top of cache; return float32 logits [n, vocab].

    keep_last > 0 computes logits only for the last keep_last positions (a prefill needs one row,
    and the LM head over a long prompt would otherwise cost more than the layers).
    """
    device = model.device
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    with torch.inference_mode():
        out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=keep_last)
        return out.logits[0].float()
