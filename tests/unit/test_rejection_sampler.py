"""Tests for target_service.rejection_sampler: greedy verification and exact rejection sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specd.logits import sample
from target_service.rejection_sampler import (
    VerifyOutcome,
    _greedy_verify_batch,
    _rejection_sample_batch,
    greedy_verify,
    rejection_sample,
)

VOCAB = 50


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits_with_argmax(argmax: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """[len(argmax), vocab] random logits whose row-wise argmax is `argmax`."""
    logits = torch.randn(len(argmax), vocab, generator=_gen(7))
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 100.0
    return logits


def _dirichlet(rows: int, vocab: int, alpha: float, rng: np.random.Generator) -> torch.Tensor:
    """[rows, vocab] float32 random distributions, renormalised in float32."""
    probs = torch.from_numpy(rng.dirichlet(np.full(vocab, alpha), size=rows)).float()
    return probs / probs.sum(-1, keepdim=True)


def _tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Total variation between the empirical distribution of `tokens` and p [V]."""
    freq = torch.bincount(tokens, minlength=p.shape[-1]).double() / tokens.numel()
    return 0.5 * (freq - p.double()).abs().sum().item()


# ---------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------


def test_perfect_match() -> None:
    draft = torch.tensor([3, 9, 4])
    out = greedy_verify(draft, _logits_with_argmax([3, 9, 4, 11]))
    assert out == VerifyOutcome(num_accepted=3, tokens=[3, 9, 4, 11])


def test_early_mismatch() -> None:
    draft = torch.tensor([3, 9, 4])
    out = greedy_verify(draft, _logits_with_argmax([3, 8, 4, 11]))
    assert out == VerifyOutcome(num_accepted=1, tokens=[3, 8])


def test_first_token_mismatch() -> None:
    draft = torch.tensor([3, 9, 4])
    out = greedy_verify(draft, _logits_with_argmax([5, 9, 4, 11]))
    assert out == VerifyOutcome(num_accepted=0, tokens=[5])


def test_k_zero() -> None:
    empty = torch.zeros(0, dtype=torch.long)
    assert greedy_verify(empty, _logits_with_argmax([17])) == VerifyOutcome(0, [17])

    one_hot = torch.zeros(1, VOCAB)
    one_hot[0, 23] = 1.0
    for q in (None, torch.zeros(0, VOCAB)):
        assert rejection_sample(empty, one_hot, q, _gen()) == VerifyOutcome(0, [23])

    p = _dirichlet(1, VOCAB, 0.5, np.random.default_rng(0))
    out = rejection_sample(empty, p, None, _gen(1))
    assert out.num_accepted == 0 and len(out.tokens) == 1 and p[0, out.tokens[0]] > 0


def test_greedy_batch_matches_loop() -> None:
    gen = _gen(3)
    batch, k, vocab = 64, 4, 6  # tiny vocab so matches are common
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (batch, k), generator=gen)
    drafts[::2] = logits[::2, :k].argmax(-1)  # half the rows match fully
    num_accepted, tokens = _greedy_verify_batch(drafts, logits)
    for b in range(batch):
        argmax = logits[b].argmax(-1).tolist()
        n = 0
        while n < k and drafts[b, n].item() == argmax[n]:
            n += 1
        assert num_accepted[b].item() == n
        assert tokens[b, : n + 1].tolist() == drafts[b, :n].tolist() + [argmax[n]]
        assert greedy_verify(drafts[b], logits[b]) == VerifyOutcome(n, argmax[: n + 1])


def test_greedy_equals_rejection_sampling_with_greedy_probs() -> None:
    """Temperature 0 makes p one-hot; rejection sampling must then reduce to greedy."""
    logits = _logits_with_argmax([3, 8, 4, 11])
    p = torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float()
    draft = torch.tensor([3, 9, 4])
    assert rejection_sample(draft, p, None, _gen()) == greedy_verify(draft, logits)


# ---------------------------------------------------------------------------------------------
# Rejection sampling: deterministic edge cases
# ---------------------------------------------------------------------------------------------


def _batch(x: torch.Tensor, batch: int) -> torch.Tensor:
    return x.expand(batch, *x.shape)


@pytest.mark.parametrize("with_q", [True, False])
def test_zero_target_prob_always_rejected(with_q: bool) -> None:
    rng = np.random.default_rng(1)
    k, batch = 3, 20_000
    p = _dirichlet(k + 1, VOCAB, 1.0, rng)
    q = _dirichlet(k, VOCAB, 1.0, rng)
    draft = torch.tensor([5, 6, 7])
    p[0, 5] = 0.0
    p[0] /= p[0].sum()
    num_accepted, tokens = _rejection_sample_batch(
        _batch(draft, batch), _batch(p, batch), _batch(q, batch) if with_q else None, _gen(2)
    )
    assert (num_accepted == 0).all()
    assert (tokens[:, 0] != 5).all()
    assert (tokens[:, 1:] == -1).all()


@pytest.mark.parametrize("k", [1, 4])
def test_p_equals_q_always_accepted(k: int) -> None:
    rng = np.random.default_rng(2)
    batch = 20_000
    p = _dirichlet(k + 1, VOCAB, 0.5, rng)
    gen = _gen(4)
    drafts = sample(_batch(p[:k], batch), gen)  # [B, k] drafted from q == p[:k]
    num_accepted, tokens = _rejection_sample_batch(drafts, _batch(p, batch), _batch(p[:k], batch), gen)
    assert (num_accepted == k).all()
    assert torch.equal(tokens[:, :k], drafts)
    # The bonus token follows p_k.
    assert _tv(tokens[:, k], p[k]) < 0.03


def test_one_hot_target_at_draft_always_accepted_without_q() -> None:
    draft = torch.tensor([2, 4])
    p = torch.nn.functional.one_hot(torch.tensor([2, 4, 9]), VOCAB).float()
    num_accepted, tokens = _rejection_sample_batch(_batch(draft, 1000), _batch(p, 1000), None, _gen())
    assert (num_accepted == 2).all()
    assert (tokens == torch.tensor([2, 4, 9])).all()


def test_one_hot_rule() -> None:
    """q None: accept x with probability p(x); on rejection draw from p with x removed."""
    batch = 200_000
    p = torch.zeros(2, 8)
    p[0, :4] = torch.tensor([0.2, 0.4, 0.3, 0.1])
    p[1] = 1.0 / 8
    draft = torch.tensor([1])  # p(x) = 0.4
    num_accepted, tokens = _rejection_sample_batch(_batch(draft, batch), _batch(p, batch), None, _gen(5))
    rate = num_accepted.double().mean().item()
    assert abs(rate - 0.4) < 5 * math.sqrt(0.4 * 0.6 / batch)
    recovered = tokens[num_accepted == 0, 0]
    assert (recovered != 1).all()
    assert _tv(recovered, torch.tensor([0.2, 0.0, 0.3, 0.1, 0, 0, 0, 0]) / 0.6) < 0.01


def test_none_q_matches_explicit_one_hot_q() -> None:
    """q None is defined as one-hot q, so with the same seed both give identical outcomes."""
    rng = np.random.default_rng(3)
    k, batch = 3, 5_000
    p = _dirichlet(k + 1, VOCAB, 0.3, rng)
    drafts = torch.randint(0, VOCAB, (batch, k), generator=_gen(6))
    one_hot_q = torch.nn.functional.one_hot(drafts, VOCAB).float()
    a = _rejection_sample_batch(drafts, _batch(p, batch), None, _gen(8))
    b = _rejection_sample_batch(drafts, _batch(p, batch), one_hot_q, _gen(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_zero_draft_prob_is_accepted_if_target_allows_and_never_nan() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q_zero_at_0 = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    # q(x) == 0 < p(x): treated as ratio 1, accepted.
    for seed in range(20):
        out = rejection_sample(torch.tensor([0]), p, q_zero_at_0, _gen(seed))
        assert out.num_accepted == 1 and out.tokens[0] == 0
    # q(x) == 0 == p(x): rejected; residual max(0, p - q) = [0.5, 0, 0, 0] → token 0.
    for seed in range(20):
        out = rejection_sample(torch.tensor([3]), p, q_zero_at_0, _gen(seed))
        assert out == VerifyOutcome(0, [0])


def test_zero_residual_falls_back_to_target() -> None:
    """p == q but the drafted x has p(x) = q(x) = 0: rejected, residual is all 0, draw from p."""
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    num_accepted, tokens = _rejection_sample_batch(
        _batch(torch.tensor([2]), 4000), _batch(p, 4000), _batch(p[:1], 4000), _gen(9)
    )
    assert (num_accepted == 0).all()
    assert set(tokens[:, 0].tolist()) == {0, 1}


def test_public_function_equals_batch_of_one_and_is_seeded() -> None:
    rng = np.random.default_rng(4)
    k = 4
    p = _dirichlet(k + 1, VOCAB, 0.3, rng)
    q = _dirichlet(k, VOCAB, 0.3, rng)
    for seed in range(30):
        draft = sample(q, _gen(100 + seed))
        out = rejection_sample(draft, p, q, _gen(seed))
        again = rejection_sample(draft, p, q, _gen(seed))
        n, tokens = _rejection_sample_batch(draft[None], p[None], q[None], _gen(seed))
        assert out == again
        assert len(out.tokens) == out.num_accepted + 1
        assert out.num_accepted == n.item()
        assert out.tokens == tokens[0, : out.num_accepted + 1].tolist()
        assert (tokens[0, out.num_accepted + 1 :] == -1).all()
        assert out.tokens[: out.num_accepted] == draft[: out.num_accepted].tolist()


def test_bad_shapes_raise() -> None:
    p = torch.full((3, VOCAB), 1.0 / VOCAB)
    with pytest.raises(ValueError):
        rejection_sample(torch.tensor([1, 2, 3]), p, None, _gen())  # needs k+1 = 4 rows
    with pytest.raises(ValueError):
        rejection_sample(torch.tensor([1, 2]), p, torch.full((2, VOCAB - 1), 0.1), _gen())
    with pytest.raises(ValueError):
        greedy_verify(torch.tensor([[1, 2]]), p)


# ---------------------------------------------------------------------------------------------
# Rejection sampling: the output distribution is the target's
# ---------------------------------------------------------------------------------------------


def _expected_tv(p: torch.Tensor, draws: int) -> float:
    """Large-sample expected TV of an empirical distribution of `draws` samples from p:
    0.5 * sum_i E|freq_i - p_i| with freq_i ~ Normal(p_i, p_i (1 - p_i) / draws)."""
    p = p.double()
    return 0.5 * torch.sqrt(2 * p * (1 - p) / (math.pi * draws)).sum().item()


@pytest.mark.parametrize("with_q", [True, False], ids=["with_q", "one_hot_q"])
def test_rejection_sampling_converges_to_target(with_q: bool) -> None:
    """The first emitted token of 100k independent verify steps is distributed as p_0.

    p is Dirichlet(0.3) over 50 tokens; q is half p, half an independent Dirichlet, so the
    draft is plausible but wrong often enough that both the acceptance path and the
    recovered-token path carry real mass (acceptance at position 0 is about 0.6 with q and
    about 0.05 one-hot). Drafts are sampled from q per trial, also in one-hot mode, where the
    verifier is told nothing about q: exactness must hold for any draft choice.

    A correct sampler's TV at 100k draws is about 0.006 here (sd about 0.001; checked over
    several seeds), so the 0.01 bound has room while a wrong rule (e.g. residual = p, or
    accepting with p(x) instead of p(x)/q(x)) lands far above it.
    """
    rng = np.random.default_rng(5)
    k, draws = 3, 100_000
    p = _dirichlet(k + 1, VOCAB, 0.3, rng)  # [k+1, V]
    q = 0.5 * p[:k] + 0.5 * _dirichlet(k, VOCAB, 0.3, rng)  # [k, V]
    q = q / q.sum(-1, keepdim=True)
    gen = _gen(5)
    drafts = sample(_batch(q, draws), gen)  # [draws, k]
    num_accepted, tokens = _rejection_sample_batch(
        drafts, _batch(p, draws), _batch(q, draws) if with_q else None, gen
    )
    first = tokens[:, 0]
    tv_1k, tv_100k = _tv(first[:1_000], p[0]), _tv(first, p[0])
    assert tv_100k < 0.01, tv_100k
    assert tv_100k < tv_1k, (tv_1k, tv_100k)

    # Acceptance rate at position 0 matches theory: sum_x min(p, q) with q, E_q[p(x)] one-hot.
    expected_rate = (torch.minimum(p[0], q[0]) if with_q else p[0] * q[0]).sum().item()
    rate = (num_accepted >= 1).double().mean().item()
    assert abs(rate - expected_rate) < 5 * math.sqrt(expected_rate * (1 - expected_rate) / draws)

    # Given the first draft was accepted, the second emitted token is distributed as p_1.
    second = tokens[num_accepted >= 1, 1]
    assert _tv(second, p[1]) < 2 * _expected_tv(p[1], second.numel())
