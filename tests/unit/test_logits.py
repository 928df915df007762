"""Tests for specd.logits: temperature, top-k, top-p and sampling."""

from __future__ import annotations

import math

import pytest
import torch

from specd.logits import logits_to_probs, sample


def _logits(rows: int = 4, vocab: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def test_rows_sum_to_one_and_float32() -> None:
    logits = _logits().to(torch.float16)
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.5, 8, 0.9)]:
        probs = logits_to_probs(logits, temperature, top_k, top_p)
        assert probs.dtype == torch.float32
        assert probs.shape == logits.shape
        torch.testing.assert_close(probs.sum(-1), torch.ones(logits.shape[0]))
        assert (probs >= 0).all()


def test_temperature_scaling_matches_softmax() -> None:
    logits = _logits()
    for temperature in (0.25, 1.0, 2.5):
        expected = torch.softmax(logits / temperature, dim=-1)
        torch.testing.assert_close(logits_to_probs(logits, temperature), expected)


def test_temperature_zero_is_one_hot_argmax() -> None:
    logits = _logits()
    probs = logits_to_probs(logits, 0.0, top_k=3, top_p=0.5)
    expected = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    assert torch.equal(probs, expected)


def test_temperature_zero_ties_pick_lowest_id() -> None:
    probs = logits_to_probs(torch.tensor([1.0, 3.0, 3.0, 0.0]), 0.0)
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_k_keeps_k_tokens() -> None:
    logits = _logits(rows=6, vocab=50)
    for k in (1, 3, 10):
        probs = logits_to_probs(logits, 1.0, top_k=k)
        assert ((probs > 0).sum(-1) == k).all()
        kept = probs > 0
        top = torch.zeros_like(kept).scatter_(-1, logits.topk(k, dim=-1).indices, True)
        assert torch.equal(kept, top)
        # Renormalised softmax over the kept set.
        expected = torch.softmax(logits.masked_fill(~top, float("-inf")), dim=-1)
        torch.testing.assert_close(probs, expected)


def test_top_k_disabled_when_zero_or_at_least_vocab() -> None:
    logits = _logits()
    full = logits_to_probs(logits, 1.0)
    assert torch.equal(logits_to_probs(logits, 1.0, top_k=0), full)
    assert torch.equal(logits_to_probs(logits, 1.0, top_k=-1), full)
    assert torch.equal(logits_to_probs(logits, 1.0, top_k=logits.shape[-1]), full)


def test_top_k_ties_are_deterministic_lowest_ids_first() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0])
    probs = logits_to_probs(logits, 1.0, top_k=2)
    assert (probs > 0).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(probs[1], torch.tensor(0.5))


def test_top_p_keeps_nucleus_hand_computed() -> None:
    # Probabilities 0.5, 0.25, 0.15, 0.1 (shuffled so sorting matters).
    base = torch.tensor([0.15, 0.5, 0.1, 0.25])
    logits = base.log()
    # top_p 0.7: 0.5 < 0.7, 0.5 + 0.25 = 0.75 >= 0.7 → nucleus {0.5, 0.25}.
    probs = logits_to_probs(logits, 1.0, top_p=0.7)
    torch.testing.assert_close(probs, torch.tensor([0.0, 2 / 3, 0.0, 1 / 3]))
    # top_p 0.85: 0.75 < 0.85, 0.9 >= 0.85 → adds 0.15.
    probs = logits_to_probs(logits, 1.0, top_p=0.85)
    torch.testing.assert_close(probs, torch.tensor([0.15, 0.5, 0.0, 0.25]) / 0.9)
    # top_p tiny: only the top token survives.
    probs = logits_to_probs(logits, 1.0, top_p=0.01)
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    # top_p 1.0 disables.
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_p=1.0), base)


def test_top_p_applies_after_top_k() -> None:
    # After top-k=2 the survivors are 0.5/0.75 and 0.25/0.75 = 2/3 and 1/3;
    # top_p 0.6 of *that* keeps only the first.
    logits = torch.tensor([0.15, 0.5, 0.1, 0.25]).log()
    probs = logits_to_probs(logits, 1.0, top_k=2, top_p=0.6)
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    probs = logits_to_probs(logits, 1.0, top_k=3, top_p=0.8)  # 0.5/.9, .25/.9=.833 → 2 kept
    torch.testing.assert_close(probs, torch.tensor([0.0, 2 / 3, 0.0, 1 / 3]))


def test_leading_dims_and_determinism() -> None:
    logits = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(1))
    a = logits_to_probs(logits, 0.8, top_k=7, top_p=0.9)
    b = logits_to_probs(logits.clone(), 0.8, top_k=7, top_p=0.9)
    assert a.shape == (2, 3, 40)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.reshape(6, 40), logits_to_probs(logits.reshape(6, 40), 0.8, 7, 0.9))


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError):
        logits_to_probs(_logits(), -1.0)
    with pytest.raises(ValueError):
        logits_to_probs(_logits(), float("nan"))
    with pytest.raises(ValueError):
        logits_to_probs(_logits(), 1.0, top_p=0.0)


def test_sample_shape_and_support() -> None:
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7], [1.0, 0.0, 0.0, 0.0]]).expand(3, 2, 4)
    tokens = sample(probs, torch.Generator().manual_seed(0))
    assert tokens.shape == (3, 2) and tokens.dtype == torch.long
    assert set(tokens[:, 0].tolist()) <= {1, 3}
    assert tokens[:, 1].tolist() == [0, 0, 0]


def test_sample_is_seeded_and_matches_distribution() -> None:
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 200_000
    tokens = sample(p.expand(draws, 4), torch.Generator().manual_seed(123))
    again = sample(p.expand(draws, 4), torch.Generator().manual_seed(123))
    assert torch.equal(tokens, again)
    freq = torch.bincount(tokens, minlength=4).float() / draws
    # 5 standard deviations of a binomial frequency at p=0.4.
    assert (freq - p).abs().max() < 5 * math.sqrt(0.25 / draws)
