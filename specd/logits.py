"""Turning logits into the probabilities tokens are sampled from, and sampling them.

Speculative decoding is only exact when the draft's q and the target's p are both the
distributions the request *would* sample from: the same temperature, top-k and top-p applied
the same way. Both sides therefore call `logits_to_probs` with the request's SamplingParams, and
everything here is deterministic (stable sorts, explicit tie rules, float32 throughout), so the
same logits give bit-identical probabilities on either side.

Shape convention: V is the vocabulary size; "..." is any number of leading (batch, position)
dimensions, processed row by row.
"""

from __future__ import annotations

import torch

__all__ = ["logits_to_probs", "sample"]


def logits_to_probs(
    logits: torch.Tensor,  # [..., V] any float dtype
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [..., V] float32, each row sums to 1
    """Probabilities after temperature, then top-k, then top-p, renormalised.

    temperature == 0 means greedy: the one-hot of the argmax (ties: lowest token id, as
    torch.argmax does), so a greedy request is a deterministic "distribution" the rejection
    sampler can verify like any other. top_k <= 0 and top_p >= 1 disable those filters.

    Order follows vLLM and Hugging Face: top-p looks at the distribution that top-k left,
    renormalised, so top_p=0.9 means "90% of what survived top-k".
    """
    if not temperature >= 0.0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not top_p > 0.0:
        raise ValueError(f"top_p must be > 0, got {top_p}")
    logits = logits.float()
    if temperature == 0.0:
        return _one_hot_argmax(logits)
    scaled = logits / temperature  # [..., V]
    vocab = scaled.shape[-1]
    if (0 < top_k < vocab) or top_p < 1.0:
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    return torch.softmax(scaled, dim=-1)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] float32 → [..., V] float32 one-hot at the first maximal logit."""
    best = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
    return torch.zeros_like(logits).scatter_(-1, best, 1.0)


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set the logits of tokens outside top-k / the top-p nucleus to -inf.

    scaled: [..., V] float32 temperature-scaled logits. One stable descending sort serves
    both filters, so ties are broken the same way every time: among equal logits the lower
    token id ranks first (and is the one kept when a cut falls inside a tie).
    """
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [..., V]
    ranks = torch.arange(vocab, device=scaled.device)  # [V]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)  # [..., V] in sorted order
    if 0 < top_k < vocab:
        drop |= ranks >= top_k
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p < 1.0:
        drop |= _outside_nucleus(sorted_logits, top_p)
    # Undo the sort: drop_in_vocab_order[..., order[..., r]] = drop[..., r].
    drop_in_vocab_order = torch.empty_like(drop).scatter_(-1, order, drop)
    return scaled.masked_fill(drop_in_vocab_order, float("-inf"))


def _outside_nucleus(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] descending logits → [..., V] bool, True for ranks outside the top-p nucleus.

    The nucleus is the smallest prefix of ranks whose probability mass reaches top_p: rank r
    is kept iff the mass strictly before it is still below top_p. Rank 0 is always kept, so
    no row is ever emptied.
    """
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [..., V]
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [..., V] exclusive cumsum
    outside = mass_before >= top_p
    outside[..., 0] = False
    return outside


def sample(
    probs: torch.Tensor,  # [..., V] non-negative, rows need not be normalised
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [...] long token ids
    """Draw one token per row, proportional to probs.

    Uses the exponential race (Gumbel-max in disguise): argmax(probs / E) with E ~ Exp(1)
    i.i.d. picks index i with probability probs[i] / sum(probs). Unlike torch.multinomial it
    works on any number of leading dimensions, needs no normalisation and consumes exactly
    one exponential per vocabulary entry from `generator`, so seeded streams are reproducible.
    Tokens with probability 0 are never drawn (unless the whole row is 0, which callers must
    not pass).
    """
    exp = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    # exponential_ can return exactly 0 in float32; 0/0 would be NaN and argmax picks NaNs,
    # so a zero-probability token could win. Clamping keeps 0/tiny == 0.
    exp.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / exp).argmax(dim=-1)
