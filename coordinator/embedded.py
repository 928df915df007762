"""The embedded mode: proposer and verifier in this process, driven by the engine's loop."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.engine import SpeculativeEngine
from draft_service.proposers import make_proposer
from specd.models import LoadedModel, load_model
from specd.vocab import check_vocab, vocab_hash
from target_service.verifier import TargetModel


@dataclass
class EngineOptions:
    target_model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    method: str = "ngram"
    draft_model: str | None = None  # "target" drafts with (a second session of) the target itself
    k: int = 8
    device: str = "cpu"
    dtype: str | None = None


def load_draft(spec: str | None, target: LoadedModel, device: str, dtype: str | None) -> LoadedModel | None:
    if spec is None:
        return None
    if spec == "target":
        return target
    return load_model(spec, device=device, dtype=dtype)


def build_engine(opts: EngineOptions, target: LoadedModel | None = None) -> tuple[SpeculativeEngine, LoadedModel]:
    """Load the models an EngineOptions names and wire them into an engine."""
    target = target or load_model(opts.target_model, device=opts.device, dtype=opts.dtype)
    draft = load_draft(opts.draft_model, target, opts.device, opts.dtype) if opts.method == "draft_model" else None
    if draft is not None and draft is not target:  # refuse a draft with another vocabulary (FailedPrecondition)
        check_vocab(target.name, vocab_hash(target.tokenizer, target.vocab_size),
                    draft.name, vocab_hash(draft.tokenizer, draft.vocab_size))
    proposer = make_proposer(opts.method, draft)
    engine = SpeculativeEngine(
        TargetModel(target),
        proposer,
        k=opts.k,
        eos_token_ids=target.eos_token_ids,
        decode=target.decode if target.tokenizer is not None else None,
    )
    return engine, target
