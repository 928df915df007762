"""The engine's failover logic over in-process sessions that fail on cue (coordinator/failover.py).

Target: a session whose call raises a transport error is re-opened (prompt + emitted tokens) and
the output stays token for token the target's greedy output; at most MAX_TARGET_REOPENS times,
then UNAVAILABLE; errors that are the request's own pass through untouched. Draft: a failing,
slow or unreachable draft never fails the request, the step goes on at k = 0, and speculation
resumes after the backoff.
"""

from __future__ import annotations

import grpc
import pytest

from coordinator.depth import DepthPolicy
from coordinator.engine import SpeculativeEngine
from coordinator.failover import DRAFT_BACKOFF_STEPS, MAX_TARGET_REOPENS
from draft_service.proposers import make_proposer
from specd.errors import CallTimeout, InvalidArgument, Unavailable
from specd.models import load_model, save_tiny_random_model
from specd.sampling import SamplingParams
from target_service.verifier import TargetModel
from tests.conftest import hf_greedy
from tests.fakes import FakeRpcError

PROMPT = [5, 6, 7, 8]
N = 40
GREEDY = SamplingParams(max_tokens=N, ignore_eos=True)


def unavailable() -> Exception:
    return FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")


class Calls:
    """Counts calls over every session of a fake and raises `error()` at the chosen call numbers."""

    def __init__(self, fail_at=(), error=unavailable):
        self.fail_at = set(fail_at)
        self.error = error
        self.n = 0

    def tick(self) -> None:
        self.n += 1
        if self.n in self.fail_at:
            raise self.error()


class FlakyTargetSession:
    def __init__(self, owner: "FlakyVerifier", inner):
        self.owner, self.inner = owner, inner

    @property
    def room(self) -> int:
        return self.inner.room

    def prefill(self) -> int:
        self.owner.calls.tick()
        return self.inner.prefill()

    def verify(self, proposal):
        self.owner.calls.tick()
        return self.inner.verify(proposal)

    def close(self) -> None:
        self.inner.close()

    def abandon(self) -> None:
        self.owner.abandoned += 1
        self.close()


class FlakyVerifier:
    """An in-process verifier whose sessions fail on cue; `replicas` re-opens allowed, then Unavailable."""

    def __init__(self, model, calls: Calls, replicas: int = 100):
        self.target = TargetModel(model)
        self.calls = calls
        self.replicas = replicas
        self.opened: list[list[int]] = []
        self.abandoned = 0

    def open_session(self, prompt_ids, params):
        if len(self.opened) >= self.replicas:
            raise Unavailable("no healthy target replica (a:1 UNAVAILABLE); retry later")
        self.opened.append(list(prompt_ids))
        return FlakyTargetSession(self, self.target.open_session(prompt_ids, params))


class FlakyDraftSession:
    def __init__(self, owner: "FlakyProposer", inner):
        self.owner, self.inner = owner, inner

    def propose(self, k):
        self.owner.calls.tick()
        return self.inner.propose(k)

    def propose_ahead(self, assumed, k):
        self.owner.calls.tick()
        return self.inner.propose_ahead(assumed, k)

    def append(self, tokens):
        self.inner.append(tokens)

    def close(self):
        self.owner.closed += 1
        self.inner.close()


class FlakyProposer:
    """Drafts with the target itself (every token accepted while it works); calls fail on cue, and
    opens fail while `down`."""

    name = "flaky"

    def __init__(self, model, calls: Calls):
        self.inner = make_proposer("draft_model", model)
        self.calls = calls
        self.down = False
        self.opens = 0
        self.closed = 0

    def open_session(self, prompt_ids, params):
        self.opens += 1
        if self.down:
            raise Unavailable("no healthy draft replica; retry later")
        return FlakyDraftSession(self, self.inner.open_session(prompt_ids, params))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny_random_model(tmp_path_factory.mktemp("tiny"), vocab_size=32, seed=3,
                                                 max_position_embeddings=128)))


@pytest.fixture(scope="module")
def reference(tiny) -> list[int]:
    return hf_greedy(tiny, PROMPT, N, exact_length=True)


def run(engine: SpeculativeEngine, params: SamplingParams = GREEDY):
    gen = engine.generate(PROMPT, params)
    chunks = list(gen)
    return gen, [t for c in chunks for t in c]


# --- target failover ------------------------------------------------------------------------------


@pytest.mark.parametrize("fail_at", [[1], [2], [5], [3, 4], [2, 6, 9]], ids=["prefill", "first-verify", "mid",
                                                                             "failover-prefill", "three"])
@pytest.mark.parametrize("draft", [False, True])
def test_target_failure_reopens_with_the_emitted_tokens_and_stays_exact(tiny, reference, fail_at, draft):
    faults = []
    verifier = FlakyVerifier(tiny, Calls(fail_at))
    proposer = FlakyProposer(tiny, Calls()) if draft else None
    engine = SpeculativeEngine(verifier, proposer, k=3, on_fault=lambda *f: faults.append(f))
    gen, streamed = run(engine)
    assert gen.token_ids == streamed == reference  # nothing lost or repeated
    assert gen.finish_reason == "length"
    assert faults == gen.faults == [("target", "unavailable")] * len(fail_at)
    assert verifier.abandoned == len(fail_at)
    assert len(verifier.opened) == 1 + len(fail_at)
    for opened in verifier.opened[1:]:  # every re-open: the prompt plus exactly what was emitted before it
        assert opened[:len(PROMPT)] == PROMPT and opened[len(PROMPT):] == reference[:len(opened) - len(PROMPT)]
    assert len(verifier.target.sessions) == 0  # every session closed
    if draft:
        assert gen.stats.num_drafts > 0 and proposer.opens == 1  # the draft session survived the target's failovers


def test_target_failover_with_pipelining_and_the_adaptive_controller(tiny, reference):
    verifier = FlakyVerifier(tiny, Calls([3, 7]))
    engine = SpeculativeEngine(verifier, FlakyProposer(tiny, Calls()), k=4, depth=DepthPolicy("auto", 4), pipeline=True)
    gen, streamed = run(engine)
    assert gen.token_ids == streamed == reference
    assert [f[0] for f in gen.faults] == ["target", "target"]


def test_no_target_left_is_unavailable_with_a_clear_message(tiny, reference):
    verifier = FlakyVerifier(tiny, Calls([4]), replicas=1)
    gen = SpeculativeEngine(verifier, None).generate(PROMPT, GREEDY)
    it = iter(gen)
    got = [t for _ in range(3) for t in next(it)]
    with pytest.raises(Unavailable, match=r"failed \(UNAVAILABLE: Socket closed\) after 3 tokens and no other target "
                                          r"replica can take the request over: no healthy target replica"):
        next(it)
    assert got == reference[:3]
    assert len(verifier.target.sessions) == 0


def test_a_request_moves_at_most_max_reopens_times(tiny):
    fail_at = range(2, 2 + MAX_TARGET_REOPENS + 1)
    verifier = FlakyVerifier(tiny, Calls(fail_at))
    with pytest.raises(Unavailable, match=f"already moved {MAX_TARGET_REOPENS} times"):
        SpeculativeEngine(verifier, None).generate(PROMPT, GREEDY).run()
    assert len(verifier.opened) == 1 + MAX_TARGET_REOPENS
    assert len(verifier.target.sessions) == 0


@pytest.mark.parametrize("error", [
    lambda: FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED),  # the request's own deadline
    lambda: FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT),
    lambda: FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED),
    lambda: FakeRpcError(grpc.StatusCode.INTERNAL),
    lambda: InvalidArgument("draft_tokens", "bad"),
], ids=["deadline", "invalid", "exhausted", "internal", "specd-invalid"])
def test_errors_that_are_not_the_replicas_fault_are_not_failed_over(tiny, error):
    verifier = FlakyVerifier(tiny, Calls([3], error))
    with pytest.raises(Exception) as raised:
        SpeculativeEngine(verifier, None).generate(PROMPT, GREEDY).run()
    assert type(raised.value) is type(error())
    assert len(verifier.opened) == 1 and verifier.abandoned == 0


def test_a_step_timeout_fails_over(tiny, reference):
    verifier = FlakyVerifier(tiny, Calls([4], lambda: CallTimeout("no reply within 30000 ms")))
    gen, streamed = run(SpeculativeEngine(verifier, None))
    assert streamed == reference and gen.faults == [("target", "timeout")]


def test_sampling_survives_a_failover(tiny):
    params = SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.8, seed=1)
    gen, streamed = run(SpeculativeEngine(FlakyVerifier(tiny, Calls([5])), FlakyProposer(tiny, Calls()), k=3), params)
    assert len(streamed) == N and gen.token_ids == streamed and len(gen.faults) == 1


# --- draft fallback ---------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [unavailable, lambda: CallTimeout("no reply within 1000 ms"),
                                   lambda: FakeRpcError(grpc.StatusCode.INTERNAL), lambda: RuntimeError("bug")],
                         ids=["unavailable", "slow", "internal", "bug"])
def test_a_failing_draft_never_fails_the_request_and_speculation_resumes(tiny, reference, error):
    faults = []
    proposer = FlakyProposer(tiny, Calls([2], error))
    engine = SpeculativeEngine(FlakyVerifier(tiny, Calls()), proposer, k=2, on_fault=lambda *f: faults.append(f))
    gen, streamed = run(engine)
    assert gen.token_ids == streamed == reference
    assert len(faults) == 1 and faults[0][0] == "draft"
    ks = gen.stats.k_per_step
    # step 1 drafted, step 2 failed (k = 0), the backoff's steps at k = 0, then drafting again
    assert ks[0] == 2 and ks[1:1 + DRAFT_BACKOFF_STEPS] == [0] * DRAFT_BACKOFF_STEPS
    assert ks[1 + DRAFT_BACKOFF_STEPS] == 2
    assert proposer.opens == 2


def test_a_draft_down_at_open_is_retried_with_a_growing_backoff(tiny, reference):
    proposer = FlakyProposer(tiny, Calls())
    proposer.down = True
    gen, streamed = run(SpeculativeEngine(FlakyVerifier(tiny, Calls()), proposer, k=2,
                                          ), SamplingParams(max_tokens=30, ignore_eos=True))
    assert streamed == reference[:30]
    assert gen.stats.num_drafts == 0
    # opens at steps 1, 9, 25: backoffs of 8 and 16 steps (29 steps in all)
    assert proposer.opens == 3 and gen.faults == [("draft", "unavailable")] * 3


def test_the_draft_back_up_brings_speculation_back(tiny, reference):
    proposer = FlakyProposer(tiny, Calls())
    proposer.down = True
    gen = SpeculativeEngine(FlakyVerifier(tiny, Calls()), proposer, k=2).generate(PROMPT, GREEDY)
    it = iter(gen)
    streamed = [t for _ in range(4) for t in next(it)]
    proposer.down = False
    streamed += [t for c in it for t in c]
    assert streamed == reference
    assert gen.stats.num_drafts > 0 and len(gen.faults) == 1


def test_a_draft_failure_with_pipelining_and_the_controller(tiny, reference):
    proposer = FlakyProposer(tiny, Calls([2, 3, 12]))
    engine = SpeculativeEngine(FlakyVerifier(tiny, Calls([6])), proposer, k=4, depth=DepthPolicy("auto", 4), pipeline=True)
    gen, streamed = run(engine)
    assert gen.token_ids == streamed == reference
    assert ("target", "unavailable") in gen.faults and ("draft", "unavailable") in gen.faults


def test_the_request_deadline_on_the_draft_is_passed_on(tiny):
    proposer = FlakyProposer(tiny, Calls([2], lambda: FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED)))
    verifier = FlakyVerifier(tiny, Calls())
    with pytest.raises(FakeRpcError):
        SpeculativeEngine(verifier, proposer, k=2).generate(PROMPT, GREEDY).run()
    assert len(verifier.target.sessions) == 0
