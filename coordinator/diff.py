"""`specd diff`: a rollout check that speculation changes nothing but speed.

Every prompt of a prompts file (the shared/workloads/prompts.jsonl format) is generated greedily
twice, with speculation off (the baseline) and on (each method asked for), embedded or through a
running coordinator, and the token ids are compared. Greedy speculative decoding must reproduce
the baseline token for token, so any difference is a bug (a verifier that accepts a wrong token, a
batched pass that changes an argmax, a draft cache out of step...). The report gives, per prompt
and method: identical or the first differing position with both tokens decoded, the acceptance
rate, the mean acceptance length and the speed-up over the baseline. The exit status is 0 only
when every output is identical.

The comparison is pure (`first_difference`, `compare`, `summarize`, `format_table`); the runners
(`EmbeddedRunner`, `RemoteRunner`) only produce token ids, statistics and times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol, Sequence

from specd.sampling import SamplingParams
from specd.workloads import Prompt, default_prompts_path, load_prompts

METHODS = ("ngram", "suffix", "draft_model")
END = None  # a Difference's token where that output had already ended


# --- the comparison (pure) -------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    """One generation: its token ids, its duration and its speculation counters."""

    token_ids: list[int]
    seconds: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True)
class Difference:
    """Where two outputs first disagree; a token is None where that output had already ended."""

    position: int
    baseline_token: int | None
    speculative_token: int | None


def first_difference(baseline: Sequence[int], speculative: Sequence[int]) -> Difference | None:
    """The first position where the two token sequences differ (a missing token counts as a
    difference, so one output being a prefix of the other is caught); None when identical."""
    for i, (a, b) in enumerate(zip(baseline, speculative)):
        if a != b:
            return Difference(i, a, b)
    if len(baseline) == len(speculative):
        return None
    n = min(len(baseline), len(speculative))
    return Difference(n, baseline[n] if n < len(baseline) else END, speculative[n] if n < len(speculative) else END)


def acceptance_rate(num_draft_tokens: int, num_accepted_tokens: int) -> float:
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0


def mean_acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float:
    """Tokens per drafted verify step, 1 + accepted / drafts (vLLM's definition); 0 without drafts."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else 0.0


def speedup(baseline_seconds: float, speculative_seconds: float) -> float:
    """How many times faster speculation was (0 when a time is missing)."""
    if baseline_seconds <= 0 or speculative_seconds <= 0:
        return 0.0
    return baseline_seconds / speculative_seconds


@dataclass
class DiffRow:
    """One prompt under one method, against its baseline."""

    prompt_id: str
    method: str
    k: str
    identical: bool
    position: int | None  # the first differing token position (0-based), None when identical
    baseline_token: str | None  # the tokens there, decoded ("<end>" where that output had ended)
    speculative_token: str | None
    baseline_token_id: int | None
    speculative_token_id: int | None
    baseline_tokens: int
    speculative_tokens: int
    acceptance_rate: float
    mean_acceptance_length: float
    speedup: float
    baseline_s: float
    speculative_s: float
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0


def _show(token: int | None, decode: Callable[[list[int]], str]) -> str:
    return "<end>" if token is None else repr(decode([token]))


def compare(prompt_id: str, method: str, k: str, baseline: RunResult, speculative: RunResult,
            decode: Callable[[list[int]], str]) -> DiffRow:
    diff = first_difference(baseline.token_ids, speculative.token_ids)
    return DiffRow(
        prompt_id=prompt_id, method=method, k=k, identical=diff is None,
        position=None if diff is None else diff.position,
        baseline_token=None if diff is None else _show(diff.baseline_token, decode),
        speculative_token=None if diff is None else _show(diff.speculative_token, decode),
        baseline_token_id=None if diff is None else diff.baseline_token,
        speculative_token_id=None if diff is None else diff.speculative_token,
        baseline_tokens=len(baseline.token_ids), speculative_tokens=len(speculative.token_ids),
        acceptance_rate=acceptance_rate(speculative.num_draft_tokens, speculative.num_accepted_tokens),
        mean_acceptance_length=mean_acceptance_length(speculative.num_drafts, speculative.num_accepted_tokens),
        speedup=speedup(baseline.seconds, speculative.seconds),
        baseline_s=baseline.seconds, speculative_s=speculative.seconds,
        num_draft_tokens=speculative.num_draft_tokens, num_accepted_tokens=speculative.num_accepted_tokens,
        num_drafts=speculative.num_drafts,
    )


def summarize(rows: Sequence[DiffRow]) -> dict[str, dict[str, Any]]:
    """Per method: outputs compared and identical, pooled acceptance rate and mean acceptance
    length (token-weighted, as the Prometheus counters pool them) and the speed-up in total time."""
    out: dict[str, dict[str, Any]] = {}
    for method in dict.fromkeys(r.method for r in rows):
        rs = [r for r in rows if r.method == method]
        drafted = sum(r.num_draft_tokens for r in rs)
        accepted = sum(r.num_accepted_tokens for r in rs)
        out[method] = {
            "outputs": len(rs),
            "identical": sum(r.identical for r in rs),
            "differing": [r.prompt_id for r in rs if not r.identical],
            "acceptance_rate": round(acceptance_rate(drafted, accepted), 4),
            "mean_acceptance_length": round(mean_acceptance_length(sum(r.num_drafts for r in rs), accepted), 4),
            "speedup": round(speedup(sum(r.baseline_s for r in rs), sum(r.speculative_s for r in rs)), 4),
        }
    return out


def all_identical(rows: Sequence[DiffRow]) -> bool:
    return bool(rows) and all(r.identical for r in rows)


def _result_cell(r: DiffRow) -> str:
    if r.identical:
        return "identical"
    return f"DIFFERS at token {r.position}: {r.baseline_token} (off) vs {r.speculative_token} (on)"


def format_table(rows: Sequence[DiffRow]) -> str:
    """The report as an aligned text table plus one summary line per method."""
    header = ("prompt", "method", "k", "result", "acceptance", "mean len", "speed-up")
    body = [(r.prompt_id, r.method, r.k, _result_cell(r), f"{r.acceptance_rate:.2f}", f"{r.mean_acceptance_length:.2f}",
             f"{r.speedup:.2f}x") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    right = {4, 5, 6}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [line(header), line(["-" * w for w in widths]), *(line(b) for b in body), ""]
    for method, s in summarize(rows).items():
        verdict = "all identical" if not s["differing"] else f"{len(s['differing'])} DIFFER ({', '.join(s['differing'])})"
        lines.append(f"{method}: {s['identical']}/{s['outputs']} identical, {verdict}; acceptance {s['acceptance_rate']:.2f}, "
                     f"mean acceptance length {s['mean_acceptance_length']:.2f}, speed-up {s['speedup']:.2f}x")
    return "\n".join(lines)


def report(rows: Sequence[DiffRow], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON report: what ran, `identical` overall, the summary per method and every row."""
    return {**meta, "identical": all_identical(rows), "summary": summarize(rows), "rows": [asdict(r) for r in rows]}


# --- running the prompts ---------------------------------------------------------------------


class Runner(Protocol):
    """Generates one prompt greedily with a method ("none": speculation off) and a depth."""

    def run(self, prompt: Prompt, method: str, k: int | str | None, max_tokens: int) -> RunResult: ...

    def decode(self, ids: list[int]) -> str: ...


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


class EmbeddedRunner:
    """The engine in this process, on one loaded target; one engine per (method, k), built once.

    `wrap_verifier` replaces the speculative engines' verifier (never the baseline's), which is how
    the tests plug in a deliberately broken one.
    """

    def __init__(self, target: Any, draft_model: str | None = None, device: str = "cpu", dtype: str | None = None,
                 wrap_verifier: Callable[[Any], Any] | None = None):
        self.target = target
        self.draft_model = draft_model
        self.device = device
        self.dtype = dtype
        self.wrap_verifier = wrap_verifier
        self._engines: dict[tuple[str, str], Any] = {}

    def _engine(self, method: str, k: int | str | None) -> Any:
        from coordinator.embedded import EngineOptions, build_engine

        key = (method, str(k))
        if key not in self._engines:
            opts = EngineOptions(method=method, draft_model=self.draft_model, device=self.device, dtype=self.dtype)
            if method == "none":
                opts.k = 0
            elif k is not None:
                opts.k = k
            engine, _ = build_engine(opts, target=self.target)
            if method != "none" and self.wrap_verifier is not None:
                engine.verifier = self.wrap_verifier(engine.verifier)
            self._engines[key] = engine
        return self._engines[key]

    def warm_up(self) -> None:
        """One short generation, so the first prompt's baseline does not pay the first forward pass."""
        self._engine("none", 0).generate(self.target.encode("Hello"), _greedy(2)).run()

    def run(self, prompt: Prompt, method: str, k: int | str | None, max_tokens: int) -> RunResult:
        engine = self._engine(method, k)
        gen = engine.generate(self.target.encode(prompt.prompt, chat=prompt.chat), _greedy(max_tokens)).run()
        s = gen.stats
        return RunResult(list(gen.token_ids), gen.duration or 0.0, s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.target.decode(ids)


class RemoteRunner:
    """A running coordinator; the baseline asks it for method none. Times are the coordinator's
    own (`GenerateResult.timings.duration_ms`), so network jitter to this client does not count."""

    def __init__(self, client: Any, tokenizer: Any | None = None):
        self.client = client
        self.tokenizer = tokenizer

    def warm_up(self) -> None:
        pass

    def run(self, prompt: Prompt, method: str, k: int | str | None, max_tokens: int) -> RunResult:
        from coordinator.client import build_request

        request = build_request(prompt.prompt, _greedy(max_tokens), chat=prompt.chat, method=method or None,
                                k=0 if method == "none" else k)
        result = self.client.generate(request)
        s = result.stats
        return RunResult(list(result.token_ids), result.timings.duration_ms / 1000, s.num_drafts, s.num_draft_tokens,
                         s.num_accepted_tokens)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return f"id {ids[0]}" if len(ids) == 1 else str(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def run_diff(prompts: Sequence[Prompt], runner: Runner, methods: Sequence[str], k: int | str | None,
             max_tokens: int | None = None, progress: bool = True) -> list[DiffRow]:
    """Baseline once per prompt, then each method; rows in prompt order, methods within a prompt."""
    from tqdm import tqdm

    k_label = "default" if k is None else str(k)
    rows: list[DiffRow] = []
    with tqdm(total=len(prompts) * (1 + len(methods)), desc="specd diff", unit="run", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        for p in prompts:
            n = p.max_tokens if max_tokens is None else min(p.max_tokens, max_tokens)
            bar.set_postfix_str(f"{p.id} off")
            baseline = runner.run(p, "none", 0, n)
            bar.update()
            for method in methods:
                bar.set_postfix_str(f"{p.id} {method}")
                rows.append(compare(p.id, method, k_label, baseline, runner.run(p, method, k, n), runner.decode))
                bar.update()
    return rows


# --- the command -----------------------------------------------------------------------------


def add_diff_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompts file in the shared/workloads/prompts.jsonl format (default: the shared workload)")
    p.add_argument("--method", default=None, metavar="M[,M...]",
                   help=f"method(s) to compare against no speculation, comma-separated, from {', '.join(METHODS)} "
                        "(default: ngram embedded; the coordinator's default with --address)")
    p.add_argument("--k", default=None, metavar="auto|K",
                   help="draft depth: a fixed k, or auto (the adaptive controller) (default: the engine's, or the "
                        "coordinator's with --address)")
    p.add_argument("--address", default=None, metavar="HOST:PORT", help="a running coordinator (default: run embedded)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the report as JSON to FILE (or, with no FILE, to stdout instead of the table)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap every prompt's max_tokens (default: the file's)")
    p.add_argument("--draft-model", default=None, help="draft model for method draft_model, embedded: hub id, folder, "
                                                       ".gguf, or 'target'")
    p.add_argument("--target-model", default=None, help="target model, embedded (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer", default=None,
                   help="with --address: the tokenizer to show differing tokens with (default: --target-model's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def parse_methods(text: str | None, remote: bool) -> list[str]:
    """The methods to compare; [""] (the coordinator's default) when none is given remotely."""
    from specd.errors import InvalidArgument

    if text is None:
        return [""] if remote else ["ngram"]
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if not methods or bad:
        raise InvalidArgument("method", f"choose from {', '.join(METHODS)} (comma-separated), got {text!r}")
    return list(dict.fromkeys(methods))


def parse_k(text: str | None) -> int | str | None:
    from specd.errors import InvalidArgument

    if text is None:
        return None
    text = text.strip()
    if text.isdigit():
        if int(text) == 0:
            raise InvalidArgument("k", "k = 0 turns speculation off; there would be nothing to compare")
        return int(text)
    if not text:
        raise InvalidArgument("k", "empty")
    return text  # "auto" or another depth policy: the engine (or coordinator) validates it


def _runner(args: argparse.Namespace, client_options: dict[str, Any] | None) -> tuple[Any, Callable[[], None]]:
    """The runner the flags ask for, and what closes it; `client_options` (token, TLS) go to the
    coordinator client."""
    if args.address:
        from coordinator.client import CoordinatorClient
        from specd.models import load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer or args.target_model)
        except Exception as exc:  # only for showing tokens: ids will do
            print(f"specd diff: no tokenizer ({exc}); differing tokens are shown as ids", file=sys.stderr)
            tokenizer = None
        client = CoordinatorClient(args.address, **(client_options or {}))
        return RemoteRunner(client, tokenizer), client.close
    from specd.models import load_model

    target = load_model(args.target_model, device=args.device, dtype=args.dtype)
    return EmbeddedRunner(target, args.draft_model, args.device, args.dtype), lambda: None


def diff_main(args: argparse.Namespace, runner: Any | None = None, client_options: dict[str, Any] | None = None) -> int:
    """`specd diff`: 0 when every output is identical, 1 when any differs. `runner` replaces the
    one the flags ask for (tests); `client_options` are CoordinatorClient's (token, tls)."""
    remote = bool(args.address)
    methods = parse_methods(args.method, remote)
    k = parse_k(args.k)
    prompts = load_prompts(args.prompts or default_prompts_path())
    if args.max_tokens is not None and args.max_tokens < 1:
        from specd.errors import InvalidArgument

        raise InvalidArgument("max_tokens", f"must be at least 1, got {args.max_tokens}")
    close: Callable[[], None] = lambda: None
    if runner is None:
        runner, close = _runner(args, client_options)
    try:
        runner.warm_up()
        start = time.perf_counter()
        rows = run_diff(prompts, runner, methods, k, args.max_tokens, progress=not args.no_progress)
    finally:
        close()
    for r in rows:
        r.method = r.method or "default"
    meta = {"mode": "remote" if remote else "embedded", "address": args.address, "prompts": str(args.prompts or "default"),
            "methods": [m or "default" for m in methods], "k": "default" if k is None else str(k),
            "max_tokens": args.max_tokens, "seconds": round(time.perf_counter() - start, 3)}
    doc = report(rows, meta)
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=2)
    bad = [r for r in rows if not r.identical]
    if bad:
        for r in bad:
            print(f"specd diff: {r.prompt_id} ({r.method}) differs at token {r.position}: "
                  f"{r.baseline_token} without speculation, {r.speculative_token} with it", file=sys.stderr)
        return 1
    return 0 if rows else 1
