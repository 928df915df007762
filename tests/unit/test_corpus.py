"""Training prompts from the machine's own text (specd/train_draft/corpus.py)."""

from __future__ import annotations

from pathlib import Path

from specd.train_draft import corpus

DOCS = sorted((Path(__file__).resolve().parents[2] / "docs").glob("*.md"))  # text to read without a scan


def test_the_same_count_and_seed_give_the_same_prompts_and_a_small_count_reads_few_files(monkeypatch):
    """What a resumed `specd train-draft` relies on: it rebuilds the same prompt list. The files
    read scale with the prompts asked for (a full scan of the standard library takes ~20 s)."""
    asked: list[int] = []
    python_files = corpus._python_files
    monkeypatch.setattr(corpus, "_python_files", lambda limit: asked.append(limit) or python_files(min(limit, 40)))
    monkeypatch.setattr(corpus, "_doc_files", lambda limit: asked.append(limit) or DOCS)
    first, again = corpus.build_prompts(24, seed=1), corpus.build_prompts(24, seed=1)
    assert len(first) == 24 and first == again
    assert len({p.text for p in first}) >= 20  # drawn from many sources, not one repeated
    assert asked[:2] == [8 * 24, 16 * 24]
    corpus.build_prompts(6000)
    assert asked[-2:] == [corpus.MAX_PYTHON_FILES, corpus.MAX_DOC_FILES]
