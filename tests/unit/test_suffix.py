"""SuffixDecoding: SuffixTrie and SuffixProposer / SuffixSession."""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import Sequence

import pytest

from draft_service.proposers.suffix import SuffixProposer, SuffixTrie
from specd.sampling import SamplingParams

PARAMS = SamplingParams()


def _substring_counts(seqs: Sequence[Sequence[int]], max_depth: int) -> Counter:
    counts: Counter = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + max_depth) + 1):
                counts[tuple(seq[i:j])] += 1
    return counts


def _reference_match(seqs: Sequence[Sequence[int]], context: Sequence[int], max_match: int,
                     max_depth: int) -> tuple[int, Counter]:
    """Longest suffix of context followed by a token somewhere (within the depth cap), and the
    counts of the tokens that followed it."""
    for m in range(min(max_match, len(context), max_depth - 1), 0, -1):
        pattern = list(context[len(context) - m :])
        nxt: Counter = Counter()
        for seq in seqs:
            for i in range(len(seq) - m):
                if list(seq[i : i + m]) == pattern:
                    nxt[seq[i + m]] += 1
        if nxt:
            return m, nxt
    return 0, Counter()


def test_counts_are_right_after_extend() -> None:
    trie = SuffixTrie(max_depth=3)
    trie.extend([1, 2])
    trie.extend([1, 2, 1])
    assert trie.substrings() == {
        (1,): 3, (1, 2): 2, (1, 2, 1): 2,
        (2,): 2, (2, 1): 2, (2, 1, 2): 1,
    }
    assert trie.num_nodes == 6


@pytest.mark.parametrize("seed", range(3))
def test_counts_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    trie = SuffixTrie(max_depth=5)
    seq: list[int] = []
    while len(seq) < 60:  # extended in uneven chunks: active nodes carry across calls
        chunk = [rng.randrange(3) for _ in range(rng.randrange(1, 7))]
        seq += chunk
        trie.extend(chunk)
    other = [rng.randrange(3) for _ in range(20)]
    trie.add_sequence(other)
    expected = _substring_counts([seq, other], 5)
    assert trie.substrings() == dict(expected)
    assert trie.num_nodes == len(expected)


def test_remove_sequence_restores_empty_trie() -> None:
    trie = SuffixTrie(max_depth=4)
    seqs = [[1, 2, 1, 2, 1], [2, 2, 2], [1, 2, 3, 4, 5, 6], [1]]
    for s in seqs:
        trie.add_sequence(s)
    assert trie.num_nodes > 0
    for s in reversed(seqs[1:]):
        trie.remove_sequence(s)
    assert trie.substrings() == dict(_substring_counts(seqs[:1], 4))
    trie.remove_sequence(seqs[0])
    assert trie.substrings() == {}
    assert trie.num_nodes == 0


def test_freed_nodes_are_reused() -> None:
    trie = SuffixTrie(max_depth=4)
    seq = [1, 2, 3, 4, 5, 6]
    trie.add_sequence(seq)
    size = trie.num_nodes
    allocated = len(trie._counts)
    for _ in range(3):
        trie.remove_sequence(seq)
        trie.add_sequence(seq[::-1])
        trie.remove_sequence(seq[::-1])
        trie.add_sequence(seq)
    assert trie.num_nodes == size
    assert len(trie._counts) == allocated
    assert trie.substrings() == dict(_substring_counts([seq], 4))


def test_remove_one_of_two_leaves_the_other() -> None:
    a, b = [5, 6, 5, 6, 7], [6, 5, 6, 8]
    trie = SuffixTrie(max_depth=3)
    trie.add_sequence(a)
    trie.add_sequence(b)
    trie.remove_sequence(a)
    only_b = SuffixTrie(max_depth=3)
    only_b.add_sequence(b)
    assert trie.substrings() == only_b.substrings()
    assert trie.num_nodes == only_b.num_nodes


def test_remove_unknown_sequence_raises() -> None:
    trie = SuffixTrie(max_depth=3)
    trie.add_sequence([1, 2])
    with pytest.raises(ValueError):
        trie.remove_sequence([3])


def test_longest_match_preferred() -> None:
    trie = SuffixTrie(max_depth=8)
    trie.add_sequence([9, 1, 2, 3])
    for _ in range(3):
        trie.add_sequence([1, 2, 4])
    # "9 1 2" was followed by 3 once; "1 2" is followed by 4 three times out of four.
    assert trie.match_length([9, 1, 2], max_match=4) == 3
    assert trie.match_and_extend([9, 1, 2], 4, max_match=4, min_token_prob=0.1) == ([3], 1.0)
    # max_match caps the match: then only "1 2" is tried.
    assert trie.match_length([9, 1, 2], max_match=2) == 2
    assert trie.match_and_extend([9, 1, 2], 4, max_match=2, min_token_prob=0.1) == ([4], 0.75)
    assert trie.match_and_extend([8, 1, 2], 4, max_match=4, min_token_prob=0.1) == ([4], 0.75)


def test_match_without_children_is_skipped() -> None:
    trie = SuffixTrie(max_depth=8)
    trie.add_sequence([0, 9, 1, 2])  # "9 1 2" is indexed but nothing follows it
    trie.add_sequence([1, 2, 4])
    assert trie.match_length([9, 1, 2], max_match=4) == 2
    assert trie.match_and_extend([9, 1, 2], 4, max_match=4, min_token_prob=0.1) == ([4], 1.0)


def test_no_match() -> None:
    trie = SuffixTrie(max_depth=4)
    trie.add_sequence([1, 2, 3])
    assert trie.match_and_extend([7], 4, 4, 0.1) == ([], 0.0)
    assert trie.match_and_extend([3], 4, 4, 0.1) == ([], 0.0)  # only at the end: no child
    assert trie.match_and_extend([], 4, 4, 0.1) == ([], 0.0)
    assert trie.match_and_extend([1], 0, 4, 0.1) == ([], 0.0)
    assert trie.match_and_extend([1], 4, 4, 0.1) == ([2, 3], 2.0)  # two certain steps


def test_min_token_prob_stops_the_extension() -> None:
    trie = SuffixTrie(max_depth=24)
    trie.extend([1, 2, 3, 7, 1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2])
    ctx = [9, 1, 2]
    # After "1 2": 3 (x3) or 4 (x1) -> 3/4; after "1 2 3": 7 (x2) or 8 (x1) -> 2/3, path 1/2;
    # then "7 1 2 3" is certain; after "1 2 3 7 1 2 3": 7 or 8, once each -> path 1/4.
    # The score is the sum of the path probabilities (expected accepted tokens).
    assert trie.match_and_extend(ctx, 10, 12, 0.8) == ([], 0.0)
    assert trie.match_and_extend(ctx, 10, 12, 0.6) == ([3], 0.75)
    tokens, score = trie.match_and_extend(ctx, 10, 12, 0.4)
    assert (tokens, score) == ([3, 7, 1, 2, 3], pytest.approx(0.75 + 4 * 0.5))
    tokens, score = trie.match_and_extend(ctx, 2, 12, 0.4)  # k stops it first
    assert (tokens, score) == ([3, 7], pytest.approx(0.75 + 0.5))
    tokens, score = trie.match_and_extend(ctx, 10, 12, 0.2)
    assert tokens[:5] == [3, 7, 1, 2, 3] and tokens[5] in (7, 8)
    assert score == pytest.approx(0.75 + 4 * 0.5 + 0.25 * (len(tokens) - 5))  # the rest is certain


@pytest.mark.parametrize("seed", range(4))
def test_match_length_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        alphabet = rng.randrange(2, 5)
        max_depth = rng.randrange(2, 7)
        max_match = rng.randrange(1, 8)
        seqs = [[rng.randrange(alphabet) for _ in range(rng.randrange(1, 25))]
                for _ in range(rng.randrange(1, 4))]
        trie = SuffixTrie(max_depth)
        for s in seqs:
            trie.add_sequence(s)
        for _ in range(5):
            context = [rng.randrange(alphabet + 1) for _ in range(rng.randrange(0, 10))]
            m, nxt = _reference_match(seqs, context, max_match, max_depth)
            assert trie.match_length(context, max_match) == m, (seqs, context)
            tokens, score = trie.match_and_extend(context, 1, max_match, 0.0)
            if m == 0:
                assert (tokens, score) == ([], 0.0)
            else:
                best = max(nxt.values())
                assert nxt[tokens[0]] == best
                assert score == pytest.approx(best / sum(nxt.values()))


def test_proposer_local_draft_from_prompt() -> None:
    proposer = SuffixProposer()
    assert proposer.name == "suffix"
    session = proposer.open_session([5, 6, 7, 8, 9, 5, 6], PARAMS)
    proposal = session.propose(3)
    assert proposal.tokens == [7, 8, 9]
    assert proposal.probs is None
    session.append([7, 8, 9, 1])
    assert session.propose(3).tokens == []  # "9 1" / "1" never seen before
    assert session.generated == [7, 8, 9, 1]


def test_global_tree_learns_from_closed_session() -> None:
    proposer = SuffixProposer(global_max_sequences=8)
    first = proposer.open_session([100, 101], PARAMS)
    first.append([1, 2, 3, 4, 5, 6])
    probe = proposer.open_session([50, 60], PARAMS)
    probe.append([1, 2])
    assert probe.propose(4).tokens == []  # not learnt before the first session closes
    first.close()
    first.close()  # idempotent: counted once
    assert proposer.global_sequences == 1
    second = proposer.open_session([50, 60], PARAMS)
    second.append([1, 2])
    assert second.propose(4).tokens == [3, 4, 5, 6]
    # Only generated tokens are remembered, not the first session's prompt.
    third = proposer.open_session([100], PARAMS)
    assert third.propose(4).tokens == []


def test_global_preferred_only_when_better() -> None:
    proposer = SuffixProposer(max_depth=3, max_match=2)
    for _ in range(3):
        s = proposer.open_session([0], PARAMS)
        s.append([1, 2, 3])
        s.close()
    # Local "1 2" -> 4 or 5 (score 1/2) loses to global "1 2" -> 3 (score 1).
    assert proposer.open_session([1, 2, 4, 1, 2, 5, 1, 2], PARAMS).propose(4).tokens == [3]
    # Local "1 2" -> 4 (score 1, one token under the depth cap) ties global: local wins.
    assert proposer.open_session([1, 2, 4, 1, 2], PARAMS).propose(4).tokens == [4]


def test_eviction_keeps_global_bounded() -> None:
    proposer = SuffixProposer(max_depth=4, global_max_sequences=3)
    outputs = [[10 * i + j for j in range(5)] for i in range(1, 6)]
    for out in outputs:
        s = proposer.open_session([0], PARAMS)
        s.append(out)
        s.close()
        assert proposer.global_sequences <= 3
    assert proposer.global_sequences == 3
    expected = SuffixTrie(4)
    for out in outputs[-3:]:
        expected.add_sequence(out)
    assert proposer.global_trie.substrings() == expected.substrings()
    probe = proposer.open_session([10], PARAMS)  # evicted output
    assert probe.propose(2).tokens == []
    probe = proposer.open_session([50], PARAMS)  # kept output
    assert probe.propose(2).tokens == [51, 52]


def test_global_disabled() -> None:
    proposer = SuffixProposer(global_max_sequences=0)
    s = proposer.open_session([0], PARAMS)
    s.append([1, 2, 3])
    s.close()
    assert proposer.global_sequences == 0
    assert proposer.global_trie.num_nodes == 0


def test_concurrent_sessions_keep_global_consistent() -> None:
    proposer = SuffixProposer(max_depth=4, global_max_sequences=5)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(10):
            s = proposer.open_session([rng.randrange(4) for _ in range(8)], PARAMS)
            for _ in range(6):
                s.propose(3)
                s.append([rng.randrange(4)])
            s.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert proposer.global_sequences == 5
    held = list(proposer._global_seqs)
    assert proposer.global_trie.substrings() == dict(_substring_counts(held, 4))
