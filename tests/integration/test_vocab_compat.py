"""A draft model with another vocabulary: refused with FAILED_PRECONDITION, and requests still complete,
exactly, without speculation.

Target, draft and coordinator run in-process as specd/serve.py builds them. The target is a tiny
random model with a word-level tokenizer; the draft model is one with a tokenizer of other words
(built with the `tokenizers` library, nothing is downloaded), so the two vocabulary hashes differ.
"""

from __future__ import annotations

import logging

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from coordinator.client import CoordinatorClient, build_request
from coordinator.embedded import EngineOptions, build_engine
from specd.config import CoordinatorConfig, DraftConfig, TargetConfig
from specd.errors import FailedPrecondition
from specd.grpc_server import make_channel
from specd.models import save_tiny_random_model
from specd.sampling import SamplingParams
from specd.serve import start_coordinator, start_draft, start_target
from specd.telemetry import setup_telemetry
from specd.vocab import vocab_hash
from tests.probes import metric_points
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2_grpc

VOCAB = 64
PROMPT = " ".join(f"w{i % 7}" for i in range(30))  # repetitive, so ngram has something to draft


def word_tokenizer(prefix: str):
    """A word-level fast tokenizer of VOCAB tokens: <unk>, </s>, then prefix0, prefix1, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "</s>"] + [f"{prefix}{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    target = save_tiny_random_model(tmp_path_factory.mktemp("target-w"), vocab_size=VOCAB, seed=1,
                                    tokenizer_from=word_tokenizer("w"))
    draft = save_tiny_random_model(tmp_path_factory.mktemp("draft-v"), vocab_size=VOCAB, seed=2,
                                   tokenizer_from=word_tokenizer("v"))
    return {"target": str(target), "draft": str(draft)}


@pytest.fixture(scope="module")
def services(folders):
    reader = InMemoryMetricReader()
    tel = setup_telemetry("coordinator", None, metric_readers=[reader])
    handles = {}
    try:
        handles["target"] = start_target(TargetConfig(port=0, model=folders["target"], max_workers=8, grace_seconds=0.5))
        handles["draft"] = start_draft(DraftConfig(port=0, model=folders["draft"], method="draft_model", max_workers=8,
                                                   grace_seconds=0.5))
        handles["coordinator"] = start_coordinator(CoordinatorConfig(
            port=0, max_workers=8, grace_seconds=0.5, target=(f"127.0.0.1:{handles['target'].port}",),
            draft=(f"127.0.0.1:{handles['draft'].port}",), method="draft_model", k=4,
            tokenizer_model=folders["target"]), telemetry=tel)
        yield {"handles": handles, "reader": reader}
    finally:
        for name in ("coordinator", "draft", "target"):
            if name in handles:
                handles[name].drain(0.2)
        tel.shutdown()


def _address(services, name: str) -> str:
    return f"127.0.0.1:{services['handles'][name].port}"


def _target_info(services) -> common_pb2.ModelInfo:
    with make_channel(_address(services, "target")) as ch:
        return target_pb2_grpc.TargetServiceStub(ch).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)


def _open(services, method: int, target: common_pb2.ModelInfo) -> draft_pb2.DraftBlock:
    request = draft_pb2.DraftRequest(open=draft_pb2.OpenDraftSession(
        prompt_token_ids=[2, 3, 4], method=method, target_model=target.name, target_vocab_hash=target.vocab_hash))
    with make_channel(_address(services, "draft")) as ch:
        return next(draft_pb2_grpc.DraftServiceStub(ch).Session(iter([request]), timeout=10))




def test_the_two_models_really_have_other_vocabularies(services, folders):
    with make_channel(_address(services, "draft")) as ch:
        draft = draft_pb2_grpc.DraftServiceStub(ch).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)
    target = _target_info(services)
    assert draft.vocab_size == target.vocab_size == VOCAB  # same size: only the hash tells them apart
    assert draft.vocab_hash and target.vocab_hash and draft.vocab_hash != target.vocab_hash


def test_draft_model_session_is_refused_with_failed_precondition_naming_both_models(services):
    target = _target_info(services)
    with pytest.raises(grpc.RpcError) as info:
        _open(services, common_pb2.DRAFT_METHOD_DRAFT_MODEL, target)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = info.value.details()
    assert target.name in details and "draft-v" in details, details


def test_model_free_methods_are_always_compatible(services):
    block = _open(services, common_pb2.DRAFT_METHOD_NGRAM, _target_info(services))
    assert block.session_id


def test_requests_complete_exactly_without_speculation(services, caplog):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with CoordinatorClient(_address(services, "coordinator")) as client:
        baseline = client.generate(build_request(PROMPT, params, method="none"), timeout=60)
        with caplog.at_level(logging.ERROR, logger="coordinator.compat"):
            refused = [client.generate(build_request(PROMPT, params, method="draft_model", k=4), timeout=60)
                       for _ in range(2)]
        ngram = client.generate(build_request(PROMPT, params, method="ngram", k=4), timeout=60)
    assert len(baseline.token_ids) == 24
    for r in refused:
        assert list(r.token_ids) == list(baseline.token_ids)
        assert r.stats.num_drafts == 0 and r.stats.num_draft_tokens == 0
        assert r.stats.target_forward_passes == 24  # one pass per token: plain decoding
    assert list(ngram.token_ids) == list(baseline.token_ids)
    assert ngram.stats.num_drafts > 0, "model-free methods keep speculating"
    # said once in the log (not per request), counted per refusal
    logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) == 1 and "draft-v" in logged[0], logged
    reader = services["reader"]
    refusals = {(a["specd.reason"], a["specd.method"]): v for a, v in metric_points(reader, "specd.coordinator.speculation.disabled")}
    assert refusals[("vocab_mismatch", "draft_model")] >= 3  # the start-up check, then the two sessions
    states = {(a["specd.method"], a["specd.speculation"], a.get("specd.speculation.reason")): v
              for a, v in metric_points(reader, "specd.coordinator.speculation.requests")}
    assert states[("draft_model", "off", "incompatible_draft")] == 2
    assert states[("none", "off", "requested")] == 1
    assert states[("ngram", "on", None)] == 1


def test_embedded_mode_refuses_the_draft_at_load(folders):
    with pytest.raises(FailedPrecondition, match="draft-v"):
        build_engine(EngineOptions(target_model=folders["target"], method="draft_model", draft_model=folders["draft"], k=4))
    assert vocab_hash(word_tokenizer("w"), VOCAB) != vocab_hash(word_tokenizer("v"), VOCAB)
