"""Exact verification of draft tokens: greedy matching and speculative rejection sampling.

Vocabulary (used throughout the server):

- k: the number of draft tokens proposed in one verify step (k == 0 is allowed).
- draft tokens x_0..x_{k-1}: what the proposer guessed, each sampled from its distribution
  q_i (or chosen deterministically, in which case q_i is taken to be one-hot at x_i).
- target distributions p_0..p_k: the target model's next-token distributions after the
  context plus x_0..x_{i-1}; one verify forward pass yields all k+1 of them.
- accepted tokens: the longest prefix of draft tokens the verifier keeps.
- recovered token: drawn at the first rejected position i, from normalize(max(0, p_i - q_i)).
- bonus token: drawn from p_k when all k draft tokens were accepted.

Every verify step therefore emits num_accepted + 1 tokens: the accepted draft tokens followed
by exactly one recovered or bonus token. The emitted sequence is distributed exactly as if the
target alone had sampled it (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
Sampling"): P(emit y at position i) = q(y) min(1, p(y)/q(y)) + P(reject) residual(y) = p(y).

Everything here is pure tensor code (no model, no RPC). The batched helpers verify B
independent sequences at once, which is what the server does for many sessions; the public
single-sequence functions call them with B = 1 so both paths are the same code.

Random stream: a sampled verify step consumes, per sequence, k uniforms and then V
exponentials from the generator, in that order, whatever the outcome, so a seeded request
replays identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.logits import sample

__all__ = ["VerifyOutcome", "greedy_verify", "rejection_sample"]


@dataclass
class VerifyOutcome:
    """The result of verifying one block of draft tokens.

    num_accepted: how many leading draft tokens were kept (0..k).
    tokens: the accepted draft tokens followed by the recovered or bonus token;
            len(tokens) == num_accepted + 1 always.
    """

    num_accepted: int
    tokens: list[int]


# ---------------------------------------------------------------------------------------------
# Greedy verification
# ---------------------------------------------------------------------------------------------


def greedy_verify(
    draft_tokens: torch.Tensor,  # [k] long
    target_logits: torch.Tensor,  # [k+1, V] any float dtype (probabilities work too)
) -> VerifyOutcome:
    """Accept draft tokens while they equal the target's argmax; then emit the argmax.

    The emitted token after the accepted prefix is the target's argmax at the first mismatch
    (recovered) or at position k (bonus). Argmax ties go to the lowest token id, as in
    torch.argmax and in `specd.logits.logits_to_probs` with temperature 0.
    """
    _check_shapes(draft_tokens, target_logits, None)
    num_accepted, tokens = _greedy_verify_batch(draft_tokens[None], target_logits[None])
    return _outcome(num_accepted[0], tokens[0])


def _greedy_verify_batch(
    draft_tokens: torch.Tensor,  # [B, k] long
    target_logits: torch.Tensor,  # [B, k+1, V]
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] long, tokens [B, k+1] long
    """Batched greedy verification; see `_outcome` for how the outputs are read."""
    k = draft_tokens.shape[-1]
    target_argmax = target_logits.argmax(dim=-1)  # [B, k+1]
    matches = draft_tokens == target_argmax[:, :k]  # [B, k]
    num_accepted = _leading_true_count(matches)  # [B]
    # Accepted draft tokens equal the argmax at their positions, so the emitted tokens are
    # simply the argmax row: positions < num_accepted are the accepted drafts and position
    # num_accepted is the recovered/bonus token.
    return num_accepted, target_argmax


# ---------------------------------------------------------------------------------------------
# Rejection sampling
# ---------------------------------------------------------------------------------------------


def rejection_sample(
    draft_tokens: torch.Tensor,  # [k] long
    target_probs: torch.Tensor,  # [k+1, V] float32, rows sum to 1
    draft_probs: torch.Tensor | None,  # [k, V] float32, or None for deterministic drafts
    generator: torch.Generator | None = None,
) -> VerifyOutcome:
    """Speculative rejection sampling of one block of draft tokens.

    Draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection the recovered token is drawn from normalize(max(0, p_i - q_i)); if all k are
    accepted the bonus token is drawn from p_k.

    draft_probs None means the drafts were chosen deterministically (n-gram, suffix tree,
    greedy draft model), i.e. q_i is one-hot at x_i: x_i is accepted with probability
    p_i(x_i) and the recovered token is drawn from p_i with x_i zeroed, renormalised (which is
    exactly max(0, p_i - onehot(x_i)) normalised).

    target_probs and draft_probs must come from `specd.logits.logits_to_probs` with the same
    sampling parameters, or the output is not distributed as the target's.
    """
    _check_shapes(draft_tokens, target_probs, draft_probs)
    num_accepted, tokens = _rejection_sample_batch(
        draft_tokens[None],
        target_probs[None],
        None if draft_probs is None else draft_probs[None],
        generator,
    )
    return _outcome(num_accepted[0], tokens[0])


def _rejection_sample_batch(
    draft_tokens: torch.Tensor,  # [B, k] long
    target_probs: torch.Tensor,  # [B, k+1, V] float32
    draft_probs: torch.Tensor | None,  # [B, k, V] float32, or None (one-hot q)
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] long, tokens [B, k+1] long
    """Rejection sampling over B independent sequences, all with the same k.

    Returns num_accepted [B] and tokens [B, k+1]: row b holds the accepted draft tokens in
    positions < num_accepted[b], the recovered or bonus token at position num_accepted[b],
    and -1 after it. Inputs may be expanded (stride-0) views; nothing is written to them.
    """
    batch, k = draft_tokens.shape
    accept = _acceptance_test(draft_tokens, target_probs, draft_probs, generator)  # [B, k]
    num_accepted = _leading_true_count(accept)  # [B]
    final_dist = _final_token_distribution(draft_tokens, target_probs, draft_probs, num_accepted)
    final_token = sample(final_dist, generator)  # [B]

    positions = torch.arange(k + 1, device=draft_tokens.device)  # [k+1]
    padded_drafts = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    tokens = torch.where(positions < num_accepted[:, None], padded_drafts, -1)  # [B, k+1]
    tokens.scatter_(1, num_accepted[:, None], final_token[:, None])
    return num_accepted, tokens


def _acceptance_test(
    draft_tokens: torch.Tensor,  # [B, k] long
    target_probs: torch.Tensor,  # [B, k+1, V]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    generator: torch.Generator | None,
) -> torch.Tensor:  # [B, k] bool, True where draft token i passes its own test
    """Draw all B*k uniforms at once and test u < p(x)/q(x) at every position.

    Positions after the first rejection are tested too (it is cheaper than branching) and
    ignored by `_leading_true_count`.

    Edge cases, decided so that no NaN can appear and the sampler stays exact:
    - p(x) == q(x): the ratio is exactly 1.0 and u < 1 always (torch.rand is in [0, 1)),
      so the token is always accepted, as the math requires.
    - p(x) == 0: always rejected, whatever q says. The target never emits x (e.g. top-k or
      top-p removed it), so accepting it would emit an impossible token.
    - q(x) == 0 < p(x): cannot happen if x really was sampled from q, so it has measure zero
      and any choice keeps the output exact; we accept, which is the limit of
      min(1, p/q) as q(x) -> 0+ (a q(x) that underflowed to 0 behaves like a tiny one).
    - q None (one-hot): q(x) == 1, so the ratio is p(x) itself.
    """
    batch, k = draft_tokens.shape
    uniforms = torch.rand(
        (batch, k), generator=generator, device=draft_tokens.device, dtype=torch.float32
    )  # [B, k]
    p_draft = _gather_at_tokens(target_probs[:, :k], draft_tokens)  # [B, k]
    if draft_probs is None:
        return uniforms < p_draft
    q_draft = _gather_at_tokens(draft_probs, draft_tokens)  # [B, k]
    ratio = p_draft / q_draft.clamp_min(torch.finfo(q_draft.dtype).tiny)  # finite or +inf
    ratio = torch.where(q_draft > 0, ratio, torch.where(p_draft > 0, 1.0, 0.0))
    return uniforms < ratio


def _final_token_distribution(
    draft_tokens: torch.Tensor,  # [B, k] long
    target_probs: torch.Tensor,  # [B, k+1, V]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    num_accepted: torch.Tensor,  # [B] long
) -> torch.Tensor:  # [B, V] float32, rows sum to 1
    """The distribution of the token emitted after the accepted prefix, per sequence.

    With j = num_accepted: if j < k (a rejection at j) it is normalize(max(0, p_j - q_j));
    if j == k it is p_k (bonus). Both are max(0, p_j - q_j) with q_k := 0, so one formula
    serves every row. If the residual sums to 0 (p_j == q_j numerically, which also makes
    rejection impossible; or rounding) we fall back to p_j rather than divide by zero.
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)  # [B]
    p_j = target_probs[rows, num_accepted].float()  # [B, V]
    rejected = num_accepted < k  # [B]
    j_clamped = num_accepted.clamp_max(max(k - 1, 0))  # [B], a valid draft index when k > 0
    if k == 0:
        q_j = torch.zeros_like(p_j)
    elif draft_probs is None:
        x_j = draft_tokens[rows, j_clamped]  # [B]
        q_j = torch.zeros_like(p_j).scatter_(1, x_j[:, None], 1.0)
    else:
        q_j = draft_probs[rows, j_clamped].float()  # [B, V]
    q_j = q_j * rejected[:, None]  # the bonus row subtracts nothing

    residual = (p_j - q_j).clamp_min(0.0)  # [B, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p_j)


# ---------------------------------------------------------------------------------------------
# Small shared helpers
# ---------------------------------------------------------------------------------------------


def _leading_true_count(flags: torch.Tensor) -> torch.Tensor:
    """[B, k] bool → [B] long: the length of the all-True prefix of each row (0 when k == 0)."""
    return flags.long().cumprod(dim=-1).sum(dim=-1)


def _gather_at_tokens(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs [B, k, V], tokens [B, k] → [B, k] float32: probs[b, i, tokens[b, i]]."""
    return probs.gather(-1, tokens[..., None]).squeeze(-1).float()


def _outcome(num_accepted: torch.Tensor, tokens: torch.Tensor) -> VerifyOutcome:
    """One row of a batched result → VerifyOutcome, with a single host transfer."""
    flat = torch.cat([num_accepted.view(1), tokens.view(-1)]).tolist()
    n = flat[0]
    return VerifyOutcome(num_accepted=n, tokens=flat[1 : n + 2])


def _check_shapes(
    draft_tokens: torch.Tensor,
    target: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> None:
    """Fail loudly on shape mismatches that would otherwise broadcast into wrong answers."""
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be [k], got shape {tuple(draft_tokens.shape)}")
    k = draft_tokens.shape[0]
    if target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(f"target must be [k+1={k + 1}, V], got shape {tuple(target.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target.shape[1]):
        raise ValueError(
            f"draft_probs must be [k={k}, V={target.shape[1]}], got {tuple(draft_probs.shape)}"
        )
    if draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be long, got {draft_tokens.dtype}")
