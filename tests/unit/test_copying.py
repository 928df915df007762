"""Copying where the context repeats, a model's drafts elsewhere (draft_service/proposers/copying.py)."""

from __future__ import annotations

from typing import Sequence

import pytest

from draft_service.proposers.base import Proposal
from draft_service.proposers.copying import COPY_MIN_N, CopyingSession, SourceRate, score_block


class ScriptedModelSession:
    """A model session that always drafts `block` and records what it was told."""

    def __init__(self, block: Sequence[int]):
        self.block = list(block)
        self.appended: list[int] = []
        self.features: list[tuple[int, object]] = []
        self.asked = 0
        self.closed = False

    def propose(self, k: int) -> Proposal:
        self.asked += 1
        return Proposal(self.block[:k], None)

    def propose_ahead(self, assumed: Sequence[int], k: int) -> Proposal:
        return Proposal(self.block[:k], None)

    def append(self, tokens: Sequence[int]) -> None:
        self.appended.extend(tokens)

    def add_features(self, start: int, rows: object) -> None:
        self.features.append((start, rows))

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("proposed, truth, expected", [
    ([5, 6, 7], [5, 6, 9], (2, 3)),  # two accepted, the third tried and missed
    ([5, 6, 7], [5, 6, 7, 8], (3, 3)),  # all accepted (the truth runs on with the target's token)
    ([5, 6, 7], [9], (0, 1)),  # the first missed
    ([5, 6, 7], [5], (1, 1)),  # only as far as the truth reaches
    ([], [5], (0, 0)),
])
def test_score_block_counts_positions_tried_until_the_first_miss(proposed, truth, expected):
    assert score_block(proposed, truth) == expected


def test_source_rate_starts_at_its_prior_and_follows_the_evidence():
    rate = SourceRate(prior=0.5, prior_weight=2.0)
    assert rate.rate == pytest.approx(0.5)
    for _ in range(20):
        rate.add(0, 1)
    assert rate.rate < 0.1
    rate.add(0, 0)  # nothing tried: no change
    before = rate.rate
    for _ in range(40):
        rate.add(3, 3)
    assert rate.rate > 0.9 > before


REPEATING = [10, 11, 12, 13, 14, 15, 10, 11, 12]  # the last 3 tokens occurred before, followed by 13 14 15


def test_a_repeating_context_is_copied_until_copies_do_worse_than_the_model():
    model = ScriptedModelSession([40, 41, 42])
    session = CopyingSession(model, REPEATING)
    first = session.propose(3)
    assert first.tokens == [13, 14, 15] and first.probs is None and model.asked == 0  # a tie at the priors: copy
    # The text does not repeat: after 10 11 12 the target says something new every time.
    session.append([50, 10, 11, 12])
    for new in range(51, 54):
        proposal = session.propose(3)
        session.append([new, 10, 11, 12])
    assert proposal.tokens == [40, 41, 42] and model.asked >= 1
    assert session.copy_rate.rate < session.model_rate.rate


def test_the_copy_comes_back_when_the_text_repeats_while_the_model_drafts():
    model = ScriptedModelSession([40, 41, 42])
    session = CopyingSession(model, REPEATING)
    session.copy_rate.add(0, 6)  # copies failed earlier in this request
    session.model_rate.add(1, 3)
    for _ in range(6):
        proposal = session.propose(3)
        assert proposal.tokens == [40, 41, 42]
        # what the copy offered is what followed (scored although unused), and the context repeats again
        session.append([13, 14, 15, 10, 11, 12])
        if session.copy_rate.rate >= session.model_rate.rate:
            break
    assert session.propose(3).tokens == [13, 14, 15]
    assert session.copies == 1


def test_no_copy_without_a_long_enough_match_and_everything_reaches_the_model():
    model = ScriptedModelSession([40, 41])
    session = CopyingSession(model, [1, 2, 3, 4, 5, 6])  # no repeated COPY_MIN_N-gram
    assert COPY_MIN_N >= 2
    assert session.propose(2).tokens == [40, 41]
    session.add_features(0, "rows")
    session.append([40, 41, 7])
    assert model.features == [(0, "rows")] and model.appended == [40, 41, 7]
    assert session.model_rate.rate > 0.5  # both drafted tokens accepted, over a prior of 0.5
    assert session.propose(0).tokens == []
    session.close()
    assert model.closed


def test_pipelined_proposals_copy_from_the_assumed_context_and_score_nothing():
    model = ScriptedModelSession([40, 41, 42])
    session = CopyingSession(model, [10, 11, 12, 13, 14, 15])
    ahead = session.propose_ahead([10, 11, 12], 3)  # the assumed block makes the context repeat
    assert ahead.tokens == [13, 14, 15]
    session.append([10, 11, 12])
    assert session.copy_rate.tried == pytest.approx(2.0) and session.model_rate.tried == pytest.approx(2.0)
