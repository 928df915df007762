"""Echo: whether the target is repeating its own context, seen for free while speculation is off.

A session at k = 0 drafts nothing, so it learns nothing about acceptance until its next probe,
and a gated session probes only every `probe_interval` steps. But for the methods that draft
from the context (n-gram, suffix, the head's copies), whether a draft would have been accepted
can be read without drafting: look up what followed the last few tokens earlier in the context
(the same prompt lookup the n-gram proposer does) and compare it with the token the target then
produced. Two hits in a row mean the output has started copying (a code edit reaching the
unchanged code, an answer quoting its source), which is when a probe pays; a miss or no match
says nothing new.

For the n-gram proposer the lookup knows more than a guess: the proposer's draft is a function
of the context alone, so the block it would send is known at a k = 0 step without asking it, and
the output of the following steps judges that block exactly as the target would have
(`ShadowDraft`). A session at k = 0 thus keeps learning its acceptance at every position, for
free: a code edit whose output reaches the unchanged code sees its shadows accepted whole and
leaves k = 0 on its own evidence, without the probes that at 16 sessions lengthen every
row's pass (held code-edit cells at 16 sessions after completions: auto's time in verify passes
went from 1.29x fixed k = 4's to 1.02x; docs/benchmarks.md, "Shadow drafts").

The lookups run in the coordinator at every k = 0 step: no draft call and no verify positions,
so the disabled path still costs the replicas nothing. `EchoLookup` keeps the context in an
`NgramIndex` (draft_service/proposers/ngram.py), so a step's guess and shadow draft are a few
dict lookups, not a numpy pass over the context each (together about 40 us a step at 300
tokens): at 16 sessions the coordinator's work shares the two cores with the target's pass.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from draft_service.proposers.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramIndex, find_ngram_continuation

# proposers that draft by looking up the context: n-gram, suffix, and the head, which copies from
# its context where the context repeats (draft_service/proposers/copying.py; same 3-token match)
ECHO_METHODS = frozenset({"ngram", "suffix", "head"})
ECHO_MIN_N = 3  # shorter matches recur by chance in any text (one- and two-token patterns)
ECHO_MAX_N = 4


def echo_guess(context: Sequence[int] | np.ndarray) -> int | None:
    """The token that followed the most recent earlier occurrence of the context's last 3-4
    tokens, or None when they did not occur before."""
    found = find_ngram_continuation(context, 1, min_n=ECHO_MIN_N, max_n=ECHO_MAX_N)
    return found[0] if found else None


def echo_hit(guess: int | None, produced: Sequence[int]) -> bool:
    """Whether the guess was the token the target produced next (no guess is no hit)."""
    return guess is not None and bool(produced) and produced[0] == guess


class EchoLookup:
    """One request's context for `echo_guess` and the n-gram proposer's draft, kept in an
    `NgramIndex`: each step's lookups are dict lookups, not a pass over the context."""

    def __init__(self, tokens: Sequence[int]):
        self._context = NgramIndex(tokens, max(DEFAULT_MAX_N, ECHO_MAX_N))

    def extend(self, tokens: Sequence[int]) -> None:
        self._context.extend(tokens)

    def guess(self) -> int | None:
        """`echo_guess` of the context so far."""
        found = self._context.continuation(1, ECHO_MIN_N, ECHO_MAX_N)
        return found[0] if found else None

    def ngram_draft(self, k: int) -> list[int]:
        """The n-gram proposer's draft of k tokens (its default pattern lengths) from the context
        so far: what it would send if asked now."""
        return self._context.continuation(k, DEFAULT_MIN_N, DEFAULT_MAX_N)


class ShadowDraft:
    """A draft made at a k = 0 step and never sent, judged against the target's output as the
    following steps produce it: a free trial of every position it drafted.

    The n-gram proposer's draft is a function of the context alone, and the target's output is
    the same whatever was drafted (exactness), so the block it would have drafted is accepted
    exactly as far as it agrees with the tokens that then come: position 0 with the next token,
    position 1 with the one after, up to the first disagreement. One shadow at a time, started
    at a k = 0 step and judged to its end even when the session drafts for real meanwhile: the
    session's block is as deep as it asks, the shadow as deep as it could go next
    (`DepthController.shadow_depth`), and the shadow's verdict on the deeper positions is what
    lets it ask deeper. Dropped at the first real draft, a code edit's shadow of 8 that had
    matched its first tokens gave way to an echo probe of 2, after which the session priced
    positions 2 and on at the method's caps (0.18 after completions) and drafted 1-2 tokens a
    step at 16 sessions, where fixed k = 4 ran 1.15x faster.

    In a batch a drafting step starts one too when the session could draft deeper than it does
    (`DepthController.shadow_depth_beyond`): its block judges the positions it drafts, the shadow
    the ones past them. Without that a session at k = 1 never learnt about position 1 again: a
    code edit whose answer opened with prose (its k = 0 shadows failing at position 1) drafted one
    token a step for the rest of its answer, whatever the answer did after."""

    def __init__(self) -> None:
        self._draft: list[int] = []
        self._matched = 0
        self._reported = 0  # positions already told (or covered by the block beside it)

    @property
    def pending(self) -> bool:
        return bool(self._draft)

    def start(self, draft: Sequence[int], covered: int = 0) -> None:
        """Shadow `draft` from the step about to run. `covered`: the positions that step's own
        block drafts (0 at a k = 0 step), which the step itself judges: they are never news."""
        self._draft, self._matched, self._reported = list(draft), 0, max(int(covered), 0)

    def drop(self) -> None:
        self._draft, self._matched, self._reported = [], 0, 0

    def feed(self, produced: Sequence[int]) -> tuple[int, int, int] | None:
        """Judge the draft's next positions against tokens the target produced, in order, and
        return what is new as (drafted, accepted, first): positions `first` and on of a block of
        `drafted` with its first `accepted` accepted, as `AcceptanceEstimator.add` takes it;
        None when nothing new is known (no shadow, or only covered positions judged).

        Each position is news as soon as its token comes: a matched one is an accepted trial
        then (drafted = accepted = the positions matched so far), not when the shadow ends. A
        copying session's shadow of 8 that kept matching used to say nothing for 8 steps, all at
        k = 0, a quarter of a 32-token request. The shadow is done at its first disagreement or
        when every position agreed."""
        if not self._draft:
            return None
        decided = False
        for token in produced:
            if token != self._draft[self._matched]:
                decided = True
                break
            self._matched += 1
            if self._matched == len(self._draft):
                decided = True
                break
        matched, first = self._matched, self._reported
        drafted = len(self._draft) if decided else matched
        judged = min(matched + 1, drafted)  # the matched positions, and the one that missed
        self._reported = max(first, judged)
        if decided:
            self.drop()
        return (drafted, matched, first) if judged > first else None
