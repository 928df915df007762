"""Pipelined drafting: `propose_ahead` drafts as if the block under verification were accepted,
and whatever the target then appends, the session ends up exactly where a session that was never
pipelined would be."""

from __future__ import annotations

import random

import pytest
import torch

from coordinator.engine import use_predrafted
from draft_service.proposers import make_proposer
from draft_service.proposers.base import Proposal
from specd.models import load_model, save_tiny_random_model
from specd.sampling import SamplingParams

VOCAB = 12
GREEDY = SamplingParams(max_tokens=64)


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return load_model(str(save_tiny_random_model(tmp_path_factory.mktemp("draft"), vocab_size=VOCAB, seed=3)))


def _proposer(method: str, tiny_lm):
    return make_proposer(method, tiny_lm if method == "draft_model" else None)


def test_use_predrafted_keeps_the_block_only_after_a_full_accept_and_a_matching_bonus() -> None:
    block = Proposal([7, 8, 9], torch.eye(3))
    kept = use_predrafted(True, 7, block)
    assert kept is not None and kept.tokens == [8, 9] and torch.equal(kept.probs, torch.eye(3)[1:])
    assert use_predrafted(True, 5, block) is None  # the target's bonus token differs from the guess
    assert use_predrafted(False, 7, block) is None  # a rejection inside the verified block
    assert use_predrafted(True, 7, Proposal()) is None
    assert use_predrafted(True, 7, Proposal([7])).tokens == []


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_propose_ahead_equals_proposing_after_the_assumed_tokens(method: str, tiny_lm) -> None:
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    proposer = _proposer(method, tiny_lm)
    piped = proposer.open_session(prompt, GREEDY)
    block = piped.propose(3)
    assumed = block.tokens or [3]
    ahead = piped.propose_ahead(assumed, 4)
    fresh = proposer.open_session(prompt + assumed, GREEDY)
    assert ahead.tokens == fresh.propose(4).tokens


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_any_outcome_leaves_the_session_like_an_unpipelined_one(method: str, tiny_lm) -> None:
    """Random outcomes (full accepts with matching and other bonus tokens, rejections at every
    position): after each, the pipelined session proposes what a plain session proposes."""
    rng = random.Random(0)
    proposer = _proposer(method, tiny_lm)
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    piped, plain = proposer.open_session(prompt, GREEDY), proposer.open_session(prompt, GREEDY)
    sequence = list(prompt)
    for _ in range(12):
        block = piped.propose(4)
        assert block.tokens == plain.propose(4).tokens
        assumed = block.tokens or [rng.randrange(VOCAB)]
        ahead = piped.propose_ahead(assumed, 5)
        accepted = rng.choice([len(block.tokens), len(block.tokens), rng.randrange(len(block.tokens) + 1)])
        if accepted == len(block.tokens) and ahead.tokens and rng.random() < 0.5:
            bonus = ahead.tokens[0]  # the pipeline's lucky case
        else:
            bonus = rng.randrange(VOCAB)
        appended = block.tokens[:accepted] + [bonus]
        piped.append(appended)
        plain.append(appended)
        sequence += appended
    assert piped.propose(4).tokens == plain.propose(4).tokens == proposer.open_session(sequence, GREEDY).propose(4).tokens
