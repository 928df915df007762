"""The three services in this process on a tiny random model with the default tokenizer, through
the same start functions `specd serve` uses: cheap enough for many requests (fuzzing, bad input).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specd.config import CoordinatorConfig, DraftConfig, TargetConfig
from specd.grpc_server import ServerHandle
from specd.models import load_tokenizer, save_tiny_random_model
from specd.serve import start_coordinator, start_draft, start_target
from specd.telemetry import noop_telemetry

TINY_CONTEXT = 128


def save_tiny_model(folder: Path, max_context: int = TINY_CONTEXT) -> Path:
    """A 2-layer random Llama with the default model's tokenizer and vocabulary."""
    tokenizer = load_tokenizer()
    return save_tiny_random_model(folder, vocab_size=len(tokenizer), hidden_size=32, tokenizer_from=tokenizer,
                                  max_position_embeddings=max_context, seed=3)


@dataclass
class InProcessStack:
    target: ServerHandle
    draft: ServerHandle
    coordinator: ServerHandle

    def address(self, name: str) -> str:
        return f"127.0.0.1:{getattr(self, name).port}"

    def stop(self) -> None:
        for handle in (self.coordinator, self.draft, self.target):
            handle.drain(0)


def start_inprocess_stack(model_dir: Path, coordinator_overrides: dict | None = None,
                          target_overrides: dict | None = None) -> InProcessStack:
    common = {"host": "127.0.0.1", "port": 0, "grace_seconds": 1.0, "log_level": "WARNING"}
    target = start_target(TargetConfig(**common, model=str(model_dir), max_workers=32, **(target_overrides or {})),
                          telemetry=noop_telemetry())
    draft = start_draft(DraftConfig(**common, model=str(model_dir), method="ngram", max_workers=32),
                        telemetry=noop_telemetry())
    try:
        coordinator = start_coordinator(CoordinatorConfig(
            **common, target=(f"127.0.0.1:{target.port}",), draft=(f"127.0.0.1:{draft.port}",),
            tokenizer_model=str(model_dir), method="ngram", **(coordinator_overrides or {})), telemetry=noop_telemetry())
    except BaseException:
        target.drain(0)
        draft.drain(0)
        raise
    return InProcessStack(target, draft, coordinator)
