"""Speculation counters, named after vLLM's spec-decode metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    target_forward_passes: int = 0  # prefill included
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted
    k_per_step: list[int] = field(default_factory=list)  # draft tokens sent at each verify step
    pipeline_hits: int = 0  # pipelined steps whose pre-drafted next block was used
    pipeline_misses: int = 0  # ... and dropped

    def record_pipeline(self, hit: bool) -> None:
        if hit:
            self.pipeline_hits += 1
        else:
            self.pipeline_misses += 1

    def record_step(self, num_draft: int, num_accepted: int) -> None:
        self.target_forward_passes += 1
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position.extend([0] * (num_accepted - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per drafted verify step: 1 + accepted / drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = round(self.acceptance_rate, 4)
        d["mean_acceptance_length"] = round(self.mean_acceptance_length, 4)
        return d
