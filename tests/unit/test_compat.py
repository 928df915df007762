"""Draft/target compatibility: the vocabulary check, the per-request speculation state, refusals."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from coordinator.compat import (
    OFF_INCOMPATIBLE,
    OFF_NO_DRAFTS,
    OFF_REQUESTED,
    DraftCompat,
    NoDraftSession,
    check_draft_infos,
    is_refusal,
    speculation_state,
)
from specd.errors import FailedPrecondition
from specd.telemetry import setup_telemetry
from specd.vocab import check_vocab, vocab_hash, vocab_mismatch
from tests.fakes import FakeRpcError
from tests.probes import metric_points
from specdec.v1 import common_pb2


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int], special: list[str]):
        self.vocab = vocab
        self.all_special_tokens = special

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_vocab_hash_sees_ids_and_special_tokens():
    base = vocab_hash(FakeTokenizer({"a": 0, "b": 1}, ["</s>"]), 2)
    assert base == vocab_hash(FakeTokenizer({"b": 1, "a": 0}, ["</s>"]), 2)  # order of the map does not matter
    assert base != vocab_hash(FakeTokenizer({"a": 1, "b": 0}, ["</s>"]), 2)  # same tokens, other ids
    assert base != vocab_hash(FakeTokenizer({"a": 0, "b": 1}, ["<eos>"]), 2)  # other special tokens
    assert vocab_hash(None, 64) != vocab_hash(None, 65)


def test_vocab_mismatch_names_both_models():
    assert vocab_mismatch("target-a", "h1", "draft-b", "h1") is None
    message = vocab_mismatch("target-a", "h1", "draft-b", "h2")
    assert message is not None and "target-a" in message and "draft-b" in message
    assert "h1" in message and "h2" in message


@pytest.mark.parametrize("target_hash,draft_hash", [("", "h2"), ("h1", ""), ("", "")])
def test_unknown_hash_is_not_a_mismatch(target_hash, draft_hash):
    assert vocab_mismatch("t", target_hash, "d", draft_hash) is None
    check_vocab("t", target_hash, "d", draft_hash)  # does not raise


def test_check_vocab_raises_failed_precondition():
    with pytest.raises(FailedPrecondition, match="draft-b.*target-a"):
        check_vocab("target-a", "h1", "draft-b", "h2")


@pytest.mark.parametrize("method,off_reason,num_drafts,passes,expected", [
    ("ngram", None, 3, 5, ("on", "")),
    ("ngram", None, 0, 1, ("on", "")),  # max_tokens 1: never reached a step that could draft
    ("ngram", None, 0, 5, ("off", OFF_NO_DRAFTS)),
    ("none", None, 0, 5, ("off", OFF_REQUESTED)),
    ("draft_model", OFF_INCOMPATIBLE, 0, 5, ("off", OFF_INCOMPATIBLE)),
])
def test_speculation_state(method, off_reason, num_drafts, passes, expected):
    assert speculation_state(method, off_reason, num_drafts, passes) == expected


def test_check_draft_infos():
    infos = [
        ("a:1", common_pb2.ModelInfo(name="good", vocab_hash="h1")),
        ("a:2", common_pb2.ModelInfo(name="bad", vocab_hash="h2")),
        ("a:3", common_pb2.ModelInfo(name="model-free")),
        ("a:4", None),  # did not answer
    ]
    checks = check_draft_infos("target", "h1", infos)
    assert [c.compatible for c in checks] == [True, False, True, True]
    assert checks[1].draft_model == "bad" and "bad" in checks[1].message and "target" in checks[1].message
    assert checks[2].draft_model == "" and checks[3].draft_model == ""


def test_is_refusal():
    assert is_refusal(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION))
    assert not is_refusal(FakeRpcError(grpc.StatusCode.UNAVAILABLE))
    assert not is_refusal(FailedPrecondition("not an RPC error"))


def test_no_draft_session_never_proposes():
    session = NoDraftSession()
    session.append([1, 2])
    assert session.propose(8).tokens == []
    assert session.propose_ahead([3, 4], 8).tokens == []
    session.close()




def test_refusals_are_logged_once_counted_always_and_mark_the_request(caplog):
    reader = InMemoryMetricReader()
    tel = setup_telemetry("coordinator", None, metric_readers=[reader])
    try:
        compat = DraftCompat("target-a", "h1", tel)
        message = vocab_mismatch("target-a", "h1", "draft-b", "h2")
        assert message is not None
        steps = [SimpleNamespace(attrs={"gen_ai.request.model": "target-a", "specd.method": "draft_model",
                                        "specd.draft.model": "draft-b"}, off_reason=None) for _ in range(3)]
        with caplog.at_level(logging.ERROR, logger="coordinator.compat"):
            for s in steps:
                compat.refused("draft_model", message, steps=s)
        assert [s.off_reason for s in steps] == [OFF_INCOMPATIBLE] * 3
        assert compat.refusals == 3
        logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(logged) == 1 and "draft-b" in logged[0] and "target-a" in logged[0]
        (attrs, value), = metric_points(reader, "specd.coordinator.speculation.disabled")
        assert value == 3
        assert attrs == {"gen_ai.request.model": "target-a", "specd.method": "draft_model",
                         "specd.draft.model": "draft-b", "specd.reason": "vocab_mismatch"}
    finally:
        tel.shutdown()


def test_startup_check_logs_and_counts_each_incompatible_replica(caplog):
    reader = InMemoryMetricReader()
    tel = setup_telemetry("coordinator", None, metric_readers=[reader])
    try:
        compat = DraftCompat("target-a", "h1", tel)
        with caplog.at_level(logging.ERROR, logger="coordinator.compat"):
            checks = compat.check_startup([("a:1", common_pb2.ModelInfo(name="good", vocab_hash="h1")),
                                           ("a:2", common_pb2.ModelInfo(name="bad", vocab_hash="h2"))])
        assert [c.compatible for c in checks] == [True, False]
        assert any("a:2" in r.getMessage() and "bad" in r.getMessage() for r in caplog.records)
        assert not any("a:1" in r.getMessage() for r in caplog.records)
        (attrs, value), = metric_points(reader, "specd.coordinator.speculation.disabled")
        assert value == 1 and attrs["specd.draft.model"] == "bad"
    finally:
        tel.shutdown()
