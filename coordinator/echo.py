"""Echo: whether the target is repeating its own context, seen for free while speculation is off.

A session at k = 0 drafts nothing, so it learns nothing about acceptance until its next probe,
and a gated session probes only every `probe_interval` steps. But for the methods that draft
from the context (n-gram, suffix, the head's copies), whether a draft would have been accepted
can be read without drafting: look up what followed the last few tokens earlier in the context
(the same prompt lookup the n-gram proposer does) and compare it with the token the target then
produced. Two hits in a row mean the output has started copying (a code edit reaching the
unchanged code, an answer quoting its source), which is when a probe pays; a miss or no match
says nothing new.

The lookup is one numpy pass over the context per k = 0 step, in the coordinator: no draft call
and no verify positions, so the disabled path still costs the replicas nothing. `EchoLookup` keeps
the context as an array that grows with the output, so a step does not convert the whole context
(a list of 700 tokens took 18 us a step, the array 3: at 16 sessions the coordinator's work
between one pass and the next is serialized by its interpreter lock).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from draft_service.proposers.ngram import find_ngram_continuation

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
    """One request's context for `echo_guess`, as an int64 array grown in place."""

    def __init__(self, tokens: Sequence[int]):
        self._buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self._n = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        end = self._n + len(tokens)
        if end > self._buf.shape[0]:
            grown = np.empty(2 * end, dtype=np.int64)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n:end] = tokens
        self._n = end

    def guess(self) -> int | None:
        """`echo_guess` of the context so far."""
        return echo_guess(self._buf[: self._n])
