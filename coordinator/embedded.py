"""The embedded mode: proposer and verifier in this process, driven by the engine's loop."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.depth import DepthPolicy
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
    k: int | str = "auto"  # a fixed k, or a depth policy: "auto", "schedule:B=K,...", "...,floor=A"
    device: str = "cpu"
    dtype: str | None = None
    k_max: int = 8
    pipeline: bool = False
    head: str | None = None  # method head: a trained head's directory (None: the one shipped for the target)


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
    head = None
    if opts.method == "head":
        from draft_service.head.checkpoint import load_head_for

        head = load_head_for(target, opts.head, opts.target_model)
    proposer = make_proposer(opts.method, draft, head=head, max_context=target.max_context)
    k, policy = depth_options(opts.k, opts.k_max)
    engine = SpeculativeEngine(
        TargetModel(target),
        proposer,
        k=k,
        eos_token_ids=target.eos_token_ids,
        decode=target.decode if target.tokenizer is not None else None,
        depth=policy,
        pipeline=opts.pipeline,
    )
    return engine, target


def depth_options(k: int | str, k_max: int = 8) -> tuple[int, DepthPolicy | None]:
    """(fixed k, None) for an integer depth, else (k_max, a DepthPolicy for the spec)."""
    text = str(k).strip()
    if text.isdigit():
        return int(text), None
    return k_max, DepthPolicy(text, k_max)
