"""The speculative decoding loop, one request at a time, over a proposer and a verifier.

    prefill -> first token
    repeat: k = depth for this step (never past max_tokens or the context)
            draft k tokens (skipped when k = 0)
            verify them in one target pass -> accepted draft tokens + 1 target token
            tell the draft what was appended; emit the new tokens; check stop conditions

Later transports (gRPC, Ray) plug different session objects into the same loop: the loop only
needs `prefill`, `verify`, `room` from the target session and `propose`, `append`, `close` from
the draft session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

from coordinator.stats import SpecStats
from draft_service.proposers.base import DraftSession, Proposal, Proposer
from specd.sampling import SamplingParams
from target_service.rejection_sampler import VerifyOutcome


class TargetSessionLike(Protocol):
    @property
    def room(self) -> int: ...
    def prefill(self) -> int: ...
    def verify(self, proposal: Proposal) -> VerifyOutcome: ...
    def close(self) -> None: ...


class VerifierLike(Protocol):
    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> TargetSessionLike: ...


FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class Generation:
    """A request in flight: iterate it for token chunks; when done, the fields hold the outcome."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    time_to_first_token: float | None = None
    duration: float | None = None
    chunks: Iterator[list[int]] | None = None

    def __iter__(self) -> Iterator[list[int]]:
        assert self.chunks is not None
        return self.chunks

    def run(self) -> "Generation":
        """Drain the stream; return self with every field filled."""
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Stop early (client gone, deadline passed): closes the sessions on both sides."""
        if self.chunks is not None:
            self.chunks.close()  # type: ignore[attr-defined]


class StopChecker:
    """Decides where generation stops: EOS, stop token ids, max_tokens, stop strings.

    Stop strings need text: `decode` turns the generated ids into text, and the check only looks
    at the text that the newest tokens could have completed.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int], decode: Callable[[list[int]], str] | None):
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.decode = decode if params.stop else None
        self.text_len = 0

    def accept(self, generated: list[int], new: list[int]) -> tuple[list[int], str | None]:
        """Return the prefix of `new` to emit after `generated`, and a finish reason if it ends here."""
        remaining = self.params.max_tokens - len(generated)
        out: list[int] = []
        for token in new[:remaining]:
            out.append(token)
            if token in self.stop_ids:
                return out, FINISH_STOP
        if self.decode is not None and self._hits_stop_string(generated, out):
            return out, FINISH_STOP
        if len(generated) + len(out) >= self.params.max_tokens:
            return out, FINISH_LENGTH
        return out, None

    def _hits_stop_string(self, generated: list[int], out: list[int]) -> bool:
        assert self.decode is not None
        text = self.decode(generated + out)
        window = max(len(s) for s in self.params.stop)
        start = max(0, self.text_len - window + 1)
        self.text_len = len(text)
        return any(s in text[start:] for s in self.params.stop)


class SpeculativeEngine:
    """Runs requests against one verifier and (optionally) one proposer, in this process."""

    def __init__(
        self,
        verifier: VerifierLike,
        proposer: Proposer | None,
        k: int = 4,
        eos_token_ids: frozenset[int] = frozenset(),
        decode: Callable[[list[int]], str] | None = None,
    ):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.verifier = verifier
        self.proposer = proposer
        self.k = k if proposer is not None else 0
        self.eos_token_ids = eos_token_ids
        self.decode = decode

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        params.validate()
        gen = Generation(prompt_ids=list(prompt_ids))
        target = self.verifier.open_session(gen.prompt_ids, params)  # validates the prompt now
        gen.chunks = self._loop(gen, target, params)
        return gen

    def _loop(self, gen: Generation, target: TargetSessionLike, params: SamplingParams) -> Iterator[list[int]]:
        start = time.perf_counter()
        stopper = StopChecker(params, self.eos_token_ids, self.decode)
        draft: DraftSession | None = None
        try:
            first = target.prefill()
            gen.stats.target_forward_passes += 1
            gen.time_to_first_token = time.perf_counter() - start
            out, gen.finish_reason = stopper.accept(gen.token_ids, [first])
            gen.token_ids.extend(out)
            yield out
            if self.k > 0 and gen.finish_reason is None:
                draft = self.proposer.open_session(gen.prompt_ids, params)  # type: ignore[union-attr]
                draft.append(out)
            while gen.finish_reason is None:
                if target.room <= 0:
                    gen.finish_reason = FINISH_LENGTH
                    break
                k = min(self.k, params.max_tokens - len(gen.token_ids) - 1, target.room - 1)
                proposal = draft.propose(k) if draft is not None and k > 0 else Proposal()
                outcome = target.verify(proposal)
                gen.stats.record_step(len(proposal.tokens), outcome.num_accepted)
                if draft is not None:
                    draft.append(outcome.tokens)
                out, gen.finish_reason = stopper.accept(gen.token_ids, outcome.tokens)
                gen.token_ids.extend(out)
                yield out
        finally:
            gen.duration = time.perf_counter() - start
            if draft is not None:
                draft.close()
            target.close()
