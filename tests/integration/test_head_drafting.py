"""Method head end to end: the target's features, exactness with the shipped head, and the
distributed path (features over the target and draft protos, through real gRPC servers)."""

from __future__ import annotations

import grpc
import pytest
import torch

from coordinator.client import CoordinatorClient
from coordinator.depth import DepthPolicy
from coordinator.engine import SpeculativeEngine
from draft_service.head.checkpoint import default_head_dir, load_head
from draft_service.proposers import make_proposer
from draft_service.proposers.base import Proposal
from specd.config import CoordinatorConfig, DraftConfig, TargetConfig
from specd.cpu_kernels import OneDnnLinear
from specd.features import features_to_proto
from specd.grpc_server import make_channel
from specd.models import load_model, save_tiny_random_model
from specd.sampling import SamplingParams
from specd.serve import start_coordinator, start_draft, start_target
from specd.telemetry import noop_telemetry
from specd.vocab import vocab_hash
from specdec.v1 import common_pb2, coordinator_pb2, draft_pb2, draft_pb2_grpc
from target_service.verifier import TargetModel
from tests.conftest import EXACTNESS_MAX_TOKENS


@pytest.fixture(scope="module")
def shipped_head(served_target):
    return load_head(default_head_dir(None), served_target.model,
                     vocab_hash(served_target.tokenizer, served_target.vocab_size))


def test_features_are_the_targets_hidden_states_at_the_kept_positions(tmp_path):
    tiny = load_model(str(save_tiny_random_model(tmp_path, vocab_size=50, hidden_size=32, seed=2)))
    verifier = TargetModel(tiny)
    with_features = verifier.open_session([3, 4, 5, 6], SamplingParams())
    with_features.want_features = True
    other = verifier.open_session([7, 8], SamplingParams())  # shares the batch, wants none
    first = with_features.prefill()
    other.prefill()
    assert with_features.new_features[0] == 0 and with_features.new_features[1].shape == (4, 32)
    plain = verifier.open_session([3, 4, 5, 6], SamplingParams())
    plain.prefill()
    draft = Proposal([first, 9, 10])
    outcome, other_outcome = verifier.verify_batch([(with_features, Proposal(list(draft.tokens))), (other, Proposal([1]))])
    assert plain.verify(draft).tokens == outcome.tokens  # features change nothing in the result
    kept = 1 + outcome.num_accepted
    start, rows = with_features.new_features
    sequence = [3, 4, 5, 6, first] + draft.tokens
    with torch.inference_mode():
        hidden = tiny.model.get_decoder()(input_ids=torch.tensor([sequence])).last_hidden_state[0]
    assert start == 4 and rows.shape == (kept, 32)
    assert torch.allclose(rows, hidden[4: 4 + kept], atol=1e-4)
    assert other.new_features is None


pytestmark = pytest.mark.slow

AUTO_PROMPTS = 6  # the shipped head runs every workload prompt once: these at auto depth, the rest at k = 4


@pytest.mark.parametrize("k", [4])  # k = 1..3 blocks run through the same padded verify (other methods test them)
def test_shipped_head_greedy_equals_target_only(k, served_target, shipped_head, references, workload_prompts):
    engine = SpeculativeEngine(TargetModel(served_target),
                               make_proposer("head", head=shipped_head, max_context=served_target.max_context),
                               k=k, eos_token_ids=served_target.eos_token_ids)
    accepted = 0
    for p in workload_prompts[AUTO_PROMPTS:]:  # the auto test below runs the others
        ids, expected = references[p.id]
        gen = engine.generate(ids, SamplingParams(max_tokens=min(p.max_tokens, EXACTNESS_MAX_TOKENS))).run()
        assert gen.token_ids == expected, f"head k={k} differs from target-only on {p.id}"
        accepted += gen.stats.num_accepted_tokens
    assert accepted > 0, "the shipped head never had a token accepted"


def test_shipped_head_auto_depth_pipelined_equals_target_only(served_target, shipped_head, references, workload_prompts):
    engine = SpeculativeEngine(TargetModel(served_target),
                               make_proposer("head", head=shipped_head, max_context=served_target.max_context),
                               k=8, eos_token_ids=served_target.eos_token_ids, depth=DepthPolicy("auto", 8), pipeline=True)
    for p in workload_prompts[:AUTO_PROMPTS]:
        ids, expected = references[p.id]
        gen = engine.generate(ids, SamplingParams(max_tokens=min(p.max_tokens, EXACTNESS_MAX_TOKENS))).run()
        assert gen.token_ids == expected, f"head auto+pipeline differs from target-only on {p.id}"


@pytest.fixture(scope="module")
def head_stack(target):
    common = {"host": "127.0.0.1", "port": 0, "grace_seconds": 1.0, "log_level": "WARNING"}
    t = start_target(TargetConfig(**common), telemetry=noop_telemetry())
    d = start_draft(DraftConfig(**common, method="head"), telemetry=noop_telemetry())
    c = start_coordinator(CoordinatorConfig(**common, target=(f"127.0.0.1:{t.port}",), draft=(f"127.0.0.1:{d.port}",),
                                            method="head", k="4"), telemetry=noop_telemetry())
    yield t, d, c
    for handle in (c, d, t):
        handle.drain(0)


def test_distributed_head_equals_target_only_and_drafts_from_features(head_stack, references, workload_prompts):
    _, draft, coordinator = head_stack
    # the served head's layers run on oneDNN (the default kernel), and its drafts still pass exactly
    assert type(draft.servicer.head.lm_head) is OneDnnLinear and type(draft.servicer.head.head.fc) is OneDnnLinear
    accepted = 0
    with CoordinatorClient(f"127.0.0.1:{coordinator.port}") as client:
        for p in workload_prompts[:4]:
            ids, expected = references[p.id]
            request = coordinator_pb2.GenerateRequest(prompt_token_ids=coordinator_pb2.TokenIds(ids=ids),
                                                      params=common_pb2.SamplingParams(max_tokens=len(expected)))
            result = client.generate(request, timeout=120)
            assert list(result.token_ids) == expected, f"distributed head differs from target-only on {p.id}"
            accepted += result.stats.num_accepted_tokens
    assert accepted > 0, "no draft token was accepted: the features did not reach the head"


def test_bad_features_get_invalid_argument_and_the_draft_keeps_serving(head_stack, target):
    _, draft, _ = head_stack
    with make_channel(f"127.0.0.1:{draft.port}") as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)

        def session(step: draft_pb2.DraftStep):
            opened = draft_pb2.DraftRequest(open=draft_pb2.OpenDraftSession(
                prompt_token_ids=[1, 2, 3], method=common_pb2.DRAFT_METHOD_HEAD))
            return list(stub.Session(iter([opened, draft_pb2.DraftRequest(step=step)]), timeout=30))

        wrong_width = draft_pb2.DraftStep(k=2, target_features=features_to_proto(0, torch.zeros(3, 7)))
        with pytest.raises(grpc.RpcError) as err:
            session(wrong_width)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "target_features" in err.value.details()
        gap = draft_pb2.DraftStep(k=2, target_features=features_to_proto(5, torch.zeros(1, 576)))
        with pytest.raises(grpc.RpcError) as err:
            session(gap)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "position 5" in err.value.details()
        good = draft_pb2.DraftStep(k=2, target_features=features_to_proto(0, torch.zeros(2, 576)))
        assert len(session(good)[1].token_ids) == 2
