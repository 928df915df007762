"""The target side of speculative decoding: sessions that prefill, verify blocks and roll back.

A session's KV row always holds the prompt and every emitted token except the newest one (the
*pending* token): a verify step runs [pending, d_1 .. d_k] in one forward pass, which yields the
target's distribution at each draft position plus one more (for the bonus token), and the row's
length then moves to just past the accepted prefix. Several sessions' steps can share one pass
(`verify_batch`); each row computes exactly what it would alone.
"""

from __future__ import annotations

import itertools
import threading
from typing import Sequence

import torch

from draft_service.proposers.base import Proposal
from specd.errors import InvalidArgument, PromptTooLong
from specd.logits import logits_to_probs, sample
from specd.models import LoadedModel
from specd.sampling import SamplingParams
from target_service.batch_forward import BatchedForward, RowInput
from target_service.rejection_sampler import VerifyOutcome, greedy_verify, rejection_sample


def make_generator(seed: int | None, device: torch.device, offset: int = 0) -> torch.Generator:
    """A per-request random stream: seeded when asked for, else from the global RNG."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed((seed + offset) % (2**63))
    return gen


class TargetSession:
    """One request's state on the target: its KV row, pending token and random stream."""

    def __init__(self, target: "TargetModel", session_id: int, prompt_ids: Sequence[int], params: SamplingParams):
        self.target = target
        self.session_id = session_id
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.slot: int | None = None
        self.cached = 0  # positions of the KV row in use
        self.pending: int | None = None
        self.generator = make_generator(params.seed, target.model.device)
        self.forward_passes = 0
        # Draft heads read the target's features: when set, every prefill and verify leaves the
        # features of the positions it kept in `new_features` as (first position, rows).
        self.want_features = False
        self.new_features: tuple[int, torch.Tensor] | None = None

    @property
    def length(self) -> int:
        """Tokens in the sequence so far: prompt plus emitted (cached plus the pending one)."""
        return self.cached + (self.pending is not None)

    @property
    def room(self) -> int:
        """How many more tokens the model's context can take."""
        return self.target.model.max_context - self.length

    def prefill(self) -> int:
        """Run the prompt; return the first generated token (its time is the time to first token)."""
        return self.target.prefill(self)

    def verify(self, proposal: Proposal) -> VerifyOutcome:
        """Verify a block of draft tokens (possibly empty: plain decoding) in one forward pass."""
        return self.target.verify_batch([(self, proposal)])[0]

    def check_block(self, proposal: Proposal) -> None:
        if self.pending is None:
            raise InvalidArgument("verify", "the session has no prefill yet")
        k = len(proposal.tokens)
        if k >= max(self.room, 1):  # after this step the sequence must still fit the context
            raise InvalidArgument("draft_tokens", f"{k} draft tokens do not fit the {self.room} positions left")
        vocab = self.target.model.vocab_size
        if any(not 0 <= t < vocab for t in proposal.tokens):
            raise InvalidArgument("draft_tokens", f"token ids must be below the vocabulary size {vocab}")
        if proposal.probs is not None and tuple(proposal.probs.shape) != (k, vocab):
            raise InvalidArgument("draft_probs", f"expected shape ({k}, {vocab}), got {tuple(proposal.probs.shape)}")

    def pick(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.is_greedy:
            return int(logits[-1].argmax())
        probs = logits_to_probs(logits[-1:], p.temperature, p.top_k, p.top_p)
        return int(sample(probs, self.generator)[0])

    def accept(self, proposal: Proposal, logits: torch.Tensor) -> VerifyOutcome:
        drafts = torch.tensor(proposal.tokens, dtype=torch.long, device=logits.device)
        p = self.params
        if p.is_greedy:
            return greedy_verify(drafts, logits)
        target_probs = logits_to_probs(logits, p.temperature, p.top_k, p.top_p)
        return rejection_sample(drafts, target_probs, proposal.probs, self.generator)

    def close(self) -> None:
        self.target.close_session(self)


class TargetModel:
    """The verifier: a loaded target model, its KV pool and its open sessions.

    Forward passes are serialized by a lock: the model runs one (possibly batched) pass at a time.
    """

    def __init__(self, model: LoadedModel, packed_passes: bool = True):
        """packed_passes: see BatchedForward (target_service/batch_forward.py)."""
        self.model = model
        self.forward = BatchedForward(model, packed=packed_passes)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._model_lock = threading.Lock()
        self.sessions: dict[int, TargetSession] = {}
        self.forward_passes = 0

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

    def prefill(self, session: TargetSession) -> int:
        if session.pending is not None:
            raise InvalidArgument("open", "session already prefilled")
        with self._model_lock:
            if session.slot is None:
                session.slot = self.forward.pool.allocate()
            logits, feats = self.forward.run_with_features([RowInput(session.slot, 0, session.prompt_ids)], keep_last=1,
                                                           features=session.want_features)
            logits = logits[0]
            self.forward_passes += 1
        session.new_features = (0, feats[0]) if feats is not None else None
        session.forward_passes += 1
        session.cached = len(session.prompt_ids)
        session.pending = session.pick(logits)
        return session.pending

    def verify_batch(self, items: list[tuple[TargetSession, Proposal]]) -> list[VerifyOutcome]:
        """Verify one block per session in a single forward pass; sessions must be distinct."""
        for session, proposal in items:
            session.check_block(proposal)
        rows = [RowInput(s.slot, s.cached, [s.pending, *p.tokens]) for s, p in items]  # type: ignore[arg-type, list-item]
        with self._model_lock:
            logits, feats = self.forward.run_with_features(rows, features=any(s.want_features for s, _ in items))
            self.forward_passes += 1
        outcomes = []
        for b, ((session, proposal), row_logits) in enumerate(zip(items, logits)):
            outcome = session.accept(proposal, row_logits)
            if session.want_features and feats is not None:  # the pending token's and the accepted drafts' rows
                session.new_features = (session.cached, feats[b][: 1 + outcome.num_accepted])
            session.forward_passes += 1
            session.cached += 1 + outcome.num_accepted  # pending + accepted drafts stay; the rest is stale
            session.pending = outcome.tokens[-1]
            outcomes.append(outcome)
        return outcomes

    def close_session(self, session: TargetSession) -> None:
        with self._lock:
            if self.sessions.pop(session.session_id, None) is None:
                return
        if session.slot is not None:
            with self._model_lock:
                self.forward.pool.release(session.slot)
            session.slot = None
