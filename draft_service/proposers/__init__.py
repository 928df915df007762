"""Drafting methods behind one interface (see base.py)."""

from __future__ import annotations

from draft_service.proposers.base import DraftSession, Proposal, Proposer

METHODS = ("none", "ngram", "suffix", "draft_model")

__all__ = ["DraftSession", "Proposal", "Proposer", "METHODS", "make_proposer"]


def make_proposer(method: str, draft_model=None) -> Proposer | None:
    """Build the proposer for a method name; draft_model is a LoadedModel for 'draft_model'."""
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
    raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
