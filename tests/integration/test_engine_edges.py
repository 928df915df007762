"""Edges of the decoding loop: block vs. tokens left, EOS inside a block, max_tokens, empty drafts, long prompts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from coordinator.controller import DepthController
from coordinator.depth import EMBEDDED, DepthPolicy
from coordinator.echo import ShadowDraft
from coordinator.engine import SpeculativeEngine
from draft_service.proposers import Proposal, make_proposer
from draft_service.proposers.ngram import find_ngram_continuation, replay_fixed_k
from specd.errors import InvalidArgument, PromptTooLong
from specd.models import load_model, save_tiny_random_model
from specd.sampling import SamplingParams
from target_service.verifier import TargetModel
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny_random_model(tmp_path_factory.mktemp("tiny"), vocab_size=32, seed=3, max_position_embeddings=64)))


def reference(model, ids: list[int], n: int) -> list[int]:
    return hf_greedy(model, ids, n, exact_length=True)


def self_draft_engine(model, k: int) -> SpeculativeEngine:
    """Drafting with the target itself: every draft token is accepted, the deepest blocks possible."""
    return SpeculativeEngine(TargetModel(model), make_proposer("draft_model", model), k=k, eos_token_ids=model.eos_token_ids)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_block_longer_than_tokens_left_stops_at_exactly_max_tokens(tiny, max_tokens):
    prompt = [5, 6, 7, 8]
    gen = self_draft_engine(tiny, k=8).generate(prompt, SamplingParams(max_tokens=max_tokens)).run()
    assert gen.token_ids == reference(tiny, prompt, max_tokens)
    assert gen.finish_reason == "length"
    assert gen.stats.num_draft_tokens <= max(0, max_tokens - 1)  # never drafts past what can be emitted


def test_self_draft_accepts_everything(tiny):
    gen = self_draft_engine(tiny, k=4).generate([1, 2, 3], SamplingParams(max_tokens=21)).run()
    assert gen.stats.num_accepted_tokens == gen.stats.num_draft_tokens == 16
    assert gen.stats.target_forward_passes == 1 + 4  # prefill + 4 blocks of 4 drafts + bonus
    assert gen.stats.mean_acceptance_length == 5.0


def test_eos_inside_an_accepted_block_ends_the_output_there(tiny):
    prompt = [9, 10, 11]
    ref = reference(tiny, prompt, 12)
    eos = ref[5]  # declare the 6th greedy token an end-of-sequence token
    first = ref.index(eos)
    engine = SpeculativeEngine(TargetModel(tiny), make_proposer("draft_model", tiny), k=8, eos_token_ids=frozenset({eos}))
    gen = engine.generate(prompt, SamplingParams(max_tokens=12)).run()
    assert gen.token_ids == ref[: first + 1]
    assert gen.finish_reason == "stop"
    ignoring = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True)).run()
    assert ignoring.token_ids == ref and ignoring.finish_reason == "length"


def test_stop_token_ids_end_generation(tiny):
    prompt = [9, 10, 11]
    ref = reference(tiny, prompt, 10)
    gen = self_draft_engine(tiny, k=4).generate(prompt, SamplingParams(max_tokens=10, stop_token_ids=(ref[3],))).run()
    assert gen.token_ids == ref[: ref.index(ref[3]) + 1] and gen.finish_reason == "stop"


def test_ngram_without_a_match_decodes_plainly(tiny):
    prompt = [20, 21, 22, 23, 24, 25, 26, 27]
    ref = reference(tiny, prompt, 2)
    engine = SpeculativeEngine(TargetModel(tiny), make_proposer("ngram"), k=4)
    gen = engine.generate(prompt, SamplingParams(max_tokens=2)).run()
    assert gen.token_ids == ref
    if ref[0] not in prompt:  # nothing to look up after the first token: an empty proposal
        assert gen.stats.num_drafts == 0 and gen.stats.target_forward_passes == 2


class EmptyProposer:
    name = "empty"

    def open_session(self, prompt_ids, params):
        return self

    def propose(self, k):
        return Proposal()

    def append(self, tokens):
        pass

    def close(self):
        pass


def test_a_proposer_with_nothing_to_say_costs_no_drafts(tiny):
    engine = SpeculativeEngine(TargetModel(tiny), EmptyProposer(), k=4)
    gen = engine.generate([3, 4], SamplingParams(max_tokens=6)).run()
    assert gen.token_ids == reference(tiny, [3, 4], 6)
    assert gen.stats.num_drafts == 0 and gen.stats.target_forward_passes == 6


def test_generation_stops_at_the_context_end(tiny):
    prompt = list(range(30)) * 2  # 60 of the 64 positions
    gen = self_draft_engine(tiny, k=8).generate(prompt, SamplingParams(max_tokens=50)).run()
    assert len(prompt) + len(gen.token_ids) == tiny.max_context
    assert gen.finish_reason == "length"
    assert gen.token_ids == reference(tiny, prompt, tiny.max_context - len(prompt))


def test_prompt_over_the_context_is_a_clear_error(tiny):
    engine = SpeculativeEngine(TargetModel(tiny), make_proposer("ngram"), k=4)
    with pytest.raises(PromptTooLong, match="context holds 64"):
        engine.generate(list(range(32)) * 2, SamplingParams(max_tokens=4))
    # The engine keeps serving after the error.
    assert len(engine.generate([1, 2], SamplingParams(max_tokens=2)).run().token_ids) == 2


@pytest.mark.parametrize("params,field", [
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(temperature=-1.0), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_k=-1), "top_k"),
])
def test_bad_sampling_parameters_name_the_field(tiny, params, field):
    engine = SpeculativeEngine(TargetModel(tiny), None)
    with pytest.raises(InvalidArgument) as err:
        engine.generate([1, 2], params)
    assert err.value.field == field


def test_empty_prompt_and_out_of_vocabulary_ids_are_rejected(tiny):
    engine = SpeculativeEngine(TargetModel(tiny), None)
    with pytest.raises(InvalidArgument, match="prompt"):
        engine.generate([], SamplingParams())
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        engine.generate([1, 999], SamplingParams())


@pytest.mark.slow
def test_cli_reports_a_prompt_over_the_context(tmp_path):
    long_prompt = "word " * 9000
    proc = subprocess.run([sys.executable, "-m", "specd.cli", "generate", long_prompt, "--max-tokens", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "context holds 8192" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_json_output(target):
    proc = subprocess.run([sys.executable, "-m", "specd.cli", "generate", "What is the capital of France? Answer in one sentence.",
                           "--chat", "--max-tokens", "24", "--method", "ngram", "--k", "4", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"]
    assert out["finish_reason"] in ("stop", "length")
    ids = target.encode("What is the capital of France? Answer in one sentence.", chat=True)
    x = torch.tensor([ids])
    with torch.inference_mode():
        ref = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24, pad_token_id=2)
    assert out["token_ids"] == ref[0, len(ids):].tolist()
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_acceptance_length", "target_forward_passes"):
        assert key in out["stats"]


class _HeldOffListening(DepthController):
    """An auto controller held at k = 0 that records the shadow drafts the engine judges, and
    the (drafted, depth) of every shadow it starts."""

    def __init__(self) -> None:
        super().__init__(8, mode="auto")
        self.shadows: list[tuple[int, int, int]] = []
        self.started: list[tuple[int, int]] = []

    def observe_shadow_fill(self, drafted: int, depth: int) -> None:
        self.started.append((drafted, depth))
        super().observe_shadow_fill(drafted, depth)

    def choose(self, load=None, remaining=None) -> int:
        self.history.append(0)
        return 0

    def observe(self, *args, shadow=None, **kwargs) -> None:
        if shadow is not None:
            self.shadows.append(shadow)
        super().observe(*args, shadow=shadow, **kwargs)


class _OneController:
    def __init__(self, controller: DepthController) -> None:
        self._controller = controller

    def controller(self, target, method: str) -> DepthController:
        return self._controller

    def load(self, session) -> None:
        return None


def test_k_0_steps_judge_the_n_gram_shadow_drafts_as_the_target_would_have(tiny):
    """At k = 0 the engine judges the block the n-gram proposer would have drafted against the
    output that follows: replayed over the output, every shadow it judges is the proposer's draft
    at the step it started, fed each token as it comes (the news `ShadowDraft.feed` gives, judged
    as the target would have: accepted up to its first disagreement); and every k = 0 step
    without a pending shadow tells the controller how much of its depth the lookup drafted (none
    where the context has no match), which is what its fill learns from."""
    controller = _HeldOffListening()
    engine = SpeculativeEngine(TargetModel(tiny), make_proposer("ngram"), depth=_OneController(controller),
                               eos_token_ids=frozenset())
    prompt = [3, 9, 4, 3, 9, 4, 3, 9]
    out = engine.generate(prompt, SamplingParams(max_tokens=40)).run().token_ids
    assert out == reference(tiny, prompt, 40)
    expected, started, shadow = [], [], ShadowDraft()
    for t in range(1, len(out)):  # step t produces out[t] from the context before it
        if not shadow.pending:
            draft = find_ngram_continuation(prompt + out[:t], controller.k_max)
            started.append((len(draft), controller.k_max))
            shadow.start(draft)
        news = shadow.feed([out[t]])
        if news is not None:
            expected.append(news)
    assert controller.shadows == expected
    assert controller.started == started
    assert any(accepted > 0 for _, accepted, _ in expected), expected  # the output copies: hits were judged


class _DraftsOnceListening(_HeldOffListening):
    """Held at k = 0 but for one step (0-based among the steps after the prefill) at k = 1; records
    (k, accepted, shadow verdict) of every step."""

    def __init__(self, draft_at: int) -> None:
        super().__init__()
        self.draft_at = draft_at
        self.steps: list[tuple[int, int, tuple[int, int, int] | None]] = []

    def choose(self, load=None, remaining=None) -> int:
        k = 1 if len(self.history) == self.draft_at else 0
        self.history.append(k)
        return k

    def observe(self, k, num_accepted, *args, shadow=None, **kwargs) -> None:
        self.steps.append((k, num_accepted, shadow))
        super().observe(k, num_accepted, *args, shadow=shadow, **kwargs)


def test_a_shadow_started_at_k_0_is_judged_to_its_end_while_the_session_drafts(tiny):
    """A shadow pending when the session drafts for real (an echo probe) is still judged on the
    output that follows, and what each step judges reaches the controller at that step: its
    deeper positions are what a shallow real block cannot try. Replayed step by step: shadows
    start at k = 0 steps with none pending, on the context before the step, and every step's
    tokens feed the pending one, drafted or not."""
    prompt = [3, 9, 4, 3, 9, 4, 3, 9]
    out = reference(tiny, prompt, 40)
    # held at k = 0, the first shadow that goes through its first position and is two or more
    # long starts at step t (producing out[t]) and is still pending at step t + 1: draft there
    t = next(t for t in range(1, len(out) - 1) if len(draft := find_ngram_continuation(prompt + out[:t], 8)) >= 2
             and draft[0] == out[t] and draft[1] == out[t + 1])
    controller = _DraftsOnceListening(draft_at=t)  # steps are counted from 1, history from 0
    engine = SpeculativeEngine(TargetModel(tiny), make_proposer("ngram"), depth=_OneController(controller),
                               eos_token_ids=frozenset())
    assert engine.generate(prompt, SamplingParams(max_tokens=40)).run().token_ids == out
    expected, shadow, produced = [], ShadowDraft(), 1  # out[0] came from the prefill
    for k, accepted, _ in controller.steps:
        if k == 0 and not shadow.pending:
            shadow.start(find_ngram_continuation(prompt + out[:produced], controller.k_max))
        tokens = out[produced:produced + accepted + 1]
        produced += len(tokens)
        expected.append(shadow.feed(tokens))
    assert controller.steps[t][0] == 1  # it drafted at step t + 1
    assert [shadow for _, _, shadow in controller.steps] == expected


class _DraftsOneAsInABatch(_HeldOffListening):
    """Drafts one token at every step and shadows past its block as a session in a batch does
    (`shadow_depth_beyond`, here at every step: the engine alone has no batch); records (k,
    accepted, shadow verdict) of every step."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, int, tuple[int, int, int] | None]] = []

    def choose(self, load=None, remaining=None) -> int:
        self.history.append(1)
        return 1

    def shadow_depth_beyond(self, drafted: int) -> int:
        return self.k_max if drafted > 0 else 0

    def observe(self, k, num_accepted, *args, shadow=None, **kwargs) -> None:
        self.steps.append((k, num_accepted, shadow))
        super().observe(k, num_accepted, *args, shadow=shadow, **kwargs)


def test_in_a_batch_a_drafting_step_shadows_the_positions_past_its_block(tiny):
    """A session drafting one token a step, as in a batch, also shadows the n-gram proposer's
    deeper block: started at a drafting step with none pending, on the context before it, and
    judged on the tokens that follow, with the block's own positions marked as covered (its
    step judges those). Replayed step by step; steps whose lookup found nothing shadow as at
    k = 0 (`shadow_depth`, nothing covered)."""
    prompt = [3, 9, 4, 3, 9, 4, 3, 9]
    out = reference(tiny, prompt, 40)
    controller = _DraftsOneAsInABatch()
    engine = SpeculativeEngine(TargetModel(tiny), make_proposer("ngram"), depth=_OneController(controller),
                               eos_token_ids=frozenset())
    assert engine.generate(prompt, SamplingParams(max_tokens=40)).run().token_ids == out
    expected, shadow, produced, past_block = [], ShadowDraft(), 1, []  # out[0] came from the prefill
    for k, accepted, _ in controller.steps:
        if not shadow.pending:
            deeper = find_ngram_continuation(prompt + out[:produced], controller.k_max)
            beside = k > 0 and len(deeper) > k  # kept while this shadow is pending
            if k == 0:  # the proposer found no match: a k = 0 step's shadow
                shadow.start(deeper)
            elif beside:
                shadow.start(deeper, covered=k)
        tokens = out[produced:produced + accepted + 1]
        produced += len(tokens)
        expected.append(shadow.feed(tokens))
        if beside and expected[-1] is not None:
            past_block.append(expected[-1])
    assert [shadow for _, _, shadow in controller.steps] == expected
    assert any(accepted > first for _, accepted, first in past_block), past_block  # accepted past the block


def test_a_fixed_k_teaches_its_replicas_cost_model_what_its_passes_cost(tiny):
    """A fixed k has no controller, yet its drafted passes are what auto sessions on the same
    replica need to price a depth (at 16 sessions they may draft nothing themselves): its steps
    record their draft and verify times in the cost model that the replica's sessions share."""
    policy = DepthPolicy("auto", k_max=8)
    engine = SpeculativeEngine(TargetModel(tiny), make_proposer("draft_model", tiny), k=4,
                               eos_token_ids=frozenset(), cost_models=policy)
    engine.generate([1, 2, 3], SamplingParams(max_tokens=21)).run()  # prefill + 4 blocks of 4 drafts
    shared = policy.costs.get(EMBEDDED, "draft_model")
    assert [(b, block, count) for b, block, count, _, _ in shared.verify_table()] == [(1, 5, 4)]
    assert [(k, count) for k, count, _ in shared.draft_table()] == [(4, 4)]
    untaught = SpeculativeEngine(TargetModel(tiny), make_proposer("draft_model", tiny), k=4, eos_token_ids=frozenset())
    untaught.generate([1, 2, 3], SamplingParams(max_tokens=21)).run()
    assert [count for _, _, count, _, _ in shared.verify_table()] == [4]  # without cost_models nothing is recorded


def test_a_fixed_k_reports_its_acceptance_to_the_methods_record(tiny):
    """A fixed k's sessions join the record of acceptance that new auto sessions of the same
    method on the replica start from (`SessionRecord`): with the target as its own draft every
    block goes through, so after four such sessions the record's recent sessions accept every
    token, fill every block, and a new auto session is seeded from them."""
    policy = DepthPolicy("auto", k_max=8)
    fixed = SpeculativeEngine(TargetModel(tiny), make_proposer("draft_model", tiny), k=4,
                              eos_token_ids=frozenset(), cost_models=policy)
    shared = policy.costs.acceptance(EMBEDDED, "draft_model")
    fresh_seed = shared.seed
    for start in range(4):
        fixed.generate([1 + start, 2, 3], SamplingParams(max_tokens=21)).run()
    recent = shared.recent_sessions()
    assert recent is not None and len(recent) == 4
    assert all(alpha > 0.9 and fill == pytest.approx(1.0) for alpha, fill in recent), recent
    assert shared.seed > fresh_seed
    assert policy.controller(fixed.verifier.open_session([1, 2, 3], SamplingParams()), "draft_model") \
        .estimator.alpha == pytest.approx(shared.seed, abs=0.05)


class _AlwaysTwo(_HeldOffListening):
    """An auto controller that asks for a block of 2 at every step."""

    def choose(self, load=None, remaining=None) -> int:
        self.history.append(2)
        return 2


def test_an_auto_n_gram_session_asks_the_draft_only_where_its_context_holds_a_match(tiny):
    """The coordinator's lookup knows whether the n-gram proposer would draft anything: a step
    whose context has no match for it makes no draft call (it would come back empty), and the
    others call it as before. Replayed over the output: the calls are exactly the steps whose
    context had a match, the output is the target's own, and the controller is told it is gated."""
    calls: list[int] = []
    proposer = make_proposer("ngram")
    open_session = proposer.open_session

    def counting_session(prompt_ids, params):
        session = open_session(prompt_ids, params)
        propose = session.propose
        session.propose = lambda k: (calls.append(k), propose(k))[1]  # type: ignore[method-assign]
        return session

    proposer.open_session = counting_session  # type: ignore[method-assign]
    controller = _AlwaysTwo()
    engine = SpeculativeEngine(TargetModel(tiny), proposer, depth=_OneController(controller), eos_token_ids=frozenset())
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    gen = engine.generate(prompt, SamplingParams(max_tokens=40)).run()
    out = gen.token_ids
    assert out == reference(tiny, prompt, 40)
    assert controller.match_gated and controller.shadowed  # its shadows stand in for echo probes in a batch
    # replay: a block of 2 where the n-gram finds one, none elsewhere
    expected = [drafted for drafted, _ in replay_fixed_k(prompt, out, 2)]
    assert gen.stats.k_per_step == expected
    assert len(calls) == sum(1 for k in expected if k > 0) > 0
    assert 0 in expected[:-1], expected  # some step (not the last) found no match and asked nothing
