"""The speculative decoding loop, one request at a time, over a proposer and a verifier.

    prefill -> first token
    repeat: k = depth for this step (fixed, or the request's DepthController; never past
                max_tokens or the context)
            draft k tokens (skipped when k = 0, and for an auto session of the n-gram proposer
                when the context holds no match for it to draft from; the draft session is opened
                on first use and closed while the controller keeps speculation off, so a disabled
                path costs nothing)
            verify them in one target pass -> accepted draft tokens + 1 target token
            tell the draft what was appended; check stop conditions; emit the new tokens
            (with a session that sends and reads a verify in two calls, the remote one, a
            step's tokens are emitted once the next step's block is sent: the client's share
            of the step overlaps the target's pass)

Pipelined drafting (`pipeline=True`): while the target verifies block n, the draft drafts block
n+1 as if block n were accepted whole (`propose_ahead`): its first token is a guess of the
target's bonus token. If the whole block is accepted and the bonus token equals that guess, the
rest of the pre-drafted block is the next proposal and the step needs no draft call; otherwise it
is dropped. Drafts are only proposals, so exactness does not depend on any of this: the verifier
alone decides what is emitted, and under sampling the pre-drafted tokens are still samples of q
given the (now confirmed) context.

Replica failures (coordinator/failover.py): every draft call goes through a `DraftLink`, which
turns a failed or slow draft into an empty proposal (k = 0 for that step) and re-opens the draft
session after a backoff; every target call goes through a `TargetLink`, which re-opens a failed
session on another replica from the prompt plus the tokens emitted so far and continues.

Later transports (gRPC, Ray) plug different session objects into the same loop: the loop only
needs `prefill`, `verify` (or `start_verify`), `room` from the target session and `propose`, `append`, `close`
(and `propose_ahead` for pipelining; `start_ahead` if the transport can overlap it with the
verify call) from the draft session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

from coordinator.acceptance import SessionRecord, SharedAcceptance
from coordinator.controller import CostModel, DepthController, LoadSignal
from coordinator.echo import ECHO_METHODS, EchoLookup, ShadowDraft, echo_hit
from coordinator.failover import (DraftLink, FailoverOutcome, FaultHook, TargetLink, TargetSessionLike,  # noqa: F401
                                  VerifierLike)
from coordinator.stats import SpecStats
from draft_service.proposers.base import Proposal, Proposer
from specd.sampling import SamplingParams


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
    faults: list[tuple[str, str]] = field(default_factory=list)  # (service, reason) per replica failure survived or not

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

    def controller(self, target: TargetSessionLike, method: str) -> DepthController: ...
    def load(self, target: TargetSessionLike) -> LoadSignal | None: ...


class CostModelsLike(Protocol):
    """The cost model and the acceptance record a replica's sessions of one drafting method share
    (coordinator.depth.DepthPolicy)."""

    def cost_model(self, target: TargetSessionLike, method: str) -> CostModel: ...
    def acceptance(self, target: TargetSessionLike, method: str) -> SharedAcceptance: ...


def _step_costs(outcome: Any, open_ms: float) -> dict[str, Any]:
    """What a verify outcome says about its pass, as `CostModel.observe_step`'s keyword arguments
    (a verifier that does not report a field gets that field's "not reported" value)."""
    return dict(batch_size=getattr(outcome, "batch_size", 1),
                pass_block_length=getattr(outcome, "pass_block_length", 0),
                compute_ms=getattr(outcome, "compute_ms", None), open_ms=open_ms,
                pass_positions=getattr(outcome, "pass_positions", 0), packed=getattr(outcome, "packed", None),
                pass_id=getattr(outcome, "pass_id", 0))


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


def _pass_features(target: TargetLink, draft: DraftLink | None, step: int) -> None:
    """Hand the features the target just kept to a draft that reads them (method head)."""
    if draft is not None and draft.features is not None:
        new = target.new_features()
        if new is not None:
            draft.add_features(*new, step)


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
        on_fault: FaultHook | None = None,
        cost_models: CostModelsLike | None = None,
    ):
        """on_fault(service, reason): called for every replica failure a request meets (metrics).
        cost_models: where a fixed k's steps record their draft and verify times and its
        acceptance (without it, a replica's cost model and its method's record of acceptance learn
        only from the sessions that have a controller)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.verifier = verifier
        self.proposer = proposer
        self.k = k if proposer is not None else 0
        self.depth = depth if proposer is not None else None
        self.cost_models = cost_models if proposer is not None else None
        self.pipeline = pipeline and proposer is not None
        self.eos_token_ids = eos_token_ids
        self.decode = decode
        self.on_fault = on_fault

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        params.validate()
        gen = Generation(prompt_ids=list(prompt_ids))
        target = self.verifier.open_session(gen.prompt_ids, params)  # validates the prompt now
        gen.chunks = self._loop(gen, target, params)
        return gen

    def _loop(self, gen: Generation, session: TargetSessionLike, params: SamplingParams) -> Iterator[list[int]]:
        start = time.perf_counter()
        stopper = StopChecker(params, self.eos_token_ids, self.decode)
        controller = self.depth.controller(session, self.proposer.name) if self.depth is not None else None  # type: ignore[union-attr]
        # a fixed k has no controller, but its passes still teach its replica's cost model
        costs = self.cost_models.cost_model(session, self.proposer.name) \
            if controller is None and self.cost_models is not None else None  # type: ignore[union-attr]
        # and its acceptance joins the method's record that new auto sessions start from
        record = SessionRecord(self.cost_models.acceptance(session, self.proposer.name)) \
            if costs is not None else None  # type: ignore[union-attr]

        def fault(service: str, reason: str) -> None:
            gen.faults.append((service, reason))
            if self.on_fault is not None:
                self.on_fault(service, reason)

        draft = DraftLink(self.proposer, params, fault) if self.proposer is not None else None
        target = TargetLink(self.verifier, session, gen.prompt_ids, params, fault,
                            want_features=draft is not None and draft.features is not None)
        context = lambda: gen.prompt_ids + gen.token_ids  # noqa: E731  (the draft session opens on it)
        predrafted: Proposal | None = None  # the next block, drafted during the last verify
        # a k = 0 step of a context drafter checks whether its token echoes the context (coordinator/echo.py)
        echoing = controller is not None and controller.mode == "auto" and self.proposer is not None \
            and self.proposer.name in ECHO_METHODS
        if controller is not None:
            controller.echoes = echoing
        # for the n-gram proposer the lookup also knows the block it would draft: k = 0 steps judge
        # it against the output that follows, a free trial (coordinator/echo.py's ShadowDraft)
        shadow = ShadowDraft() if echoing and self.proposer.name == "ngram" else None  # type: ignore[union-attr]
        # and whether it would draft anything at all: a step whose lookup finds no match asks the
        # draft nothing (it would send an empty block back, a round trip for nothing)
        if controller is not None:
            controller.match_gated = controller.shadowed = shadow is not None
        step = 0
        try:
            first = target.prefill(gen.token_ids)
            _pass_features(target, draft, step)
            gen.stats.target_forward_passes += 1
            gen.time_to_first_token = time.perf_counter() - start
            out, gen.finish_reason = stopper.accept(gen.token_ids, [first])
            gen.token_ids.extend(out)
            echo = EchoLookup(context()) if echoing else None
            yield out
            held: list[int] | None = None  # the last step's tokens, streamed once the next step is sent
            while gen.finish_reason is None:
                step += 1
                if target.session.room <= 0:
                    gen.finish_reason = FINISH_LENGTH
                    break
                limit = min(params.max_tokens - len(gen.token_ids) - 1, target.session.room - 1)
                if controller is not None:
                    load = self.depth.load(target.session)  # type: ignore[union-attr]
                    wanted = controller.choose(load, remaining=limit + 1)
                else:
                    wanted = self.k
                k = min(wanted, limit)
                draft_s = open_s = 0.0
                proposal = Proposal()
                if k > 0 and draft is not None:
                    if predrafted is not None:
                        proposal = _truncate(predrafted, k)
                    elif shadow is not None and not echo.ngram_draft(1):  # type: ignore[union-attr]
                        pass  # the n-gram's lookup finds nothing to draft here: no call (`match_gated`)
                    else:
                        t = time.perf_counter()
                        proposal = draft.propose(context, k, step)
                        # Opening the draft session (a new stream, the draft's prefill) is not a
                        # cost per step: counted in, it priced every later k as if it reopened one.
                        open_s = draft.open_s
                        draft_s = time.perf_counter() - t - open_s
                elif draft is not None and wanted == 0:  # speculation is off for now: free the draft's state
                    draft.close()
                predrafted = None
                ahead = None
                if self.pipeline and draft is not None and proposal.tokens and wanted > 0:
                    ahead = draft.start_ahead(list(proposal.tokens), wanted + 1, step)
                if held is not None and not target.overlaps:
                    yield held  # an in-process verify runs in the call: stream first
                    held = None
                t = time.perf_counter()
                pending = target.start_verify(proposal, gen.token_ids)
                if held is not None:
                    # Sent: the last step's tokens go to the client while the target verifies. At
                    # 16 sessions the coordinator's per-step work is serialized by its interpreter
                    # lock, and streaming first held every next block back from the pass.
                    yield held
                    held = None
                guess = None
                if echo is not None and not proposal.tokens:
                    guess = echo.guess()
                    if shadow is not None and not shadow.pending:
                        depth = controller.shadow_depth()  # type: ignore[union-attr]
                        shadow_draft = echo.ngram_draft(depth)
                        shadow.start(shadow_draft)
                        controller.observe_shadow_fill(len(shadow_draft), depth)  # type: ignore[union-attr]
                elif echo is not None and shadow is not None and not shadow.pending:
                    # in a batch, a shadow past the block: what the positions beyond it would do
                    depth = controller.shadow_depth_beyond(len(proposal.tokens))  # type: ignore[union-attr]
                    shadow_draft = echo.ngram_draft(depth) if depth else []
                    if len(shadow_draft) > len(proposal.tokens):
                        shadow.start(shadow_draft, covered=len(proposal.tokens))
                outcome = pending.result()
                verify_s = time.perf_counter() - t
                _pass_features(target, draft, step)
                if ahead is not None:
                    t = time.perf_counter()
                    block = draft.finish_ahead(ahead, step)  # type: ignore[union-attr]
                    draft_s += time.perf_counter() - t
                    if block is not None and not isinstance(outcome, FailoverOutcome):
                        predrafted = use_predrafted(outcome.num_accepted == len(proposal.tokens), outcome.tokens[-1],
                                                    block)
                        gen.stats.record_pipeline(predrafted is not None)
                if isinstance(outcome, FailoverOutcome):  # the block was dropped; the new session's prefill gave the token
                    if shadow is not None:
                        shadow.drop()
                    gen.stats.record_step(0, 0)
                    gen.stats.k_per_step.append(0)
                else:
                    gen.stats.record_step(len(proposal.tokens), outcome.num_accepted)
                    gen.stats.k_per_step.append(len(proposal.tokens))
                    if controller is not None or costs is not None:
                        # The time in the replica's queue is left out: it is other work's (prefills
                        # queued ahead, the pass before), and it would tilt the cost of this depth.
                        service_ms = max(verify_s * 1000 - getattr(outcome, "queue_ms", 0.0), 0.0)
                        step_costs = _step_costs(outcome, open_s * 1000)
                        if controller is not None:
                            controller.observe(len(proposal.tokens), outcome.num_accepted, draft_s * 1000, service_ms,
                                               requested=k, echo=echo_hit(guess, outcome.tokens),
                                               shadow=shadow.feed(outcome.tokens) if shadow is not None else None,
                                               **step_costs)
                        else:
                            costs.observe_step(len(proposal.tokens), draft_s * 1000, service_ms,  # type: ignore[union-attr]
                                               **step_costs)
                            record.observe(len(proposal.tokens), outcome.num_accepted, k)  # type: ignore[union-attr]
                if draft is not None:
                    draft.append(outcome.tokens, step)
                out, gen.finish_reason = stopper.accept(gen.token_ids, outcome.tokens)
                gen.token_ids.extend(out)
                if echo is not None:
                    echo.extend(out)
                held = out
            if held is not None:
                yield held
        finally:
            gen.duration = time.perf_counter() - start
            if controller is not None:
                controller.close()
            if record is not None:
                record.close()
            if draft is not None:
                draft.close()
            target.close()
