"""The proposer interface every drafting method implements.

A *proposer* is the per-process object (it may hold a model, or a global suffix tree shared by
requests); a *draft session* is its per-request state. The engine asks a session for up to k
draft tokens, the verifier decides how many are accepted, and the session is told which tokens
were actually appended to the sequence so it can roll back whatever it guessed wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from specd.sampling import SamplingParams


@dataclass
class Proposal:
    """A block of draft tokens.

    tokens: the draft tokens, at most the k asked for (may be empty: nothing to propose).
    probs:  [len(tokens), vocab] float32, the draft distribution q each token was sampled from,
            after temperature/top-k/top-p; None when the proposer is deterministic (n-gram,
            suffix, greedy drafting), which the verifier treats as one-hot q.
    """

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class DraftSession(Protocol):
    """Per-request drafting state."""

    def propose(self, k: int) -> Proposal:
        """Draft up to k tokens continuing the sequence seen so far."""
        ...

    def append(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the sequence since the last call: the accepted draft tokens
        followed by the target's recovered or bonus token (or the first token after prefill)."""
        ...

    def propose_ahead(self, assumed: Sequence[int], k: int) -> Proposal:
        """Pipelined drafting: draft up to k tokens continuing the sequence followed by `assumed`
        (the block the target is verifying now, assumed accepted whole), without committing
        `assumed`. The next `append` says what really followed; the session keeps what agrees."""
        ...

    def close(self) -> None:
        """Free the session's state (caches); proposers with global state may learn from it."""
        ...


class Proposer(Protocol):
    """A drafting method, shared by all requests of a process."""

    name: str

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> DraftSession:
        """Start drafting for a request whose prompt is prompt_ids."""
        ...
