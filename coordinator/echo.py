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
and no verify positions, so the disabled path still costs the replicas nothing.
"""

from __future__ import annotations

from typing import Sequence

from draft_service.proposers.ngram import find_ngram_continuation

# proposers that draft by looking up the context: n-gram, suffix, and the head, which copies from
# its context where the context repeats (draft_service/proposers/copying.py; same 3-token match)
ECHO_METHODS = frozenset({"ngram", "suffix", "head"})
ECHO_MIN_N = 3  # shorter matches recur by chance in any text (one- and two-token patterns)
ECHO_MAX_N = 4


def echo_guess(context: Sequence[int]) -> int | None:
    """The token that followed the most recent earlier occurrence of the context's last 3-4
    tokens, or None when they did not occur before."""
    found = find_ngram_continuation(context, 1, min_n=ECHO_MIN_N, max_n=ECHO_MAX_N)
    return found[0] if found else None


def echo_hit(guess: int | None, produced: Sequence[int]) -> bool:
    """Whether the guess was the token the target produced next (no guess is no hit)."""
    return guess is not None and bool(produced) and produced[0] == guess
