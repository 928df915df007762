"""`specd bench`: tokens/s per workload kind for specd's methods and transformers' baselines.

Every system runs every prompt in every run, interleaved (run r: prompt p: system s), so that
machine noise hits all systems alike; a kind's tokens/s in a run is its tokens over its seconds,
and the report gives the median over runs plus ratios against transformers' target-only
`generate(do_sample=False)` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from coordinator.engine import SpeculativeEngine
from draft_service.proposers import make_proposer
from specd.models import LoadedModel, load_model
from specd.sampling import SamplingParams
from specd.workloads import Prompt, default_prompts_path, load_prompts
from target_service.verifier import TargetModel

HF_TARGET = "hf_target_only"
HF_PROMPT_LOOKUP = "hf_prompt_lookup"


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=None, help="prompts.jsonl (default: ../shared/workloads/prompts.jsonl)")
    p.add_argument("--methods", default="none,ngram,suffix", help="comma list of none,ngram,suffix,draft_model,head")
    p.add_argument("--k", default="8", help="draft depth; a comma list benchmarks each (e.g. 2,4,8)")
    p.add_argument("--baselines", default=f"{HF_TARGET},{HF_PROMPT_LOOKUP}", help="comma list; empty for none")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kinds", default=None, help="comma list of workload kinds to keep (default: all)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap every prompt's max_tokens")
    p.add_argument("--target-model", default=None)
    p.add_argument("--draft-model", default=None, help="for draft_model: folder, hub id, .gguf or 'target'")
    p.add_argument("--head", default=None, metavar="DIR", help="for head: a trained head (default: the shipped one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", default="bench-results", help="folder for bench.json and bench.md")


@dataclass
class Sample:
    run: int
    system: str
    prompt_id: str
    kind: str
    tokens: int
    seconds: float
    exact: bool | None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    target_forward_passes: int = 0


@dataclass
class System:
    name: str
    run: Callable[[Prompt, list[int]], tuple[list[int], dict]]  # -> (generated ids, stats)
    reset: Callable[[], None] = lambda: None  # called at the start of every run


def hf_systems(target: LoadedModel, names: list[str], lookup_tokens: int) -> list[System]:
    model = target.model

    def make(extra: dict) -> Callable[[Prompt, list[int]], tuple[list[int], dict]]:
        def run(prompt: Prompt, ids: list[int]) -> tuple[list[int], dict]:
            x = torch.tensor([ids], device=target.device)
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=prompt.max_tokens, pad_token_id=min(target.eos_token_ids, default=0), **extra)
            return out[0, len(ids):].tolist(), {}

        return run

    table = {HF_TARGET: {}, HF_PROMPT_LOOKUP: {"prompt_lookup_num_tokens": lookup_tokens}}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; choose from {sorted(table)}")
    return [System(n, make(table[n])) for n in names]


def specd_system(name: str, engine: SpeculativeEngine, make_proposer_fn: Callable[[], object] | None = None) -> System:
    """make_proposer_fn: builds a fresh proposer at each run, so that no cross-request state (the
    suffix method's global tree) carries one run's outputs of a prompt into the next run."""

    def run(prompt: Prompt, ids: list[int]) -> tuple[list[int], dict]:
        params = SamplingParams(max_tokens=prompt.max_tokens)
        with torch.inference_mode():
            gen = engine.generate(ids, params).run()
        return gen.token_ids, gen.stats.to_dict()

    def reset() -> None:
        if make_proposer_fn is not None:
            engine.proposer = make_proposer_fn()  # type: ignore[assignment]

    return System(name, run, reset)


def build_systems(args: argparse.Namespace, target: LoadedModel) -> list[System]:
    baselines = [b for b in args.baselines.split(",") if b]
    systems = hf_systems(target, baselines, args.prompt_lookup_tokens)
    draft = head = None
    ks = [int(k) for k in str(args.k).split(",")]
    verifier = TargetModel(target)
    for method in [m for m in args.methods.split(",") if m]:
        if method == "draft_model" and draft is None:
            draft = target if args.draft_model in (None, "target") else load_model(args.draft_model, args.device, args.dtype)
        if method == "head" and head is None:
            from draft_service.head.checkpoint import load_head_for

            head = load_head_for(target, getattr(args, "head", None), args.target_model)
        for k in ([0] if method == "none" else ks):
            fresh = (lambda m=method: make_proposer(m, draft, head=head, max_context=target.max_context))
            engine = SpeculativeEngine(verifier, fresh(), k=k, eos_token_ids=target.eos_token_ids)
            systems.append(specd_system(f"specd_{method}" + (f"_k{k}" if method != "none" else ""), engine, fresh))
    return systems


def run_bench(args: argparse.Namespace) -> int:
    prompts = load_prompts(args.prompts or default_prompts_path())
    if args.kinds:
        keep = set(args.kinds.split(","))
        prompts = [p for p in prompts if p.kind in keep]
    if args.max_tokens:
        prompts = [p.with_max_tokens(min(p.max_tokens, args.max_tokens)) for p in prompts]
    target = load_model(args.target_model, device=args.device, dtype=args.dtype)
    systems = build_systems(args, target)
    encoded = {p.id: target.encode(p.prompt, chat=p.chat) for p in prompts}
    reference: dict[str, list[int]] = {}
    samples: list[Sample] = []
    _warm_up(systems, prompts[0], encoded[prompts[0].id])
    total = args.runs * len(prompts) * len(systems)
    done = 0
    for run in range(args.runs):
        for system in systems:
            system.reset()
        for prompt in prompts:
            for system in systems:
                start = time.perf_counter()
                ids, stats = system.run(prompt, encoded[prompt.id])
                seconds = time.perf_counter() - start
                if system.name == HF_TARGET:
                    reference.setdefault(prompt.id, ids)
                exact = ids == reference[prompt.id] if prompt.id in reference else None
                samples.append(Sample(run, system.name, prompt.id, prompt.kind, len(ids), seconds, exact,
                                      **{k: stats.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "target_forward_passes")}))
                done += 1
                print(f"[{done}/{total}] run {run + 1} {prompt.id:<14} {system.name:<22} {len(ids) / seconds:6.1f} tok/s"
                      + ("" if exact in (None, True) else "  (output differs from target-only!)"), file=sys.stderr, flush=True)
    report = summarize(samples, peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"args": vars(args), "report": report, "samples": [s.__dict__ for s in samples]}, indent=1))
    md = render_markdown(report)
    (out / "bench.md").write_text(md)
    print(md)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}", file=sys.stderr)
    return 0


def _warm_up(systems: list[System], prompt: Prompt, ids: list[int]) -> None:
    """One short untimed pass per system: first calls pay for allocator and kernel warm-up."""
    short = prompt.with_max_tokens(8)
    for system in systems:
        system.run(short, ids)


def summarize(samples: list[Sample], peak_rss_mb: float) -> dict:
    """Median tokens/s per (kind, system) over runs, and per-run ratios against the HF baseline."""
    per_run: dict[tuple[str, str, int], list[Sample]] = defaultdict(list)
    for s in samples:
        per_run[(s.kind, s.system, s.run)].append(s)
        per_run[("all", s.system, s.run)].append(s)
    tps: dict[tuple[str, str], list[float]] = defaultdict(list)
    run_tps: dict[tuple[str, str, int], float] = {}
    for (kind, system, run), group in per_run.items():
        value = sum(s.tokens for s in group) / sum(s.seconds for s in group)
        tps[(kind, system)].append(value)
        run_tps[(kind, system, run)] = value
    rows = []
    for (kind, system), values in sorted(tps.items()):
        group = [s for s in samples if s.system == system and (kind == "all" or s.kind == kind)]
        ratios = [run_tps[(kind, system, r)] / run_tps[(kind, HF_TARGET, r)] for (k2, s2, r) in run_tps
                  if k2 == kind and s2 == system and (kind, HF_TARGET, r) in run_tps]
        lookup = [run_tps[(kind, system, r)] / run_tps[(kind, HF_PROMPT_LOOKUP, r)] for (k2, s2, r) in run_tps
                  if k2 == kind and s2 == system and (kind, HF_PROMPT_LOOKUP, r) in run_tps]
        drafts = sum(s.num_drafts for s in group)
        draft_tokens = sum(s.num_draft_tokens for s in group)
        accepted = sum(s.num_accepted_tokens for s in group)
        tokens = sum(s.tokens for s in group)
        rows.append({
            "kind": kind,
            "system": system,
            "tokens_per_s": round(statistics.median(values), 2),
            "runs": len(values),
            "vs_target_only": round(statistics.median(ratios), 3) if ratios else None,
            "vs_prompt_lookup": round(statistics.median(lookup), 3) if lookup else None,
            "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
            "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else None,
            "target_passes_per_token": round(sum(s.target_forward_passes for s in group) / tokens, 3) if drafts or system.startswith("specd") else None,
            "exact": all(s.exact is not False for s in group),
        })
    return {"rows": rows, "peak_rss_mb": round(peak_rss_mb, 1), "torch_threads": torch.get_num_threads()}


def render_markdown(report: dict) -> str:
    def fmt(v: object) -> str:
        return "–" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    cols = ["kind", "system", "tokens_per_s", "vs_target_only", "vs_prompt_lookup", "acceptance_rate",
            "mean_acceptance_length", "target_passes_per_token", "exact"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in report["rows"]:
        lines.append("| " + " | ".join(fmt(row[c]) for c in cols) + " |")
    lines.append("")
    lines.append(f"Peak RSS of the bench process: {report['peak_rss_mb']} MB; torch threads: {report['torch_threads']}.")
    return "\n".join(lines) + "\n"
