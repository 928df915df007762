"""Drafting methods behind one interface (see base.py)."""

from __future__ import annotations

from draft_service.proposers.base import DraftSession, Proposal, Proposer

METHODS = ("none", "ngram", "suffix", "draft_model", "head")

__all__ = ["DraftSession", "Proposal", "Proposer", "METHODS", "make_proposer"]


def make_proposer(method: str, draft_model=None, head=None, max_context: int = 0) -> Proposer | None:
    """Build the proposer for a method name; draft_model is a LoadedModel for 'draft_model', head
    a LoadedHead (draft_service/head/checkpoint.py) for 'head', with the target's max_context."""
    if method == "none":
        return None
    if method == "ngram":
        from draft_service.proposers.ngram import NgramProposer

        return NgramProposer()
    if method == "suffix":
        from draft_service.proposers.suffix import SuffixProposer

        return SuffixProposer()
    if method == "draft_model":
        if draft_model is None:
            raise ValueError("method draft_model needs a draft model: pass --draft-model PATH|HUB_ID|target")
        from draft_service.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(draft_model)
    if method == "head":
        if head is None:
            raise ValueError("method head needs a trained head: pass --head DIR (made by specd train-draft)")
        from draft_service.proposers.head import HeadProposer

        return HeadProposer(head, max_context)
    raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
