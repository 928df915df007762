"""The target side of speculative decoding: KV-cached sessions that prefill, verify and roll back.

A session's cache always holds the prompt and every emitted token except the newest one (the
*pending* token): a verify step feeds [pending, d_1 .. d_k] in one forward pass, which yields the
target's distribution at each draft position plus one more (for the bonus token), then crops the
cache back to the accepted prefix.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from draft_service.proposers.base import Proposal
from specd.errors import InvalidArgument, PromptTooLong
from specd.kv import cache_length, crop_cache, forward, new_cache
from specd.logits import logits_to_probs, sample
from specd.models import LoadedModel
from specd.sampling import SamplingParams
from target_service.rejection_sampler import VerifyOutcome, greedy_verify, rejection_sample


def make_generator(seed: int | None, device: torch.device, offset: int = 0) -> torch.Generator:
    """A per-request random stream: seeded when asked for, else from the global RNG."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed((seed + offset) % (2**63))
    return gen


@dataclass
class SessionCounters:
    forward_passes: int = 0


class TargetSession:
    """One request's state on the target: its KV cache, pending token and random stream."""

    def __init__(self, target: "TargetModel", session_id: int, prompt_ids: Sequence[int], params: SamplingParams):
        self.target = target
        self.session_id = session_id
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.cache = new_cache(target.model.model)
        self.pending: int | None = None
        self.generator = make_generator(params.seed, target.model.device)
        self.counters = SessionCounters()

    @property
    def length(self) -> int:
        """Tokens in the sequence so far: prompt plus emitted (cached plus the pending one)."""
        return cache_length(self.cache) + (self.pending is not None)

    @property
    def room(self) -> int:
        """How many more tokens the model's context can take."""
        return self.target.model.max_context - self.length

    def prefill(self) -> int:
        """Run the prompt; return the first generated token (its time is the time to first token)."""
        if self.pending is not None:
            raise RuntimeError("session already prefilled")
        logits = forward(self.target.model.model, self.prompt_ids, self.cache, keep_last=1)
        self.counters.forward_passes += 1
        token = self._pick(logits[-1:])
        self.pending = token
        return token

    def verify(self, proposal: Proposal) -> VerifyOutcome:
        """Verify a block of draft tokens (possibly empty: plain decoding) in one forward pass."""
        if self.pending is None:
            raise RuntimeError("verify before prefill")
        k = len(proposal.tokens)
        if k >= max(self.room, 1):  # after this step the sequence must still fit the context
            raise InvalidArgument("draft_tokens", f"{k} draft tokens do not fit the {self.room} positions left")
        base = cache_length(self.cache)
        logits = forward(self.target.model.model, [self.pending, *proposal.tokens], self.cache)
        self.counters.forward_passes += 1
        outcome = self._accept(proposal, logits)
        # The cache now holds pending + all k drafts; keep pending + the accepted ones.
        crop_cache(self.cache, base + 1 + outcome.num_accepted)
        self.pending = outcome.tokens[-1]
        return outcome

    def _pick(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.is_greedy:
            return int(logits[0].argmax())
        probs = logits_to_probs(logits, p.temperature, p.top_k, p.top_p)
        return int(sample(probs, self.generator)[0])

    def _accept(self, proposal: Proposal, logits: torch.Tensor) -> VerifyOutcome:
        drafts = torch.tensor(proposal.tokens, dtype=torch.long, device=logits.device)
        p = self.params
        if p.is_greedy:
            return greedy_verify(drafts, logits)
        target_probs = logits_to_probs(logits, p.temperature, p.top_k, p.top_p)
        return rejection_sample(drafts, target_probs, proposal.probs, self.generator)

    def close(self) -> None:
        self.target._forget(self.session_id)
        self.cache = None  # type: ignore[assignment]


class TargetModel:
    """The verifier: a loaded target model and its open sessions."""

    def __init__(self, model: LoadedModel):
        self.model = model
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.sessions: dict[int, TargetSession] = {}

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> TargetSession:
        if not prompt_ids:
            raise InvalidArgument("prompt", "the prompt is empty")
        if len(prompt_ids) + 1 > self.model.max_context:
            raise PromptTooLong(len(prompt_ids), self.model.max_context)
        bad = [t for t in prompt_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise InvalidArgument("prompt", f"token id {bad[0]} is outside the vocabulary of {self.model.vocab_size}")
        with self._lock:
            session = TargetSession(self, next(self._ids), prompt_ids, params)
            self.sessions[session.session_id] = session
        return session

    def _forget(self, session_id: int) -> None:
        with self._lock:
            self.sessions.pop(session_id, None)
