"""The engine sends the next verify step before it streams the last step's tokens (coordinator/engine.py).

With a session that sends a step and reads its reply in two calls (the gRPC transport's
`start_verify`), the client's share of a step (streaming, decoding) runs while the target
verifies. These tests pin the order with a fake two-call session, and check that the output, a
failover between the two calls and a client gone with a step in flight behave as with a
one-call session. No model and no network.
"""

from __future__ import annotations

import grpc
import pytest

from coordinator.engine import SpeculativeEngine
from coordinator.failover import FailoverOutcome, TargetLink
from draft_service.proposers import make_proposer
from draft_service.proposers.base import Proposal
from specd.sampling import SamplingParams
from target_service.rejection_sampler import VerifyOutcome
from tests.fakes import FakeRpcError

VOCAB = 7
PROMPT = [1, 2, 3, 4, 5, 6, 0, 1, 2]  # the sequence counts up mod VOCAB: an n-gram draft finds it


def next_token(context: list[int]) -> int:
    return (context[-1] + 1) % VOCAB


class CountingSession:
    """A greedy target whose next token is the last one plus one (mod VOCAB), one call per step."""

    def __init__(self, prompt: list[int], events: list[str]):
        self.context = list(prompt)
        self.events = events
        self.closed = False

    @property
    def room(self) -> int:
        return 1000

    def prefill(self) -> int:
        self.context.append(next_token(self.context))
        return self.context[-1]

    def verify(self, proposal: Proposal) -> VerifyOutcome:
        start, accepted = len(self.context), 0
        for token in proposal.tokens:
            if token != next_token(self.context):
                break
            self.context.append(token)
            accepted += 1
        self.context.append(next_token(self.context))  # the target's own token
        return VerifyOutcome(num_accepted=accepted, tokens=self.context[start:])

    def close(self) -> None:
        self.closed = True
        self.events.append("close")


class _Pending:
    def __init__(self, session: "TwoCallSession", proposal: Proposal):
        self.session, self.proposal = session, proposal

    def result(self) -> VerifyOutcome:
        self.session.events.append("result")
        if self.session.fail_next:
            self.session.fail_next = False
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        return CountingSession.verify(self.session, self.proposal)


class TwoCallSession(CountingSession):
    """The same target, sent and read in two calls, as the gRPC session is."""

    def __init__(self, prompt: list[int], events: list[str]):
        super().__init__(prompt, events)
        self.fail_next = False

    def start_verify(self, proposal: Proposal) -> _Pending:
        self.events.append("send")
        return _Pending(self, proposal)


class Verifier:
    def __init__(self, session_type: type, events: list[str]):
        self.session_type, self.events = session_type, events
        self.sessions: list[CountingSession] = []

    def open_session(self, prompt_ids, params) -> CountingSession:
        session = self.session_type(list(prompt_ids), self.events)
        self.sessions.append(session)
        return session


def generate(session_type: type, k: int, max_tokens: int = 12) -> tuple[list[int], list[str], Verifier]:
    events: list[str] = []
    verifier = Verifier(session_type, events)
    engine = SpeculativeEngine(verifier, make_proposer("ngram") if k else None, k=k)
    gen = engine.generate(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    for chunk in gen:
        events.append(f"chunk {len(chunk)}")
        tokens.extend(chunk)
    assert tokens == gen.token_ids
    return tokens, events, verifier


def expected(n: int) -> list[int]:
    context = list(PROMPT)
    for _ in range(n):
        context.append(next_token(context))
    return context[len(PROMPT):]


@pytest.mark.parametrize("k", [0, 3])
def test_the_output_is_the_same_with_one_call_and_two_call_sessions(k):
    one, _, _ = generate(CountingSession, k)
    two, _, _ = generate(TwoCallSession, k)
    assert one == two == expected(12)


def test_a_two_call_session_streams_each_step_after_sending_the_next():
    _, events, _ = generate(TwoCallSession, k=0, max_tokens=4)
    # prefill's token at once; then each step's token once the next step is sent; the last at the end
    assert events == ["chunk 1", "send", "result", "send", "chunk 1", "result", "send", "chunk 1", "result",
                      "chunk 1", "close"]


def test_a_one_call_session_streams_each_step_before_the_next():
    events: list[str] = []
    verifier = Verifier(CountingSession, events)

    class Recording(CountingSession):
        def verify(self, proposal):
            events.append("verify")
            return super().verify(proposal)

    verifier.session_type = Recording
    engine = SpeculativeEngine(verifier, None, k=0)
    for chunk in engine.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)):
        events.append(f"chunk {len(chunk)}")
    assert events == ["chunk 1", "verify", "chunk 1", "verify", "chunk 1", "close"]


def test_a_failure_between_send_and_reply_fails_over_to_a_new_session():
    events: list[str] = []
    verifier = Verifier(TwoCallSession, events)
    session = verifier.open_session(PROMPT, None)
    faults: list[tuple[str, str]] = []
    link = TargetLink(verifier, session, PROMPT, SamplingParams(max_tokens=8), lambda s, r: faults.append((s, r)))
    generated = [link.prefill([])]
    session.fail_next = True
    pending = link.start_verify(Proposal(), generated)
    outcome = pending.result()
    assert isinstance(outcome, FailoverOutcome) and outcome.tokens == [next_token(PROMPT + generated)]
    assert session.closed and link.session is verifier.sessions[1] and faults == [("target", "unavailable")]
    assert pending.result() is outcome  # read once


def test_a_client_gone_with_a_step_in_flight_closes_the_session_unread():
    events: list[str] = []
    verifier = Verifier(TwoCallSession, events)
    engine = SpeculativeEngine(verifier, None, k=0)
    gen = engine.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))
    chunks = iter(gen)
    next(chunks)  # the prefill's token
    next(chunks)  # the first step's token: the second step is in flight
    gen.close()
    assert events[-2:] == ["send", "close"] and verifier.sessions[0].closed
