"""`specd train-draft` on a tiny target with the default tokenizer: data, training, resuming,
and a result that the draft methods load and draft exactly with."""

from __future__ import annotations

import json

import pytest
import torch

from coordinator.engine import SpeculativeEngine
from draft_service.head.checkpoint import load_head
from draft_service.proposers import make_proposer
from specd.cli import main
from specd.models import load_model
from specd.sampling import SamplingParams
from specd.vocab import vocab_hash
from target_service.verifier import TargetModel
from tests.integration.inprocess_stack import save_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-target"), max_context=512)


def _train(tiny_dir, out, data, kind="head", minutes="0.05"):
    return main(["train-draft", "--target", str(tiny_dir), "--out", str(out), "--data", str(data), "--kind", kind,
                 "--minutes", minutes, "--data-tokens", "600", "--prompts", "12", "--batch-size", "4",
                 "--draft-vocab", "512"])


def test_head_trains_resumes_and_drafts_exactly(tiny_dir, tmp_path):
    out, data = tmp_path / "head", tmp_path / "data"
    assert _train(tiny_dir, out, data) == 0
    shards = sorted(data.glob("shard-*.pt"))
    assert shards and sum(t.shape[0] for s in shards for t in torch.load(s)["tokens"]) >= 600
    meta = json.loads((out / "head.json").read_text())
    assert meta["kind"] == "head" and meta["steps"] >= 1 and "est_acceptance_length_k4" in meta["held_out"]
    first_steps = torch.load(out / "checkpoint.pt")["step"]
    assert (out / "command.txt").read_text().startswith("specd train-draft")
    log = [json.loads(line) for line in (out / "train.log").read_text().splitlines()]
    assert log[-1]["final"] is True

    assert _train(tiny_dir, out, data, minutes="0.1") == 0  # resumes: same data, more steps
    assert torch.load(out / "checkpoint.pt")["step"] > first_steps
    assert len(list(data.glob("shard-*.pt"))) == len(shards)  # the data was already there: none made

    target = load_model(str(tiny_dir))
    head = load_head(out, target.model, vocab_hash(target.tokenizer, target.vocab_size))
    assert head.draft_vocab.numel() == 512
    ids = target.encode("Explain what a list is.", chat=True)
    alone = SpeculativeEngine(TargetModel(target), None).generate(ids, SamplingParams(max_tokens=24)).run()
    engine = SpeculativeEngine(TargetModel(target), make_proposer("head", head=head, max_context=target.max_context), k=3)
    gen = engine.generate(ids, SamplingParams(max_tokens=24)).run()
    assert gen.token_ids == alone.token_ids and gen.stats.num_draft_tokens > 0


def test_small_draft_is_a_model_folder_the_draft_model_method_loads(tiny_dir, tmp_path):
    out, data = tmp_path / "small", tmp_path / "data"
    assert _train(tiny_dir, out, data, kind="small") == 0
    target, small = load_model(str(tiny_dir)), load_model(str(out / "model"))
    assert small.model.config.num_hidden_layers == 2 and small.vocab_size == target.vocab_size
    ids = target.encode("Explain what a list is.", chat=True)
    alone = SpeculativeEngine(TargetModel(target), None).generate(ids, SamplingParams(max_tokens=16)).run()
    gen = SpeculativeEngine(TargetModel(target), make_proposer("draft_model", small), k=3).generate(
        ids, SamplingParams(max_tokens=16)).run()
    assert gen.token_ids == alone.token_ids and gen.stats.num_draft_tokens > 0
