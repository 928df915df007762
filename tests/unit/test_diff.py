"""`specd diff`'s comparison (pure functions) and its exit status, with a scripted runner."""

from __future__ import annotations

import json

import pytest

from coordinator.diff import (
    Difference,
    RunResult,
    acceptance_rate,
    all_identical,
    compare,
    diff_main,
    first_difference,
    format_table,
    mean_acceptance_length,
    parse_k,
    parse_methods,
    speedup,
    summarize,
)
from specd.cli import build_parser
from specd.errors import InvalidArgument
from specd.workloads import Prompt


def decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


@pytest.mark.parametrize("a,b,expected", [
    ([1, 2, 3], [1, 2, 3], None),
    ([], [], None),
    ([1, 2, 3], [1, 9, 3], Difference(1, 2, 9)),
    ([5, 2, 3], [1, 2, 3], Difference(0, 5, 1)),
    ([1, 2, 3], [1, 2], Difference(2, 3, None)),  # speculation stopped early
    ([1, 2], [1, 2, 7], Difference(2, None, 7)),  # speculation ran past the baseline's end
])
def test_first_difference(a, b, expected):
    assert first_difference(a, b) == expected


def test_rates_and_speedup():
    assert acceptance_rate(10, 4) == pytest.approx(0.4)
    assert acceptance_rate(0, 0) == 0.0
    assert mean_acceptance_length(4, 6) == pytest.approx(2.5)
    assert mean_acceptance_length(0, 0) == 0.0
    assert speedup(2.0, 1.0) == pytest.approx(2.0)
    assert speedup(0.0, 1.0) == 0.0 and speedup(1.0, 0.0) == 0.0


def test_compare_identical_and_differing():
    base = RunResult([1, 2, 3, 4], 2.0)
    same = compare("p1", "ngram", "4", base, RunResult([1, 2, 3, 4], 1.0, num_drafts=2, num_draft_tokens=8,
                                                       num_accepted_tokens=2), decode)
    assert same.identical and same.position is None and same.baseline_token is None
    assert same.acceptance_rate == pytest.approx(0.25) and same.mean_acceptance_length == pytest.approx(2.0)
    assert same.speedup == pytest.approx(2.0)
    bad = compare("p2", "suffix", "4", base, RunResult([1, 2, 7, 4], 1.0), decode)
    assert not bad.identical and bad.position == 2
    assert (bad.baseline_token, bad.speculative_token) == ("'<3>'", "'<7>'")
    assert (bad.baseline_token_id, bad.speculative_token_id) == (3, 7)
    short = compare("p3", "suffix", "4", base, RunResult([1, 2], 1.0), decode)
    assert short.position == 2 and short.speculative_token == "<end>"


def test_summary_pools_tokens_and_times_per_method():
    base = RunResult([1, 2], 3.0)
    rows = [
        compare("a", "ngram", "4", base, RunResult([1, 2], 1.0, 1, 4, 4), decode),
        compare("b", "ngram", "4", base, RunResult([1, 9], 2.0, 1, 4, 0), decode),
        compare("a", "suffix", "4", base, RunResult([1, 2], 3.0), decode),
    ]
    s = summarize(rows)
    assert s["ngram"] == {"outputs": 2, "identical": 1, "differing": ["b"], "acceptance_rate": 0.5,
                          "mean_acceptance_length": 3.0, "speedup": 2.0}
    assert s["suffix"]["differing"] == [] and s["suffix"]["speedup"] == 1.0
    assert not all_identical(rows) and all_identical(rows[:1]) and not all_identical([])
    table = format_table(rows)
    assert "DIFFERS at token 1: '<2>' (off) vs '<9>' (on)" in table
    assert "ngram: 1/2 identical, 1 DIFFER (b)" in table and "suffix: 1/1 identical, all identical" in table


def test_parse_methods_and_k():
    assert parse_methods(None, remote=False) == ["ngram"]
    assert parse_methods(None, remote=True) == [""]
    assert parse_methods("ngram, suffix,ngram", remote=False) == ["ngram", "suffix"]
    with pytest.raises(InvalidArgument, match="method"):
        parse_methods("ngram,bogus", remote=False)
    with pytest.raises(InvalidArgument, match="method"):
        parse_methods("none", remote=False)
    assert parse_k(None) is None and parse_k("4") == 4 and parse_k(" auto ") == "auto"
    with pytest.raises(InvalidArgument, match="k"):
        parse_k("0")


class ScriptedRunner:
    """Answers from a table: (prompt id, method) -> token ids; the baseline is method "none"."""

    def __init__(self, outputs: dict[tuple[str, str], list[int]]):
        self.outputs = outputs
        self.calls: list[tuple[str, str, object, int]] = []

    def warm_up(self) -> None:
        pass

    def run(self, prompt, method, k, max_tokens):
        self.calls.append((prompt.id, method, k, max_tokens))
        ids = self.outputs[(prompt.id, method)]
        return RunResult(ids[:max_tokens], 1.0, 1, 2, 1)

    def decode(self, ids):
        return decode(ids)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [Prompt("p1", "chat", True, "hi", 8), Prompt("p2", "code", False, "def f():", 3)]
    path.write_text("\n".join(json.dumps(p.__dict__) for p in rows) + "\n")
    return path


def _args(*argv: str):
    return build_parser().parse_args(["diff", "--no-progress", *argv])


def test_exit_0_when_every_output_is_identical(prompts_file, tmp_path, capsys):
    runner = ScriptedRunner({(p, m): [1, 2, 3, 4] for p in ("p1", "p2") for m in ("none", "ngram", "suffix")})
    out = tmp_path / "report.json"
    rc = diff_main(_args("--prompts", str(prompts_file), "--method", "ngram,suffix", "--k", "4", "--max-tokens", "5",
                         "--json", str(out)), runner)
    assert rc == 0
    # baseline once per prompt, then each method; max_tokens capped by --max-tokens
    assert runner.calls == [("p1", "none", 0, 5), ("p1", "ngram", 4, 5), ("p1", "suffix", 4, 5),
                            ("p2", "none", 0, 3), ("p2", "ngram", 4, 3), ("p2", "suffix", 4, 3)]
    report = json.loads(out.read_text())
    assert report["identical"] is True and len(report["rows"]) == 4 and report["k"] == "4"
    assert "all identical" in capsys.readouterr().out


def test_exit_1_names_the_prompt_and_position(prompts_file, capsys):
    runner = ScriptedRunner({("p1", "none"): [1, 2, 3], ("p1", "ngram"): [1, 2, 3],
                             ("p2", "none"): [5, 6, 7], ("p2", "ngram"): [5, 6, 8]})
    rc = diff_main(_args("--prompts", str(prompts_file), "--json"), runner)
    assert rc == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # --json without FILE: the report on stdout
    assert report["identical"] is False
    (bad,) = [r for r in report["rows"] if not r["identical"]]
    assert (bad["prompt_id"], bad["method"], bad["position"]) == ("p2", "ngram", 2)
    assert "p2 (ngram) differs at token 2: '<7>' without speculation, '<8>' with it" in captured.err


def test_k_auto_is_passed_through_to_the_engine(prompts_file):
    runner = ScriptedRunner({(p, m): [1, 2] for p in ("p1", "p2") for m in ("none", "ngram")})
    assert diff_main(_args("--prompts", str(prompts_file), "--k", "auto"), runner) == 0
    assert [(m, k) for _, m, k, _ in runner.calls] == [("none", 0), ("ngram", "auto")] * 2
