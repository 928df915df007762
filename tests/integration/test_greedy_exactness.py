"""Greedy speculation must reproduce transformers' target-only generate(do_sample=False) id for id:
the engine verifies with the target as the service runs it (`served_target`, oneDNN linear
layers), the references are transformers' stock generation (`references`)."""

from __future__ import annotations

import pytest

from coordinator.depth import DepthPolicy
from coordinator.engine import SpeculativeEngine
from draft_service.proposers import make_proposer
from specd.sampling import SamplingParams
from target_service.verifier import TargetModel
from tests.conftest import EXACTNESS_MAX_TOKENS, one_prompt_per_kind

pytestmark = pytest.mark.slow

# The method whose acceptance depends most on the prompt (how much of it the answer repeats) runs
# every workload prompt at the default depth; the stack runs every prompt with each copying draft
# as well (tests/e2e/test_stack.py). The target as its own draft accepts every block and the tiny
# random draft almost none, on any prompt.
FULL_SWEEP = ("ngram",)


def _draft_for(method_label: str, target, tiny_draft):
    """(method, draft model) for a test label; `target` is the model the engine verifies with."""
    if method_label == "draft_model_target":
        return "draft_model", target
    if method_label == "draft_model_tiny":
        return "draft_model", tiny_draft
    return method_label, None


# Within CI's time budget: n-gram drafts at the depths that bound a block (1 and 8) and the
# default (4), suffix drafts at 4 and 8 (a block of one goes through the same step whatever
# proposed it); the target as its own draft, whose blocks all go through, at 8 (and under auto
# depth below); the tiny random draft, whose blocks almost all fail at their first token whatever
# the depth, at 4.
DEPTHS = [("ngram", k) for k in (1, 4, 8)] + [("suffix", k) for k in (4, 8)] + \
    [("draft_model_target", 8), ("draft_model_tiny", 4)]


@pytest.mark.parametrize("method_label,k", DEPTHS)
def test_speculative_greedy_equals_target_only(method_label, k, served_target, references, tiny_shared_vocab_draft,
                                               workload_prompts):
    """N-gram drafts at k = 4 on every workload prompt; the other cases on one prompt of each kind
    (a different one per depth), which keeps the sweep's code paths covered within CI's time
    budget."""
    every_prompt = k == 4 and method_label in FULL_SWEEP
    prompts = workload_prompts if every_prompt else one_prompt_per_kind(workload_prompts, rotate=k)
    method, draft = _draft_for(method_label, served_target, tiny_shared_vocab_draft)
    engine = SpeculativeEngine(TargetModel(served_target), make_proposer(method, draft), k=k,
                               eos_token_ids=served_target.eos_token_ids)
    drafted = 0
    for p in prompts:
        ids, expected = references[p.id]
        gen = engine.generate(ids, SamplingParams(max_tokens=min(p.max_tokens, EXACTNESS_MAX_TOKENS))).run()
        assert gen.token_ids == expected, f"{method_label} k={k} differs from target-only on {p.id}"
        assert gen.stats.target_forward_passes <= len(expected)
        drafted += gen.stats.num_draft_tokens
    assert drafted > 0, "the proposer never drafted: the test exercised nothing"


@pytest.mark.parametrize("method_label", ["ngram", "suffix", "draft_model_target", "draft_model_tiny"])
def test_auto_depth_with_pipelined_drafting_equals_target_only(method_label, served_target, references,
                                                               tiny_shared_vocab_draft, workload_prompts):
    """The adaptive controller picks k per step and the next block is drafted during each verify,
    on one prompt of each kind (the stack runs every prompt this way: tests/e2e/test_stack.py)."""
    method, draft = _draft_for(method_label, served_target, tiny_shared_vocab_draft)
    engine = SpeculativeEngine(TargetModel(served_target), make_proposer(method, draft), k=8,
                               eos_token_ids=served_target.eos_token_ids,
                               depth=DepthPolicy("auto", 8), pipeline=True)
    prompts = one_prompt_per_kind(workload_prompts, rotate=1)
    drafted = used = 0
    for p in prompts:
        ids, expected = references[p.id]
        gen = engine.generate(ids, SamplingParams(max_tokens=min(p.max_tokens, EXACTNESS_MAX_TOKENS))).run()
        assert gen.token_ids == expected, f"{method_label} auto+pipeline differs from target-only on {p.id}"
        drafted += gen.stats.num_draft_tokens
        used += gen.stats.pipeline_hits
    assert drafted > 0, "the proposer never drafted: the test exercised nothing"
    if method_label == "draft_model_target":  # the target as its own draft: every block accepted, bonus guessed
        assert used > 0, "no pre-drafted block was ever used"


def test_no_speculation_equals_target_only(served_target, references, workload_prompts):
    """Plain decoding through the engine, one prompt of each kind (every prompt is decoded with
    speculation by the tests above)."""
    engine = SpeculativeEngine(TargetModel(served_target), None, eos_token_ids=served_target.eos_token_ids)
    for p in one_prompt_per_kind(workload_prompts, rotate=0):
        ids, expected = references[p.id]
        gen = engine.generate(ids, SamplingParams(max_tokens=min(p.max_tokens, EXACTNESS_MAX_TOKENS))).run()
        assert gen.token_ids == expected, p.id
        assert gen.stats.target_forward_passes == len(expected)  # one pass per token, prefill included
