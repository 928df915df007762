"""Drafting with a smaller causal LM that shares the target's tokenizer.

The draft session keeps its own KV cache. `propose(k)` runs k single-token steps (the first one
also feeds whatever context the cache has not seen yet). When the verifier answers, `append`
keeps the cached prefix that the sequence still agrees with and drops the rest, so a rejected
block costs nothing but the cache rows it wrote.

Greedy requests draft greedily (no q is sent: the verifier's one-hot rule applies). Sampled
requests draft by sampling from q, the draft's distribution after the request's temperature,
top-k and top-p, and return q so that the verifier can accept with min(1, p/q).
"""

from __future__ import annotations

from typing import Sequence

import torch

from draft_service.proposers.base import Proposal
from specd.kv import cache_length, crop_cache, forward, new_cache
from specd.logits import logits_to_probs, sample
from specd.models import LoadedModel
from specd.sampling import SamplingParams
from target_service.verifier import make_generator

_DRAFT_SEED_OFFSET = 0x5EED  # the draft's random stream must differ from the target's


class DraftModelSession:
    def __init__(self, draft: LoadedModel, prompt_ids: Sequence[int], params: SamplingParams):
        self.draft = draft
        self.params = params
        self.cache = new_cache(draft.model)
        self.uncached: list[int] = list(prompt_ids)  # sequence tokens the cache has not seen
        self.speculated: list[int] = []  # draft tokens written to the cache beyond the sequence
        self.last_token = int(prompt_ids[-1]) if len(prompt_ids) else 0  # the sequence's last token
        self.generator = make_generator(params.seed, draft.device, _DRAFT_SEED_OFFSET)

    def _sequence_length(self) -> int:
        return cache_length(self.cache) - len(self.speculated) + len(self.uncached)

    def _drop_speculated(self) -> None:
        if self.speculated:
            crop_cache(self.cache, cache_length(self.cache) - len(self.speculated))
            self.speculated = []

    def propose(self, k: int) -> Proposal:
        room = self.draft.max_context - self._sequence_length()
        k = min(k, room)
        if k <= 0:
            return Proposal()
        self._drop_speculated()
        if not self.uncached:  # the whole sequence is cached (kept speculation): re-feed its last token for logits
            crop_cache(self.cache, cache_length(self.cache) - 1)
            self.uncached = [self.last_token]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        feed = self.uncached
        for _ in range(k):
            logits = forward(self.draft.model, feed, self.cache, keep_last=1)
            token, q = self._choose(logits)
            tokens.append(token)
            if q is not None:
                rows.append(q)
            feed = [token]
        self.uncached = []
        self.speculated = tokens[:-1]  # the last draft token was never fed
        probs = torch.cat(rows) if rows else None
        return Proposal(tokens=tokens, probs=probs)

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        p = self.params
        if p.is_greedy:
            return int(logits[-1].argmax()), None
        q = logits_to_probs(logits[-1:], p.temperature, p.top_k, p.top_p)
        return int(sample(q, self.generator)[0]), q

    def propose_ahead(self, assumed: Sequence[int], k: int) -> Proposal:
        """Commit `assumed` for the moment, draft, then mark `assumed` as speculated again: the
        cache keeps its rows, and the next `append` keeps exactly the part the target agreed with."""
        assumed = list(assumed)
        if min(k, self.draft.max_context - self._sequence_length() - len(assumed)) <= 0:
            return Proposal()
        self.append(assumed)
        proposal = self.propose(k)
        self.speculated = assumed + self.speculated
        return proposal

    def append(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        if not tokens:
            return
        self.last_token = tokens[-1]
        if self.uncached:  # nothing speculated is in the cache's tail: the tokens just queue up
            self._drop_speculated()
            self.uncached.extend(tokens)
            return
        agree = 0
        while agree < len(self.speculated) and agree < len(tokens) and self.speculated[agree] == tokens[agree]:
            agree += 1
        if agree == len(tokens):  # all of it already cached: the rest of the speculation stays
            self.speculated = self.speculated[agree:]
            return
        crop_cache(self.cache, cache_length(self.cache) - len(self.speculated) + agree)
        self.speculated = []
        self.uncached.extend(tokens[agree:])

    def close(self) -> None:
        self.cache = None  # type: ignore[assignment]


class DraftModelProposer:
    """Proposes with a draft LM; any transformers causal LM sharing the target's vocabulary."""

    name = "draft_model"

    def __init__(self, draft: LoadedModel):
        self.draft = draft

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> DraftModelSession:
        return DraftModelSession(self.draft, prompt_ids, params)
