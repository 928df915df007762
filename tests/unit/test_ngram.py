"""Prompt-lookup drafting: find_ngram_continuation, NgramSession and NgramIndex."""

from __future__ import annotations

import random

import numpy as np
import pytest

from draft_service.proposers.ngram import NgramIndex, NgramProposer, find_ngram_continuation
from specd.sampling import SamplingParams


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: the same contract, spelled out with Python loops."""
    if k <= 0:
        return []
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > L - 1:
            continue
        pattern = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):  # most recent first; start + n <= L - 1
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + k]
    return []


def test_longest_ngram_wins() -> None:
    # "9 2" (n=1 on 2) was followed by 7 most recently, but the 3-gram "1 9 2" -> 5 is longer.
    tokens = [1, 9, 2, 5, 6, 8, 9, 2, 7, 3, 1, 9, 2]
    assert find_ngram_continuation(tokens, 2, max_n=1) == [7, 3]
    assert find_ngram_continuation(tokens, 2, max_n=4) == [5, 6]


def test_most_recent_occurrence_preferred() -> None:
    tokens = [4, 5, 10, 4, 5, 20, 4, 5, 30, 0, 4, 5]
    assert find_ngram_continuation(tokens, 1) == [30]
    assert find_ngram_continuation(tokens, 3) == [30, 0, 4]


def test_no_match_returns_empty() -> None:
    assert find_ngram_continuation([1, 2, 3, 4, 5], 4) == []
    assert find_ngram_continuation([], 4) == []
    assert find_ngram_continuation([7], 4) == []
    # A 1-gram match exists, but min_n=2 rules it out.
    assert find_ngram_continuation([3, 1, 2, 3], 4, min_n=2) == []
    assert find_ngram_continuation([3, 1, 2, 3], 4, min_n=1) == [1, 2, 3]


def test_continuation_truncated_at_end() -> None:
    # The most recent occurrence of "1 2" overlaps the tail; only 2 tokens follow it.
    tokens = [1, 2, 1, 2, 1, 2]
    assert find_ngram_continuation(tokens, 5) == [1, 2]
    assert find_ngram_continuation([8, 5, 8], 5) == [5, 8]


def test_occurrence_with_empty_continuation_is_not_the_tail() -> None:
    # With a run of one token, n=4 occurrences must end before the last token.
    assert find_ngram_continuation([6] * 5, 3) == [6]
    assert find_ngram_continuation([6] * 4, 3, min_n=4) == []


def test_k_zero() -> None:
    assert find_ngram_continuation([1, 2, 1], 0) == []
    assert find_ngram_continuation([1, 2, 1], -3) == []


def test_invalid_ngram_range() -> None:
    with pytest.raises(ValueError):
        find_ngram_continuation([1, 2], 1, min_n=0)
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_accepts_numpy_and_returns_python_ints() -> None:
    out = find_ngram_continuation(np.array([5, 6, 7, 5], dtype=np.int32), 2)
    assert out == [6, 7]
    assert all(type(t) is int for t in out)


@pytest.mark.parametrize("seed", range(5))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        k = rng.randrange(0, 6)
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        assert find_ngram_continuation(tokens, k, min_n, max_n) == _reference(
            tokens, k, min_n, max_n
        ), (tokens, k, min_n, max_n)


def test_session_append_and_propose() -> None:
    proposer = NgramProposer()
    assert proposer.name == "ngram"
    session = proposer.open_session([10, 11, 12, 13], SamplingParams())
    assert session.propose(3).tokens == []
    session.append([10])
    assert session.propose(3).tokens == [11, 12, 13]
    session.append([11, 12])
    proposal = session.propose(3)
    assert proposal.tokens == [13, 10, 11]
    assert proposal.probs is None
    assert len(proposal) == 3
    session.close()


def test_session_buffer_grows() -> None:
    session = NgramProposer().open_session([], SamplingParams())
    assert session.propose(2).tokens == []
    pattern = list(range(100))
    for _ in range(8):  # 800 tokens, well past the initial capacity, in chunks
        session.append(pattern)
    assert len(session) == 800
    assert session.tokens.tolist() == pattern * 8
    session.append([0, 1])
    assert session.propose(4).tokens == [2, 3, 4, 5]


@pytest.mark.parametrize("vocab", [2, 3, 5])
def test_the_index_finds_what_the_scan_finds_as_the_sequence_grows(vocab):
    """NgramIndex against find_ngram_continuation on random sequences over small vocabularies
    (many repeats), built on a prompt of every length 0..12 and grown one token and several at a time."""
    rng = random.Random(vocab)
    for prompt_len in range(13):
        seq = [rng.randrange(vocab) for _ in range(prompt_len)]
        index = NgramIndex(seq)
        for _ in range(25):
            grow = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 3]))]
            seq += grow
            index.extend(grow)
            assert index.tokens == seq
            for k, min_n, max_n in [(1, 3, 4), (5, 1, 4), (2, 2, 3), (3, 1, 1), (0, 1, 4)]:
                assert index.continuation(k, min_n, max_n) == find_ngram_continuation(seq, k, min_n, max_n), \
                    (seq, k, min_n, max_n)


def test_the_index_refuses_patterns_longer_than_it_keeps():
    with pytest.raises(ValueError, match="max_n 5"):
        NgramIndex([1, 2, 3], max_n=4).continuation(1, 1, 5)
