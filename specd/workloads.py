"""The prompts.jsonl workload format: id, kind, chat, prompt, max_tokens."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    chat: bool
    prompt: str
    max_tokens: int

    def with_max_tokens(self, n: int) -> "Prompt":
        return dataclasses.replace(self, max_tokens=n)


def default_prompts_path() -> Path:
    """../shared/workloads/prompts.jsonl beside the checkout (the public benchmark prompts)."""
    here = Path(__file__).resolve().parents[1]
    for candidate in (here.parent / "shared" / "workloads" / "prompts.jsonl", here / "shared" / "workloads" / "prompts.jsonl"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("no prompts file found: pass --prompts FILE (the shared/workloads/prompts.jsonl format)")


def load_prompts(path: str | Path) -> list[Prompt]:
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            prompts.append(Prompt(d["id"], d["kind"], bool(d.get("chat", False)), d["prompt"], int(d["max_tokens"])))
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a prompt record ({exc})") from exc
    return prompts


def prompts_of_kind(prompts: list[Prompt], kind: str, max_tokens: int) -> list[Prompt]:
    """The prompts of one kind, each capped at `max_tokens`; ValueError naming the kinds there are
    when there are none of it."""
    chosen = [p.with_max_tokens(min(p.max_tokens, max_tokens)) for p in prompts if p.kind == kind]
    if not chosen:
        raise ValueError(f"no prompts of kind {kind!r}; the kinds are {', '.join(sorted({p.kind for p in prompts}))}")
    return chosen
