"""Drafting with an EAGLE-style head (draft_service/head/) on the target's own features.

The session keeps the sequence's tokens, the target's features as they arrive (one per position
the target has kept: all but the newest token), and the head's KV cache over the *true* pairs
(f_i, x_{i+1}), those whose feature came from the target. A proposal

    1. runs the true pairs the cache has not seen, in one pass: the last one predicts the
       feature of the newest token;
    2. walks any tokens the target has not given features for yet (a pipelined step's assumed
       block) with the head's own predicted features;
    3. drafts k tokens, each from the LM head (draft vocabulary) on the predicted feature, and
       feeds (predicted feature, token) back in.

Only step 1 stays in the cache; the rest is cropped, so a rejected block costs nothing later.
Greedy requests draft the argmax; sampled ones sample from q (the request's temperature, top-k
and top-p over the draft vocabulary, zero elsewhere) and send q for exact rejection sampling.
"""

from __future__ import annotations

from typing import Sequence

import torch

from draft_service.head.checkpoint import LoadedHead
from draft_service.head.model import KVCache
from draft_service.proposers.base import Proposal
from draft_service.proposers.copying import CopyingSession
from specd.features import FeatureLog
from specd.logits import logits_to_probs, sample
from specd.sampling import SamplingParams
from target_service.verifier import make_generator

_DRAFT_SEED_OFFSET = 0x5EED


class HeadSession:
    def __init__(self, loaded: LoadedHead, max_context: int, prompt_ids: Sequence[int], params: SamplingParams):
        self.loaded = loaded
        self.max_context = max_context
        self.params = params
        self.tokens: list[int] = list(prompt_ids)
        self.features = FeatureLog()
        self.cache = KVCache()
        self.true_pairs = 0  # pairs (f_i, x_{i+1}) in the cache, i < true_pairs
        self.true_prediction: torch.Tensor | None = None  # the last true pair's output: f^ of position true_pairs
        self.generator = make_generator(params.seed, torch.device("cpu"), _DRAFT_SEED_OFFSET)

    def add_features(self, start: int, rows: torch.Tensor) -> None:
        if start == 0:  # a new prefill (also after a failover): the cache was built on the old features
            self.cache, self.true_pairs, self.true_prediction = KVCache(), 0, None
        self.features.add(start, rows)

    def append(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def propose(self, k: int) -> Proposal:
        return self._draft(self.tokens, k)

    def propose_ahead(self, assumed: Sequence[int], k: int) -> Proposal:
        return self._draft(self.tokens + [int(t) for t in assumed], k)

    def close(self) -> None:
        self.cache = KVCache()

    def _run(self, features: torch.Tensor, tokens: Sequence[int], start: int, cache: KVCache) -> torch.Tensor:
        """Head outputs [len(tokens), hidden] for pairs (features[j], tokens[j]) at positions start + j."""
        embeds = self.loaded.embed[torch.tensor(tokens, dtype=torch.long)]
        positions = torch.arange(start, start + len(tokens))
        return self.loaded.head(embeds[None], features[None], positions, cache)[0]

    @torch.inference_mode()
    def _draft(self, tokens: list[int], k: int) -> Proposal:
        n = len(tokens)
        k = min(k, self.max_context - n)
        known = min(self.features.length, n - 1)  # true pairs available: i < known
        if k <= 0 or known <= 0:
            return Proposal()
        if known > self.true_pairs:  # 1. the true pairs the cache has not seen
            out = self._run(self.features.rows(self.true_pairs, known), tokens[self.true_pairs + 1: known + 1],
                            self.true_pairs, self.cache)
            self.true_pairs, self.true_prediction = known, out[-1:]
        elif known < self.true_pairs:  # the sequence got shorter than the cache (cannot happen in order): rebuild
            self.cache, self.true_pairs, self.true_prediction = KVCache(), 0, None
            return self._draft(tokens, k)
        predicted = self.true_prediction
        assert predicted is not None
        cached = self.cache.length
        try:
            for i in range(known, n - 1):  # 2. tokens without target features yet: the head's own
                predicted = self._run(predicted, [tokens[i + 1]], i, self.cache)
            drafts: list[int] = []
            rows: list[torch.Tensor] = []
            for j in range(k):  # 3. drafting
                token, q = self._choose(predicted)
                drafts.append(token)
                if q is not None:
                    rows.append(q)
                if j + 1 < k:
                    predicted = self._run(predicted, [token], n - 1 + j, self.cache)
        finally:
            self.cache.crop(cached)
        return Proposal(drafts, torch.cat(rows) if rows else None)

    def _choose(self, feature: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        logits = self.loaded.lm_head(feature)  # [1, draft vocab]
        vocab = self.loaded.draft_vocab
        p = self.params
        if p.is_greedy:
            return int(vocab[int(logits[0].argmax())]), None
        full = torch.full((1, self.loaded.vocab_size), float("-inf"))
        full[0, vocab] = logits[0]
        q = logits_to_probs(full, p.temperature, p.top_k, p.top_p)
        return int(sample(q, self.generator)[0]), q


class HeadProposer:
    """Proposes with a trained head; sessions need the target's features (`needs_features`).

    With `copies` (the default) a session copies from its context where that has been the better
    guess (draft_service/proposers/copying.py): the head is weakest where text repeats itself."""

    name = "head"
    needs_features = True

    def __init__(self, loaded: LoadedHead, max_context: int, copies: bool = True):
        self.loaded = loaded
        self.max_context = max_context
        self.copies = copies

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> HeadSession | CopyingSession:
        session = HeadSession(self.loaded, self.max_context, prompt_ids, params)
        return CopyingSession(session, prompt_ids) if self.copies else session
