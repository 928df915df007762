"""`specd diff` embedded, on the real target: every method reproduces the baseline on a prompts file
(one workload prompt of each kind; exit 0), and a deliberately broken verifier is caught (exit 1, naming prompt and position)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from coordinator.diff import EmbeddedRunner, diff_main
from specd.cli import build_parser, main
from specd.models import save_tiny_random_model
from target_service.rejection_sampler import VerifyOutcome
from tests.conftest import one_prompt_per_kind

pytestmark = pytest.mark.slow

# Tokens per prompt here. test_greedy_exactness already checks 20 tokens per workload prompt for
# every method against transformers; this test checks the tool end to end (one prompt of each kind x
# (baseline + 3 methods)), so it stays short to keep CI within its budget.
DIFF_MAX_TOKENS = int(os.environ.get("SPECD_TEST_DIFF_MAX_TOKENS", "8"))


@pytest.fixture(scope="module")
def tiny_draft_folder(target, tmp_path_factory):
    """A random 2-layer draft sharing the target's tokenizer: valid, but most drafts are rejected."""
    return str(save_tiny_random_model(tmp_path_factory.mktemp("diff-draft"), vocab_size=target.vocab_size, hidden_size=64,
                                      tokenizer_from=target.tokenizer, max_position_embeddings=8192))


def test_diff_exits_0_for_every_method_on_a_prompts_file(tiny_draft_folder, workload_prompts, tmp_path, capsys):
    prompts = one_prompt_per_kind(workload_prompts)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(dataclasses.asdict(p)) + "\n" for p in prompts))
    out = tmp_path / "diff.json"
    rc = main(["diff", "--prompts", str(prompts_file), "--method", "ngram,suffix,draft_model",
               "--draft-model", tiny_draft_folder, "--k", "4",
               "--max-tokens", str(DIFF_MAX_TOKENS), "--json", str(out), "--no-progress"])
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert rc == 0, table
    assert report["identical"] is True and report["mode"] == "embedded"
    assert len(report["rows"]) == 3 * len(prompts)
    assert {r["prompt_id"] for r in report["rows"]} == {p.id for p in prompts}
    assert all(r["identical"] and r["baseline_tokens"] > 0 for r in report["rows"])
    # speculation really ran: the copy-heavy prompts get drafts accepted, the random draft gets drafts
    assert report["summary"]["ngram"]["acceptance_rate"] > 0.1
    assert report["summary"]["draft_model"]["outputs"] == len(prompts)
    assert sum(r["num_draft_tokens"] for r in report["rows"] if r["method"] == "draft_model") > 0
    for method in ("ngram", "suffix", "draft_model"):
        assert f"{method}: {len(prompts)}/{len(prompts)} identical, all identical" in table


class AcceptsOneWrongToken:
    """A test double of the engine's verifier: the first time a draft token is rejected, it emits
    that (wrong) draft token in place of the target's own, once; otherwise it passes through.
    `broke_at` records (prompt ids, output position) of the wrong token."""

    def __init__(self, inner):
        self.inner = inner
        self.broke_at: tuple[list[int], int] | None = None

    def open_session(self, prompt_ids, params):
        return _Session(self, self.inner.open_session(prompt_ids, params), list(prompt_ids))


class _Session:
    def __init__(self, owner: AcceptsOneWrongToken, inner, prompt_ids: list[int]):
        self.owner, self.inner, self.prompt_ids, self.emitted = owner, inner, prompt_ids, 0

    @property
    def room(self) -> int:
        return self.inner.room

    def prefill(self) -> int:
        self.emitted = 1
        return self.inner.prefill()

    def verify(self, proposal) -> VerifyOutcome:
        outcome = self.inner.verify(proposal)
        rejected = outcome.num_accepted < len(proposal.tokens)
        if rejected and self.owner.broke_at is None:
            wrong = proposal.tokens[outcome.num_accepted]
            assert wrong != outcome.tokens[-1]  # a rejected draft token is never the target's choice
            self.owner.broke_at = (self.prompt_ids, self.emitted + outcome.num_accepted)
            outcome = VerifyOutcome(outcome.num_accepted, outcome.tokens[:-1] + [wrong])
        self.emitted += len(outcome.tokens)
        return outcome

    def close(self) -> None:
        self.inner.close()


def test_a_broken_verifier_makes_diff_exit_nonzero_naming_prompt_and_position(target, workload_prompts, tmp_path, capsys):
    chosen = [p for p in workload_prompts if p.kind in ("code_edit", "chat")][:2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p.__dict__) for p in chosen) + "\n")
    broken: list[AcceptsOneWrongToken] = []

    def wrap(verifier):
        broken.append(AcceptsOneWrongToken(verifier))
        return broken[-1]

    runner = EmbeddedRunner(target, wrap_verifier=wrap)
    args = build_parser().parse_args(["diff", "--prompts", str(prompts), "--method", "ngram", "--k", "4",
                                      "--max-tokens", "12", "--json", str(tmp_path / "r.json"), "--no-progress"])
    rc = diff_main(args, runner)
    captured = capsys.readouterr()
    assert len(broken) == 1 and broken[0].broke_at is not None, "no draft was rejected: the double never broke"
    prompt_ids, position = broken[0].broke_at
    (which,) = [p for p in chosen if target.encode(p.prompt, chat=p.chat) == prompt_ids]
    assert rc == 1
    report = json.loads((tmp_path / "r.json").read_text())
    (bad,) = [r for r in report["rows"] if not r["identical"]]
    assert (bad["prompt_id"], bad["position"]) == (which.id, position)
    assert f"{which.id} (ngram) differs at token {position}:" in captured.err
    assert f"DIFFERS at token {position}" in captured.out and which.id in captured.out
