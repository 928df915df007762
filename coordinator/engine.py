"""The speculative decoding loop, one request at a time, over a proposer and a verifier.

    prefill -> first token
    repeat: k = depth for this step (fixed, or the request's DepthController; never past
                max_tokens or the context)
            draft k tokens (skipped when k = 0; the draft session is opened on first use and
                closed while the controller keeps speculation off, so a disabled path costs nothing)
            verify them in one target pass -> accepted draft tokens + 1 target token
            tell the draft what was appended; emit the new tokens; check stop conditions

Pipelined drafting (`pipeline=True`): while the target verifies block n, the draft drafts block
n+1 as if block n were accepted whole (`propose_ahead`): its first token is a guess of the
target's bonus token. If the whole block is accepted and the bonus token equals that guess, the
rest of the pre-drafted block is the next proposal and the step needs no draft call; otherwise it
is dropped. Drafts are only proposals, so exactness does not depend on any of this: the verifier
alone decides what is emitted, and under sampling the pre-drafted tokens are still samples of q
given the (now confirmed) context.

Later transports (gRPC, Ray) plug different session objects into the same loop: the loop only
needs `prefill`, `verify`, `room` from the target session and `propose`, `append`, `close`
(and `propose_ahead` for pipelining; `start_ahead` if the transport can overlap it with the
verify call) from the draft session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

from coordinator.controller import DepthController, LoadSignal
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


class DepthPolicyLike(Protocol):
    """Per-request depth controllers and load signals (coordinator.depth.DepthPolicy)."""

    def controller(self, target: TargetSessionLike) -> DepthController: ...
    def load(self, target: TargetSessionLike) -> LoadSignal | None: ...


class _Done:
    """An already computed pre-drafted block (in-process sessions draft ahead synchronously)."""

    def __init__(self, proposal: Proposal):
        self.proposal = proposal

    def result(self) -> Proposal:
        return self.proposal


def _start_ahead(draft: DraftSession, assumed: list[int], k: int):
    start = getattr(draft, "start_ahead", None)
    if start is not None:
        return start(assumed, k)  # a remote call in flight: .result() waits for it
    return _Done(draft.propose_ahead(assumed, k))


def use_predrafted(accepted_whole: bool, target_token: int, block: Proposal) -> Proposal | None:
    """The next proposal from a block drafted ahead, or None when it must be dropped.

    The block was drafted after the verified block, assumed accepted whole; its first token is the
    draft's guess of the target's bonus token. It continues the real sequence only if the whole
    block was accepted and the target's token equals that guess.
    """
    if not accepted_whole or not block.tokens or block.tokens[0] != target_token:
        return None
    probs = block.probs[1:] if block.probs is not None else None
    return Proposal(block.tokens[1:], probs)


def _truncate(proposal: Proposal, k: int) -> Proposal:
    if len(proposal.tokens) <= k:
        return proposal
    return Proposal(proposal.tokens[:k], proposal.probs[:k] if proposal.probs is not None else None)


class SpeculativeEngine:
    """Runs requests against one verifier and (optionally) one proposer, in this process.

    Depth: a fixed `k`, or `depth` (a DepthPolicy) giving each request its own controller.
    """

    def __init__(
        self,
        verifier: VerifierLike,
        proposer: Proposer | None,
        k: int = 4,
        eos_token_ids: frozenset[int] = frozenset(),
        decode: Callable[[list[int]], str] | None = None,
        depth: DepthPolicyLike | None = None,
        pipeline: bool = False,
    ):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.verifier = verifier
        self.proposer = proposer
        self.k = k if proposer is not None else 0
        self.depth = depth if proposer is not None else None
        self.pipeline = pipeline and proposer is not None
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
        controller = self.depth.controller(target) if self.depth is not None else None
        draft: DraftSession | None = None
        predrafted: Proposal | None = None  # the next block, drafted during the last verify
        try:
            first = target.prefill()
            gen.stats.target_forward_passes += 1
            gen.time_to_first_token = time.perf_counter() - start
            out, gen.finish_reason = stopper.accept(gen.token_ids, [first])
            gen.token_ids.extend(out)
            yield out
            while gen.finish_reason is None:
                if target.room <= 0:
                    gen.finish_reason = FINISH_LENGTH
                    break
                limit = min(params.max_tokens - len(gen.token_ids) - 1, target.room - 1)
                if controller is not None:
                    wanted = controller.choose(self.depth.load(target))  # type: ignore[union-attr]
                else:
                    wanted = self.k
                k = min(wanted, limit)
                draft_s = 0.0
                proposal = Proposal()
                if k > 0:
                    if predrafted is not None:
                        proposal = _truncate(predrafted, k)
                    else:
                        if draft is None:
                            draft = self.proposer.open_session(gen.prompt_ids + gen.token_ids, params)  # type: ignore[union-attr]
                        t = time.perf_counter()
                        proposal = draft.propose(k)
                        draft_s = time.perf_counter() - t
                elif draft is not None and wanted == 0:  # speculation is off for now: free the draft's state
                    draft.close()
                    draft = None
                predrafted = None
                ahead = None
                if self.pipeline and draft is not None and proposal.tokens and wanted > 0:
                    ahead = _start_ahead(draft, list(proposal.tokens), wanted + 1)
                t = time.perf_counter()
                outcome = target.verify(proposal)
                verify_s = time.perf_counter() - t
                if ahead is not None:
                    t = time.perf_counter()
                    predrafted = use_predrafted(outcome.num_accepted == len(proposal.tokens), outcome.tokens[-1],
                                                ahead.result())
                    draft_s += time.perf_counter() - t
                    gen.stats.record_pipeline(predrafted is not None)
                gen.stats.record_step(len(proposal.tokens), outcome.num_accepted)
                gen.stats.k_per_step.append(len(proposal.tokens))
                if controller is not None:
                    controller.observe(len(proposal.tokens), outcome.num_accepted, draft_s * 1000, verify_s * 1000,
                                       getattr(outcome, "batch_size", 1))
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
