"""Prompt-lookup (n-gram) drafting.

The draft for the next k tokens is whatever followed the most recent earlier occurrence of the
sequence's last n tokens, trying the longest n first. It costs no model, needs no training and
wins big on inputs that repeat themselves (summaries, code edits, retrieval answers, chat that
quotes the prompt).

The search is vectorised with numpy: one comparison of the whole sequence against its last token
gives the candidate end positions, and each further pattern token filters only the surviving
candidates, so a step costs one O(L) pass plus O(max_n * matches).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from draft_service.proposers.base import Proposal
from specd.sampling import SamplingParams

_INITIAL_CAPACITY = 256
# the proposer's pattern lengths: 4 tokens down to 1 (the coordinator's shadow drafts draft with
# the same ones, to know at k = 0 the block this proposer would have sent: coordinator/echo.py)
DEFAULT_MIN_N = 1
DEFAULT_MAX_N = 4


def _check_ngram_range(min_n: int, max_n: int) -> None:
    if min_n < 1:
        raise ValueError(f"min_n must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"max_n must be >= min_n ({min_n}), got {max_n}")


def find_ngram_continuation(
    tokens: Sequence[int] | np.ndarray, k: int, min_n: int = 1, max_n: int = 4
) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix.

    For n from max_n down to min_n, the pattern is tokens[-n:]; an occurrence is any earlier
    window equal to it (it may overlap the trailing pattern, but the trailing pattern itself is
    not an occurrence) that is followed by at least one token. The largest n with an occurrence
    wins, the most recent occurrence of that n is used, and the tokens after it are returned,
    fewer than k when it lies near the end. No occurrence for any n, or k <= 0, gives [].
    """
    _check_ngram_range(min_n, max_n)
    if k <= 0:
        return []
    arr = np.asarray(tokens)
    length = arr.shape[0]
    if length < 2:
        return []
    # Candidate end positions e (index of an occurrence's last token) run over 0..length-2, so
    # that a continuation starting at e + 1 is never empty. The n = 1 pattern is the last token.
    body = arr[: length - 1]
    cand = np.flatnonzero(body == arr[length - 1])
    best: np.ndarray | None = cand if min_n <= 1 else None
    for t in range(1, min(max_n, length - 1)):
        if cand.size == 0:
            break
        # Extend the pattern to n = t + 1: the occurrence must start at e - t >= 0 and its token
        # there must equal the pattern's, tokens[length - 1 - t].
        cand = cand[cand >= t]
        cand = cand[arr[cand - t] == arr[length - 1 - t]]
        if cand.size and t + 1 >= min_n:
            best = cand
    if best is None or best.size == 0:
        return []
    start = int(best[-1]) + 1  # candidates are ascending: the last is the most recent
    return arr[start : start + k].tolist()


def replay_fixed_k(prompt: Sequence[int], output: Sequence[int], k: int) -> list[tuple[int, int]]:
    """(drafted, accepted) of every step after the prefill's token, had each step asked this
    proposer for k tokens while the target produced `output`: the proposer's block is a function of
    the context alone and a greedy output does not depend on the drafts, so the steps are known
    without running them. A block stops short where the match runs out (drafted 0 where the
    context holds none) and never reaches past the output's last token, as the engine's
    max_tokens limit would have it; accepted is its agreement with the output."""
    steps, produced = [], 1  # output[0] came from the prefill
    context = list(prompt) + list(output[:1])
    while produced < len(output):
        block = find_ngram_continuation(context, min(k, len(output) - produced - 1)) if k > 0 else []
        accepted = next((i for i, token in enumerate(block) if token != output[produced + i]), len(block))
        steps.append((len(block), accepted))
        context.extend(output[produced:produced + accepted + 1])
        produced += accepted + 1
    return steps


class NgramIndex:
    """`find_ngram_continuation` for a sequence that grows at its end, one dict lookup per pattern
    length instead of a pass over the sequence.

    For each pattern length n in 1..max_n it keeps the end position of the most recent
    occurrence of every n-gram that ends before the last token; the trailing n-grams are indexed
    when the next tokens arrive, so a lookup of the trailing pattern finds its most recent
    earlier occurrence, which is what `find_ngram_continuation` returns. Building it over a
    prompt is one C-level pass per n (`dict(zip(...))`, about 50 us for 700 tokens), each
    appended token adds max_n entries. The coordinator asks it at every k = 0 step of a session
    (coordinator/echo.py), where at 16 sessions a numpy pass over the context each time was a
    fifth of the controller's own work.
    """

    def __init__(self, tokens: Sequence[int], max_n: int = DEFAULT_MAX_N) -> None:
        _check_ngram_range(1, max_n)
        self.max_n = max_n
        self.tokens: list[int] = [int(t) for t in tokens]
        seq, ends = self.tokens, len(self.tokens) - 1  # n-grams ending at 0..ends-1 are indexed
        self._last: list[dict[tuple[int, ...], int]] = [
            dict(zip(zip(*(seq[j:ends] for j in range(n))), range(n - 1, ends))) for n in range(1, max_n + 1)]
        self._indexed = max(ends, 0)  # n-grams ending before this position are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)
        seq = self.tokens
        for end in range(self._indexed, len(seq) - 1):
            for n, last in enumerate(self._last, start=1):
                if end - n + 1 < 0:
                    break
                last[tuple(seq[end - n + 1:end + 1])] = end
        self._indexed = max(len(seq) - 1, self._indexed)

    def continuation(self, k: int, min_n: int = 1, max_n: int | None = None) -> list[int]:
        """`find_ngram_continuation(tokens, k, min_n, max_n)` (max_n at most the index's)."""
        max_n = self.max_n if max_n is None else max_n
        _check_ngram_range(min_n, max_n)
        if max_n > self.max_n:
            raise ValueError(f"max_n {max_n} is past the index's {self.max_n}")
        seq = self.tokens
        if k <= 0 or len(seq) < 2:
            return []
        for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
            end = self._last[n - 1].get(tuple(seq[len(seq) - n:]))
            if end is not None:
                return seq[end + 1:end + 1 + k]
        return []


class NgramSession:
    """One request's token history in a growable int64 buffer, drafted by prompt lookup."""

    def __init__(self, prompt_ids: Sequence[int], min_n: int, max_n: int) -> None:
        self._min_n = min_n
        self._max_n = max_n
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        self._buf = np.empty(max(_INITIAL_CAPACITY, 2 * prompt.shape[0]), dtype=np.int64)
        self._buf[: prompt.shape[0]] = prompt
        self._len = int(prompt.shape[0])

    @property
    def tokens(self) -> np.ndarray:
        """A read-only view of the sequence so far (prompt + appended tokens)."""
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view

    def __len__(self) -> int:
        return self._len

    def propose(self, k: int) -> Proposal:
        draft = find_ngram_continuation(self._buf[: self._len], k, self._min_n, self._max_n)
        return Proposal(tokens=draft, probs=None)

    def propose_ahead(self, assumed: Sequence[int], k: int) -> Proposal:
        context = np.concatenate([self._buf[: self._len], np.asarray(assumed, dtype=np.int64).reshape(-1)])
        return Proposal(tokens=find_ngram_continuation(context, k, self._min_n, self._max_n), probs=None)

    def append(self, tokens: Sequence[int]) -> None:
        new = np.asarray(tokens, dtype=np.int64).reshape(-1)
        needed = self._len + new.shape[0]
        if needed > self._buf.shape[0]:
            grown = np.empty(max(needed, 2 * self._buf.shape[0]), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : needed] = new
        self._len = needed

    def close(self) -> None:
        pass


class NgramProposer:
    """Prompt-lookup drafting; stateless across requests."""

    name = "ngram"

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        _check_ngram_range(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> NgramSession:
        return NgramSession(prompt_ids, self.min_n, self.max_n)
