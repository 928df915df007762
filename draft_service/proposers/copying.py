"""Copy where the context repeats itself, draft with a model elsewhere.

A trained head guesses the next tokens from the target's features; prompt lookup copies what
followed the last occurrence of the context's last few tokens. Each wins on its own ground: on
the bundled target through the stack at concurrency 1 the head ran chat at 1.18x and code at 1.46x
transformers against n-gram's 1.08x and 0.96x, and n-gram ran code edits at 2.20x, extraction at
1.54x and summaries at 1.76x against the head's 1.30x, 1.06x and 1.05x (docs/benchmarks.md).

`CopyingSession` wraps a model's session. Where the context's last COPY_MIN_N tokens occurred
before, it has a copy to offer; it proposes the copy when copies have been at least as accurate
as the model's drafts in this request so far, else the model's block. Both are scored against
what the target really emitted: the source it used every step, and the copy also on steps where
the model drafted (a copy's tokens against the tokens that followed). Drafts only propose, so
which source drafts never changes the output; a copy is deterministic, which the verifier takes
as one-hot q under sampling, as it does for n-gram drafts.
"""

from __future__ import annotations

from typing import Any, Sequence

from draft_service.proposers.base import DraftSession, Proposal
from draft_service.proposers.ngram import NgramSession

# A copy needs the context's last 3 tokens to have occurred before: a one- or two-token match is
# common in any text and says little about what follows.
COPY_MIN_N = 3
COPY_MAX_N = 8


def score_block(proposed: Sequence[int], truth: Sequence[int]) -> tuple[int, int]:
    """(accepted, tried) for a drafted block against the tokens that really followed: positions
    are tried in order until the first miss, and only as far as the truth reaches."""
    reach = min(len(proposed), len(truth))
    matched = 0
    while matched < reach and proposed[matched] == truth[matched]:
        matched += 1
    return matched, matched + 1 if matched < reach else matched


class SourceRate:
    """A source's per-token accuracy in one request: decayed (accepted, tried) counts over a
    prior of `prior_weight` trials at `prior`, so the first steps do not decide alone."""

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, window: float = 32.0):
        self.accepted = prior * prior_weight
        self.tried = prior_weight
        self.decay = 1.0 - 1.0 / window

    def add(self, accepted: int, tried: int) -> None:
        if tried <= 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.tried = self.tried * self.decay + tried

    @property
    def rate(self) -> float:
        return self.accepted / self.tried


class CopyingSession:
    """A model's draft session with prompt-lookup copies where they have been the better guess."""

    def __init__(self, inner: DraftSession, prompt_ids: Sequence[int]):
        self.inner = inner
        self.lookup = NgramSession(prompt_ids, COPY_MIN_N, COPY_MAX_N)  # the context, and the copy it offers
        self.copy_rate = SourceRate()
        self.model_rate = SourceRate()
        self.copies = 0  # blocks proposed by copying, for tests and logs
        # the last propose(): (the block proposed, copied?, the copy offered when the model drafted)
        self._last: tuple[list[int], bool, list[int]] | None = None

    def add_features(self, start: int, rows: Any) -> None:
        add = getattr(self.inner, "add_features", None)
        if add is not None:
            add(start, rows)

    def append(self, tokens: Sequence[int]) -> None:
        new = [int(t) for t in tokens]
        if self._last is not None:
            block, copied, offered = self._last
            (self.copy_rate if copied else self.model_rate).add(*score_block(block, new))
            if offered:
                self.copy_rate.add(*score_block(offered, new))
            self._last = None
        self.lookup.append(new)
        self.inner.append(new)

    def propose(self, k: int) -> Proposal:
        copy = self.lookup.propose(k).tokens if k > 0 else []
        if copy and self.copy_rate.rate >= self.model_rate.rate:
            self.copies += 1
            self._last = (copy, True, [])
            return Proposal(copy, None)
        proposal = self.inner.propose(k)
        self._last = (list(proposal.tokens), False, copy)
        return proposal

    def propose_ahead(self, assumed: Sequence[int], k: int) -> Proposal:
        """Pipelined: the same choice on the context followed by `assumed`; not scored (the next
        append says what followed the context, not the assumed block)."""
        copy = self.lookup.propose_ahead(assumed, k).tokens if k > 0 else []
        self._last = None
        if copy and self.copy_rate.rate >= self.model_rate.rate:
            return Proposal(copy, None)
        return self.inner.propose_ahead(assumed, k)

    def close(self) -> None:
        self.inner.close()
