"""The gRPC transport: draft and target sessions on remote replicas, behind the engine's interfaces.

Each session is one bidirectional stream, driven in lockstep: send one request, read its one
reply. The stream pins the session to the replica that holds its state, and closing or cancelling
it frees that state on the replica.
"""

from __future__ import annotations

import queue
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import grpc
import torch
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from coordinator.replicas import Replica, ReplicaPool  # noqa: F401  (re-exported: the transport's pool)
from coordinator.compat import DraftCompat, NoDraftSession, is_refusal
from coordinator.watchdog import WATCHDOG
from draft_service.proposers.base import Proposal
from specd.errors import CallTimeout
from specd.features import features_from_proto, features_to_proto
from specd.sampling import SamplingParams
from specd.telemetry import Telemetry, inject_into
from specd.wire import METHOD_TO_PROTO, probs_from_proto, probs_to_proto, sampling_to_proto
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.rejection_sampler import VerifyOutcome


OPEN_BUDGET_FACTOR = 10  # a draft session's open may take this many draft budgets (it prefills the draft model)


def _drain_queue(q: "queue.SimpleQueue[Any]") -> Iterator[Any]:
    while True:
        item = q.get()
        if item is None:
            return
        yield item


class LockstepStream:
    """A bidi stream used as a sequence of request/reply pairs.

    `budget` (seconds) bounds one reply's wait: past it the watchdog cancels the whole stream and
    the call raises CallTimeout (the stream's own deadline is the request's, for all its calls).
    """

    def __init__(self, method: Callable[..., Iterator[Any]], timeout: float | None, metadata: Sequence[tuple[str, str]] = ()):
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._replies = method(_drain_queue(self._requests), timeout=timeout, metadata=tuple(metadata))
        self.closed = False

    def call(self, request: Any, budget: float | None = None) -> Any:
        self._requests.put(request)
        return self.receive(budget)

    def send(self, request: Any) -> None:
        """Half of `call`: the reply is read later with `receive` (pipelined drafting)."""
        self._requests.put(request)

    def receive(self, budget: float | None = None) -> Any:
        if not budget or budget <= 0:
            return next(self._replies)
        alarm = WATCHDOG.arm(budget, self._replies.cancel)  # type: ignore[attr-defined]
        try:
            return next(self._replies)
        except grpc.RpcError as exc:
            if alarm.fired:
                raise CallTimeout(f"no reply within {budget * 1000:.0f} ms") from exc
            raise
        finally:
            alarm.disarm()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._requests.put(None)
            self._replies.cancel()  # type: ignore[attr-defined]


@dataclass
class CallTimes:
    """Wall time of the calls a request made, and what the services said they spent."""

    draft_wall_ms: float = 0.0
    draft_ms: float = 0.0
    verify_wall_ms: float = 0.0
    verify_ms: float = 0.0

    @property
    def rpc_overhead_ms(self) -> float:
        return (self.draft_wall_ms - self.draft_ms) + (self.verify_wall_ms - self.verify_ms)


class StepTelemetry:
    """What one request's remote sessions record per step: a CLIENT span per call ("prefill",
    "verify", "draft"), children of the request span `parent`, whose W3C context rides on the
    message (`trace_context`) so the service's span continues the trace; and the speculation
    metrics, with the request's attributes. Built by the service only when telemetry is on, so
    the sessions' per-step cost with telemetry off is one `is None` check."""

    __slots__ = ("tel", "parent", "attrs", "_pos_attrs", "tracing", "metrics", "k", "off_reason")

    def __init__(self, tel: Telemetry, parent: Context | None, attrs: dict[str, str]):
        self.tel = tel
        self.parent = parent
        self.attrs = attrs  # target model, method (and draft model): the spec-decode counters' attributes
        self._pos_attrs: list[dict[str, Any]] = []
        self.tracing = tel.tracing_on
        self.metrics = tel.metrics_on
        self.k = 0  # the k of this step's draft call, for the verify span (0: the step drafted nothing)
        self.off_reason: str | None = None  # set when speculation was turned off for the request (coordinator/compat.py)

    def span(self, name: str, attributes: dict[str, Any] | None = None):
        return self.tel.span(name, self.parent, SpanKind.CLIENT, attributes)

    def record_verify(self, drafted: int, accepted: int, seconds: float) -> None:
        m = self.tel.coordinator
        m.verify_duration.record(seconds, self.attrs)
        if drafted:
            m.num_drafts.add(1, self.attrs)
            m.num_draft_tokens.add(drafted, self.attrs)
            m.num_accepted_tokens.add(accepted, self.attrs)
            while len(self._pos_attrs) < accepted:
                self._pos_attrs.append({**self.attrs, "position": len(self._pos_attrs)})
            for i in range(accepted):
                m.num_accepted_tokens_per_pos.add(1, self._pos_attrs[i])

    def record_draft(self, k: int, seconds: float) -> None:
        m = self.tel.coordinator
        m.k.record(k, self.attrs)
        m.draft_duration.record(seconds, self.attrs)

    def record_fault(self, service: str, reason: str) -> None:
        """The engine met a replica failure (coordinator/failover.py): count it."""
        if self.metrics:
            self.tel.coordinator.failovers.add(1, {**self.attrs, "specd.service": service, "specd.reason": reason})


@dataclass
class RemoteVerifyOutcome(VerifyOutcome):
    """A verify result plus how many sessions shared its forward pass and how long the block
    waited in the replica's queue (for the cost model)."""

    batch_size: int = 1
    queue_ms: float = 0.0
    pass_block_length: int = 0  # positions per row of the pass (0: not reported)
    pass_positions: int = 0  # positions the pass computed, all rows together (0: not reported)
    packed: bool = False  # the replica packs rows of different block lengths (a block costs only its own positions)
    compute_ms: float | None = None  # the pass's time as the replica measured it
    pass_id: int = 0  # the pass's number on the replica (0: not reported); the rows of a pass share it


def remaining(deadline: float | None) -> float | None:
    """Seconds left until a request's deadline (None: no deadline); TimeoutError once it passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed")
    return left


class RemoteTargetSession:
    """`step_timeout`: the longest wait for one prefill or verify reply (None: the request's
    deadline only); past it the call raises CallTimeout and the engine fails over."""

    def __init__(self, pool: ReplicaPool, prompt_ids: Sequence[int], params: SamplingParams, request_id: str,
                 timeout: float | None, times: CallTimes, telemetry: StepTelemetry | None = None,
                 step_timeout: float | None = None):
        self.pool = pool
        self.replica = pool.acquire()
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.request_id = request_id
        self.times = times
        self.telemetry = telemetry
        self.step_timeout = step_timeout
        self.session_id = ""
        self._room = 0
        self.want_features = False  # set before prefill: the target then sends its features (method head)
        self.new_features: tuple[int, Any] | None = None
        stub = target_pb2_grpc.TargetServiceStub(self.replica.channel)
        self.stream = LockstepStream(stub.Session, timeout)

    @property
    def room(self) -> int:
        return self._room

    def prefill(self) -> int:
        request = target_pb2.TargetRequest(open=target_pb2.OpenTargetSession(
            prompt_token_ids=self.prompt_ids, params=sampling_to_proto(self.params), request_id=self.request_id,
            return_features=self.want_features))
        if self.telemetry is None or not self.telemetry.tracing:
            opened = self.stream.call(request, self.step_timeout).opened
        else:
            with self.telemetry.span("prefill", {"specd.prompt_tokens": len(self.prompt_ids)}) as span:
                inject_into(span, request.trace_context)
                opened = self.stream.call(request, self.step_timeout).opened
                span.set_attributes({"specd.session_id": opened.session_id, "specd.prefill_ms": opened.prefill_ms,
                                     "specd.queue_ms": opened.queue_ms})
        self.session_id = opened.session_id
        self._room = opened.context_room
        self.new_features = features_from_proto(opened.features) if opened.HasField("features") else None
        return opened.first_token_id

    def verify(self, proposal: Proposal) -> VerifyOutcome:
        return self.start_verify(proposal).result()

    def start_verify(self, proposal: Proposal) -> "_PendingVerify":
        """Send the verify step now; `result()` on what this returns waits for its reply. The
        engine sends the next block before it streams the last step's tokens to the client, so
        that work overlaps the target's pass instead of delaying it (coordinator/engine.py)."""
        block = target_pb2.VerifyBlock(draft_token_ids=proposal.tokens)
        probs = probs_to_proto(proposal.probs)
        if probs is not None:
            block.draft_probs.CopyFrom(probs)
        request = target_pb2.TargetRequest(verify=block)
        tel = self.telemetry
        pending = _PendingVerify(self, len(proposal.tokens))
        if tel is not None and tel.tracing:
            k, tel.k = tel.k, 0
            pending.span = pending.scope.enter_context(
                tel.span("verify", {"specd.k": k, "specd.draft_tokens": len(proposal.tokens)}))
            inject_into(pending.span, request.trace_context)
        self.stream.send(request)
        pending.sent_at = time.perf_counter()
        return pending

    def _finish_verify(self, pending: "_PendingVerify") -> VerifyOutcome:
        with pending.scope:  # the span, when tracing: ended here, with the error if the reply failed
            reply = self.stream.receive(self.step_timeout).verified
            if pending.span is not None:
                pending.span.set_attributes({"specd.accepted_tokens": reply.num_accepted,
                                             "specd.batch_size": reply.batch_size, "specd.verify_ms": reply.verify_ms,
                                             "specd.queue_ms": reply.queue_ms, "specd.session_id": self.session_id})
        wall = time.perf_counter() - pending.sent_at
        self.times.verify_wall_ms += wall * 1000
        self.times.verify_ms += reply.verify_ms
        if self.telemetry is not None and self.telemetry.metrics:
            self.telemetry.record_verify(pending.drafted, reply.num_accepted, wall)
        self._room = reply.context_room
        self.new_features = features_from_proto(reply.features) if reply.HasField("features") else None
        return RemoteVerifyOutcome(num_accepted=reply.num_accepted, tokens=list(reply.token_ids),
                                   batch_size=max(int(reply.batch_size), 1), queue_ms=max(float(reply.queue_ms), 0.0),
                                   pass_block_length=int(reply.pass_block_length), pass_positions=int(reply.pass_positions),
                                   packed=bool(reply.packed), compute_ms=max(float(reply.verify_ms), 0.0),
                                   pass_id=int(reply.pass_id))

    def close(self) -> None:
        if not self.stream.closed:
            self.stream.close()
            self.pool.release(self.replica)

    def abandon(self) -> None:
        """The session broke (the engine fails over): close it and have the pool re-check the replica."""
        self.close()
        self.pool.report_failure(self.replica)


class RemoteVerifier:
    """The target pool as the engine's verifier. `timeout`: the request's (every session opened
    for it, a failover's too, gets what is left of it); `step_timeout`: see RemoteTargetSession."""

    def __init__(self, pool: ReplicaPool, request_id: str = "", timeout: float | None = None, times: CallTimes | None = None,
                 telemetry: StepTelemetry | None = None, step_timeout: float | None = None):
        self.pool = pool
        self.request_id = request_id
        self.deadline = time.monotonic() + timeout if timeout is not None else None
        self.times = times or CallTimes()
        self.telemetry = telemetry
        self.step_timeout = step_timeout

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> RemoteTargetSession:
        return RemoteTargetSession(self.pool, prompt_ids, params, self.request_id, remaining(self.deadline), self.times,
                                   self.telemetry, self.step_timeout)


class RemoteDraftSession:
    """Feedback is buffered and travels with the next propose request: one round trip a step.

    `budget`: the longest wait for one block (None: no limit); past it the call raises
    CallTimeout and the engine goes on without this session. The open, which runs the draft
    model over the prompt, gets OPEN_BUDGET_FACTOR times as long."""

    def __init__(self, pool: ReplicaPool, method: str, prompt_ids: Sequence[int], params: SamplingParams,
                 request_id: str, timeout: float | None, times: CallTimes, telemetry: StepTelemetry | None = None,
                 compat: DraftCompat | None = None, budget: float | None = None):
        self.pool = pool
        self.replica = pool.acquire()
        self.times = times
        self.telemetry = telemetry
        self.budget = budget
        self._appended: list[int] = []
        self._features: tuple[int, Any] | None = None  # target features not sent yet (method head)
        stub = draft_pb2_grpc.DraftServiceStub(self.replica.channel)
        self.stream = LockstepStream(stub.Session, timeout)
        request = draft_pb2.DraftRequest(open=draft_pb2.OpenDraftSession(
            prompt_token_ids=list(prompt_ids), params=sampling_to_proto(params),
            method=METHOD_TO_PROTO[method], request_id=request_id))
        if compat is not None:  # the draft replica refuses draft_model sessions for another vocabulary
            request.open.target_model = compat.target_model
            request.open.target_vocab_hash = compat.target_vocab_hash
        if telemetry is not None and telemetry.tracing and telemetry.parent is not None:
            inject_into(telemetry.parent, request.trace_context)  # "draft.open" is a child of the request span
        try:
            self.session_id = self.stream.call(request, budget * OPEN_BUDGET_FACTOR if budget else None).session_id
        except BaseException:
            self.close()
            raise

    def _step(self, k: int, assumed: Sequence[int] = ()) -> draft_pb2.DraftRequest:
        """The next step's message: the buffered feedback (tokens, features) and what to draft."""
        step = draft_pb2.DraftStep(appended_token_ids=self._appended, k=k, assumed_token_ids=list(assumed))
        if self._features is not None:
            step.target_features.CopyFrom(features_to_proto(*self._features))
        self._appended, self._features = [], None
        return draft_pb2.DraftRequest(step=step)

    def add_features(self, start: int, rows: Any) -> None:
        """Buffered like the tokens: a new start 0 replaces, a continuation is joined on."""
        if self._features is not None and start and start == self._features[0] + self._features[1].shape[0]:
            self._features = (self._features[0], torch.cat([self._features[1], rows]))
        else:
            self._features = (start, rows)

    def propose(self, k: int) -> Proposal:
        appended = len(self._appended)
        request = self._step(k)
        tel = self.telemetry
        start = time.perf_counter()
        if tel is None or not tel.tracing:
            block = self.stream.call(request, self.budget)
        else:
            tel.k = k
            with tel.span("draft", {"specd.k": k, "specd.appended_tokens": appended}) as span:
                inject_into(span, request.trace_context)
                block = self.stream.call(request, self.budget)
                span.set_attributes({"specd.draft_tokens": len(block.token_ids), "specd.draft_ms": block.draft_ms,
                                     "specd.session_id": self.session_id})
        wall = time.perf_counter() - start
        self.times.draft_wall_ms += wall * 1000
        self.times.draft_ms += block.draft_ms
        if tel is not None and tel.metrics:
            tel.record_draft(k, wall)
        return _proposal(block)

    def start_ahead(self, assumed: Sequence[int], k: int) -> "_PendingBlock":
        """Pipelined drafting: send the step now (with the buffered feedback and the block being
        verified as `assumed_token_ids`); the engine reads the block after its verify call."""
        request = self._step(k, assumed)
        tel = self.telemetry
        if tel is not None and tel.tracing and tel.parent is not None:
            inject_into(tel.parent, request.trace_context)
        self.stream.send(request)
        return _PendingBlock(self, k, time.perf_counter())

    def _finish_ahead(self, k: int, sent_at: float) -> Proposal:
        block = self.stream.receive(self.budget)  # the budget counts from here: the verify call overlapped it
        wall = time.perf_counter() - sent_at
        self.times.draft_ms += block.draft_ms  # its wall time overlapped the verify call: not counted as RPC overhead
        if self.telemetry is not None and self.telemetry.metrics:
            self.telemetry.record_draft(k, wall)
        return _proposal(block)

    def append(self, tokens: Sequence[int]) -> None:
        self._appended.extend(tokens)

    def close(self) -> None:
        if not self.stream.closed:
            self.stream.close()
            self.pool.release(self.replica)

    def abandon(self) -> None:
        """The session failed (the engine goes on without it): close it, have the pool re-check the replica."""
        self.close()
        self.pool.report_failure(self.replica)


def _proposal(block: draft_pb2.DraftBlock) -> Proposal:
    """A DraftBlock as the engine's Proposal (q rows decoded when the draft sent them)."""
    tokens = list(block.token_ids)
    probs = probs_from_proto(block.probs, len(tokens), block.probs.vocab_size) if tokens else None
    return Proposal(tokens, probs)


class _PendingBlock:
    """A draft step in flight; `result()` waits for its block."""

    __slots__ = ("session", "k", "sent_at")

    def __init__(self, session: RemoteDraftSession, k: int, sent_at: float):
        self.session, self.k, self.sent_at = session, k, sent_at

    def result(self) -> Proposal:
        return self.session._finish_ahead(self.k, self.sent_at)


class _PendingVerify:
    """A verify step in flight; `result()` waits for its reply. `scope` holds the step's client
    span while it is open (tracing on), so the span covers the whole call."""

    __slots__ = ("session", "drafted", "sent_at", "span", "scope")

    def __init__(self, session: RemoteTargetSession, drafted: int):
        self.session, self.drafted = session, drafted
        self.sent_at = 0.0
        self.span: Any = None
        self.scope = ExitStack()

    def result(self) -> VerifyOutcome:
        return self.session._finish_verify(self)


class RemoteProposer:
    """The draft pool as the engine's proposer, for one method."""

    def __init__(self, pool: ReplicaPool, method: str, request_id: str = "", timeout: float | None = None,
                 times: CallTimes | None = None, telemetry: StepTelemetry | None = None, compat: DraftCompat | None = None,
                 budget: float | None = None):
        self.pool = pool
        self.name = method
        self.needs_features = method == "head"  # the engine then has the target send its features
        self.compat = compat
        self.request_id = request_id
        self.deadline = time.monotonic() + timeout if timeout is not None else None
        self.times = times or CallTimes()
        self.telemetry = telemetry
        self.budget = budget

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> RemoteDraftSession | NoDraftSession:
        """A refused open (FAILED_PRECONDITION: another vocabulary, or the method not served) runs
        the request without speculation instead of failing it, when `compat` reports refusals."""
        try:
            return RemoteDraftSession(self.pool, self.name, prompt_ids, params, self.request_id, remaining(self.deadline),
                                      self.times, self.telemetry, self.compat, self.budget)
        except grpc.RpcError as exc:
            if self.compat is None or not is_refusal(exc):
                raise
            self.compat.refused(self.name, exc.details() or "", steps=self.telemetry)  # type: ignore[attr-defined]
            return NoDraftSession()


def fetch_model_info(pool: ReplicaPool, timeout: float = 30.0) -> common_pb2.ModelInfo:
    stub = target_pb2_grpc.TargetServiceStub(pool.wait_for_replica(timeout).channel)
    return stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout, wait_for_ready=True)


def fetch_draft_model_info(pool: ReplicaPool, timeout: float = 2.0) -> common_pb2.ModelInfo:
    stub = draft_pb2_grpc.DraftServiceStub(pool.wait_for_replica(timeout).channel)
    return stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout)
