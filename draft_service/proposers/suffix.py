"""SuffixDecoding: model-free drafting from suffix trees (Oliaro et al. 2024, "SuffixDecoding:
A Model-Free Approach to Speeding Up Large Language Model Inference"; Snowflake ArcticInference).

Two tries of token substrings are consulted at every step:

* a per-request trie over the request's own prompt and everything generated so far, which
  catches the model quoting or repeating its input (like prompt lookup, but with frequencies);
* a global trie over the generated tokens of recently finished requests, which catches the
  repetitive structure of agentic / templated workloads (the same tool-call JSON, the same
  boilerplate answer) across requests.

Each trie holds every substring of its sequences up to ``max_depth`` tokens, with the number of
occurrences at each node. To draft, the longest suffix of the current context (at most
``max_match`` tokens) that occurs in a trie *and was followed by something* is located, and the
draft greedily follows the most frequent child from there. Each step's empirical probability,
child.count / sum(sibling counts), is multiplied into a running score; the extension stops after
k tokens, at a leaf, or before the token that would push the running product below
``min_token_prob``. A draft's score is the sum of its running products, its expected number of
accepted tokens; the draft with the higher score of the two tries is proposed.

Parameters (SuffixProposer):

max_depth=24
    Longest substring indexed, which bounds match length plus draft length. Memory and the
    per-token insertion cost are O(max_depth) nodes per token in pure Python (~0.25 KB a
    node): at 24 a 2000-token prompt makes ~48k nodes (~12 MB, ~15-40 ms to index), at 64
    ~126k nodes (~32 MB, ~40-100 ms) for little gain in drafts. ArcticInference's vLLM
    integration defaults to a depth of 24 as well.
max_match=12
    Longest context suffix tried. Past ~10 tokens a match is about as specific as it gets,
    and keeping it at half of max_depth leaves >= 12 tokens of room for the draft after a
    maximal match (a match of m tokens can only be extended by max_depth - m).
min_token_prob=0.1
    Stop drafting once the draft's estimated probability of being accepted in full falls
    below this (ArcticInference's default); cheap drafts still cost verification compute.
global_max_sequences=256
    Finished requests remembered in the global trie, oldest evicted first. Bounds its memory
    at roughly global_max_sequences * output length * max_depth nodes.

Differences from ArcticInference's implementation: it stores a path-compressed suffix tree
(O(length) nodes, in C++), tries every match length and keeps
the best-scoring draft instead of the longest match, and divides by the parent's count rather
than the sum of the children's (which also counts occurrences at the end of a sequence).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Sequence

from draft_service.proposers.base import Proposal
from specd.sampling import SamplingParams


class SuffixTrie:
    """All substrings (up to max_depth tokens) of the indexed sequences, with occurrence counts.

    A node's count is the number of positions where its substring occurs, summed over the
    indexed sequences; substrings never span two sequences. ``extend`` grows one running
    sequence (a request's prompt + output), ``add_sequence``/``remove_sequence`` insert and
    retract whole independent sequences (the global tree's finished requests).

    Nodes are integer ids into two parallel lists (children: token -> child id, and count)
    rather than one object per node. Dicts that hold only ints are not tracked by Python's
    cyclic garbage collector, so a trie of a million nodes adds almost nothing to every full
    collection of the server process; with node objects, collections over the tries took ~85%
    of the time to index a 2000-token prompt, and would stall every thread of the process as
    the global trie grows. Ids of pruned nodes are recycled.
    """

    ROOT = 0

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._children: list[dict[int, int]] = [{}]
        self._counts: list[int] = [0]
        self._free: list[int] = []
        # Nodes of the running sequence's suffixes of length 1..max_depth-1 ending at its last
        # token, shortest first: the ones the next appended token extends.
        self._active: list[int] = []

    @property
    def num_nodes(self) -> int:
        """Nodes in the trie, the root excluded: the number of distinct indexed substrings."""
        return len(self._counts) - 1 - len(self._free)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the running sequence, in O(max_depth) per token."""
        self._active = self._insert(tokens, self._active)

    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Index tokens as a sequence of its own (no substring crosses into the running one)."""
        self._insert(tokens, [])

    def _insert(self, tokens: Sequence[int], active: list[int]) -> list[int]:
        children, counts, free = self._children, self._counts, self._free
        keep = self.max_depth - 1  # a node at max_depth cannot be extended further
        for tok in tokens:
            tok = int(tok)
            moved: list[int] = []
            for node in (self.ROOT, *active):
                kids = children[node]
                child = kids.get(tok)
                if child is None:
                    if free:
                        child = free.pop()
                        children[child] = {}
                    else:
                        child = len(counts)
                        children.append({})
                        counts.append(0)
                    kids[tok] = child
                counts[child] += 1
                moved.append(child)
            active = moved[:keep]
        return active

    def remove_sequence(self, tokens: Sequence[int]) -> None:
        """Retract a sequence earlier indexed with add_sequence, pruning nodes whose count
        drops to zero. Raises ValueError on a substring that isn't indexed, which means the
        sequence was never added (the trie may then be partly decremented)."""
        children, counts, free = self._children, self._counts, self._free
        keep = self.max_depth - 1
        active: list[int] = []
        for tok in tokens:
            tok = int(tok)
            moved: list[int] = []
            for node in (self.ROOT, *active):
                child = children[node].get(tok)
                if child is None:
                    raise ValueError("remove_sequence: sequence was not indexed in this trie")
                counts[child] -= 1
                if counts[child] == 0:
                    # Every remaining occurrence of its substring was in this sequence, and so
                    # are its descendants': the rest of this replay reaches them through the
                    # detached id kept in `active`, and frees them (emptying its dict) in turn.
                    # Nothing allocates during the replay, so the freed id can't be reused yet.
                    del children[node][tok]
                    free.append(child)
                moved.append(child)
            active = moved[:keep]

    def substrings(self) -> dict[tuple[int, ...], int]:
        """Every indexed substring with its count (for tests and debugging; O(size))."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[int, tuple[int, ...]]] = [(self.ROOT, ())]
        while stack:
            node, path = stack.pop()
            for tok, child in self._children[node].items():
                out[path + (tok,)] = self._counts[child]
                stack.append((child, path + (tok,)))
        return out

    def _find_match(self, context: Sequence[int], max_match: int) -> tuple[int, int]:
        """The node of the longest suffix of context (<= max_match tokens) that is indexed and
        has at least one child, and its length; (-1, 0) when there is none."""
        children = self._children
        n = len(context)
        longest = min(max_match, n, self.max_depth - 1)  # depth max_depth nodes have no children
        for m in range(longest, 0, -1):
            node = self.ROOT
            for i in range(n - m, n):
                node = children[node].get(int(context[i]), -1)
                if node < 0:
                    break
            # An absent suffix of length m rules out the longer ones, not the shorter ones (nor
            # does a present one without children), so keep going down either way.
            if node >= 0 and children[node]:
                return node, m
        return -1, 0

    def match_length(self, context: Sequence[int], max_match: int) -> int:
        """Length of the match match_and_extend would draft from (0: none)."""
        return self._find_match(context, max_match)[1]

    def match_and_extend(
        self, context: Sequence[int], k: int, max_match: int, min_token_prob: float
    ) -> tuple[list[int], float]:
        """Draft up to k tokens after the longest useful suffix match of context.

        Each step's probability child.count / sum(sibling counts) is multiplied into a running
        path probability (the estimated chance that the draft so far is accepted in full); the
        extension stops before the path probability falls below min_token_prob. Returns
        (tokens, score), where score is the sum of the path probabilities: the expected number of
        accepted tokens, as ArcticInference scores drafts. An empty draft scores 0.0.
        """
        if k <= 0:
            return [], 0.0
        node, _ = self._find_match(context, max_match)
        if node < 0:
            return [], 0.0
        children, counts = self._children, self._counts
        draft: list[int] = []
        path_prob = 1.0
        expected_accepted = 0.0
        while len(draft) < k and children[node]:
            total = 0
            best_tok = best = best_count = -1
            for tok, child in children[node].items():
                c = counts[child]
                total += c
                if c > best_count:
                    best_tok, best, best_count = tok, child, c
            p = path_prob * best_count / total
            if p < min_token_prob:
                break
            path_prob = p
            expected_accepted += p
            draft.append(best_tok)
            node = best
        return draft, expected_accepted


class SuffixSession:
    """One request: its own trie over prompt + output, plus read access to the global trie."""

    def __init__(self, proposer: SuffixProposer, prompt_ids: Sequence[int]) -> None:
        self._proposer = proposer
        self._trie = SuffixTrie(proposer.max_depth)
        self._tokens: list[int] = [int(t) for t in prompt_ids]
        self._prompt_len = len(self._tokens)
        self._trie.extend(self._tokens)
        self._closed = False

    @property
    def generated(self) -> list[int]:
        """Tokens appended after the prompt."""
        return self._tokens[self._prompt_len :]

    def propose(self, k: int) -> Proposal:
        return self._propose(self._tokens[-self._proposer.max_match :], k)

    def propose_ahead(self, assumed: Sequence[int], k: int) -> Proposal:
        """Matches on the sequence plus `assumed`; the trie itself only ever holds committed tokens."""
        return self._propose((self._tokens + [int(t) for t in assumed])[-self._proposer.max_match :], k)

    def _propose(self, context: list[int], k: int) -> Proposal:
        p = self._proposer
        # Only the last max_match tokens can take part in a match.
        local, local_score = self._trie.match_and_extend(
            context, k, p.max_match, p.min_token_prob
        )
        glob, glob_score = p.global_match(context, k)
        if (glob_score, len(glob)) > (local_score, len(local)):
            return Proposal(tokens=glob, probs=None)
        return Proposal(tokens=local, probs=None)

    def append(self, tokens: Sequence[int]) -> None:
        new = [int(t) for t in tokens]
        self._tokens.extend(new)
        self._trie.extend(new)

    def close(self) -> None:
        """Hand the output to the global trie (once) and drop the per-request trie."""
        if self._closed:
            return
        self._closed = True
        self._proposer.remember(self.generated)
        self._trie = SuffixTrie(1)


class SuffixProposer:
    """SuffixDecoding drafting, with a bounded global trie of finished requests' outputs.

    Safe to use from several threads: the global trie is guarded by a lock (sessions themselves
    are single-threaded, like every DraftSession).
    """

    name = "suffix"

    def __init__(
        self,
        max_depth: int = 24,
        max_match: int = 12,
        min_token_prob: float = 0.1,
        global_max_sequences: int = 256,
    ) -> None:
        if max_match < 1:
            raise ValueError(f"max_match must be >= 1, got {max_match}")
        if global_max_sequences < 0:
            raise ValueError(f"global_max_sequences must be >= 0, got {global_max_sequences}")
        self.max_depth = max_depth
        self.max_match = max_match
        self.min_token_prob = min_token_prob
        self.global_max_sequences = global_max_sequences
        self._global = SuffixTrie(max_depth)
        self._global_seqs: deque[tuple[int, ...]] = deque()
        self._lock = threading.Lock()

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> SuffixSession:
        return SuffixSession(self, prompt_ids)

    @property
    def global_sequences(self) -> int:
        """How many finished outputs the global trie holds."""
        with self._lock:
            return len(self._global_seqs)

    @property
    def global_trie(self) -> SuffixTrie:
        """The global trie (for inspection; mutate only through remember)."""
        return self._global

    def global_match(self, context: Sequence[int], k: int) -> tuple[list[int], float]:
        """match_and_extend on the global trie, under the lock."""
        with self._lock:
            return self._global.match_and_extend(context, k, self.max_match, self.min_token_prob)

    def remember(self, tokens: Sequence[int]) -> None:
        """Add a finished request's output to the global trie, evicting the oldest beyond
        global_max_sequences."""
        seq = tuple(int(t) for t in tokens)
        if not seq or self.global_max_sequences == 0:
            return
        with self._lock:
            self._global.add_sequence(seq)
            self._global_seqs.append(seq)
            while len(self._global_seqs) > self.global_max_sequences:
                self._global.remove_sequence(self._global_seqs.popleft())
