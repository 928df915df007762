"""What a request does when a replica fails under it: the engine's two links to the replicas.

- `DraftLink`: drafts are only proposals, so a draft replica that is down, slow (a call past its
  budget: `specd.errors.CallTimeout`) or erroring never fails a request. The session is given
  up, that step verifies an empty block (k = 0: plain decoding, one target pass per token), and
  a new draft session is tried after a backoff of 8, 16, 32, ... steps; the replica pool places it
  on a healthy replica, so speculation resumes when one is. Only the request's own deadline
  (DEADLINE_EXCEEDED: the stream's deadline is the request's) is passed on.
- `TargetLink`: a target replica that fails at the transport level (the stream broke:
  UNAVAILABLE, CANCELLED that we did not cause, ABORTED; the session is unknown there:
  NOT_FOUND; a call past its budget) is replaced. The session is re-opened on another replica
  with the prompt plus every token emitted so far, and its prefill answers exactly the next token
  (what a verify of an empty block would have answered), which is emitted as that step's output.
  The draft saw the same tokens, so its state stays valid. At most `max_reopens` re-opens per
  request; with no replica left the request fails with `specd.errors.Unavailable` (gRPC
  UNAVAILABLE), naming the failure and the pool's state. Errors that are the request's own
  (bad input, its deadline, a full replica) are not failures of the replica and pass through.

Greedy output after a failover is token for token what an undisturbed run gives. Sampled output
stays exact in distribution, but a seeded request's random stream restarts on the new session, so
its tokens after the failover differ from an undisturbed run with the same seed.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol, Sequence

import grpc

from draft_service.proposers.base import DraftSession, Proposal, Proposer
from specd.errors import CallTimeout, NotFound, Unavailable
from specd.features import FeatureLog
from specd.sampling import SamplingParams
from target_service.rejection_sampler import VerifyOutcome

log = logging.getLogger(__name__)

TARGET = "target"
DRAFT = "draft"
MAX_TARGET_REOPENS = 3
DRAFT_BACKOFF_STEPS = 8  # steps at k = 0 before the first retry; doubles per failure in a row
DRAFT_BACKOFF_MAX_STEPS = 512

# Codes meaning "the replica or the stream to it is gone", not "the request is wrong".
_TARGET_FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                    grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND})

FaultHook = Callable[[str, str], None]  # (service, reason)


def _code(exc: BaseException) -> grpc.StatusCode | None:
    code = getattr(exc, "code", None) if isinstance(exc, grpc.RpcError) else None
    if not callable(code):
        return None
    try:
        return code()
    except Exception:
        return None


def fault_reason(exc: BaseException) -> str:
    """A short label for a replica failure (the metric attribute): "timeout", a gRPC code in
    lower case ("unavailable", ...), "unavailable"/"not_found" for specd's own, else the type."""
    if isinstance(exc, CallTimeout):
        return "timeout"
    code = _code(exc)
    if code is not None:
        return code.name.lower()
    if isinstance(exc, Unavailable):
        return "unavailable"
    if isinstance(exc, NotFound):
        return "not_found"
    return type(exc).__name__


def describe(exc: BaseException) -> str:
    code = _code(exc)
    if code is not None:
        details = exc.details() if callable(getattr(exc, "details", None)) else ""  # type: ignore[attr-defined]
        return f"{code.name}: {details}" if details else code.name
    return f"{type(exc).__name__}: {exc}"


def is_request_deadline(exc: BaseException) -> bool:
    """The request's own deadline passed (its streams carry it): never a replica's fault."""
    return _code(exc) == grpc.StatusCode.DEADLINE_EXCEEDED


def is_target_failure(exc: BaseException) -> bool:
    """True when a target call failed because of the replica (fail over), not the request."""
    if isinstance(exc, (CallTimeout, Unavailable, NotFound)):
        return True
    return _code(exc) in _TARGET_FAILOVER_CODES


def _give_up(session: Any) -> None:
    """Drop a broken session: `abandon` (close and tell the pool) when the transport has it."""
    try:
        getattr(session, "abandon", session.close)()
    except Exception:  # the replica is gone anyway
        log.debug("closing a failed session raised", exc_info=True)


def _where(session: Any) -> str:
    replica = getattr(session, "replica", None)
    return f" {replica.address}" if replica is not None else ""


class TargetSessionLike(Protocol):
    @property
    def room(self) -> int: ...
    def prefill(self) -> int: ...
    def verify(self, proposal: Proposal) -> VerifyOutcome: ...
    def close(self) -> None: ...


class VerifierLike(Protocol):
    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> TargetSessionLike: ...


class FailoverOutcome(VerifyOutcome):
    """The token a re-opened session's prefill answered, standing in for a failed verify step."""


class PendingVerify:
    """A verify step started by `TargetLink.start_verify`: `result()` is its outcome, or after a
    failover a FailoverOutcome holding just the next token."""

    __slots__ = ("link", "call", "generated", "outcome")

    def __init__(self, link: "TargetLink", call: Any, generated: Sequence[int], outcome: VerifyOutcome | None = None):
        self.link, self.call, self.generated, self.outcome = link, call, generated, outcome

    def result(self) -> VerifyOutcome:
        if self.outcome is None:
            try:
                self.outcome = self.call.result()
            except Exception as exc:
                if not is_target_failure(exc):
                    raise
                self.outcome = self.link._failed(exc, self.generated)
        return self.outcome


class TargetLink:
    """A request's target session, moved to another replica when its replica fails."""

    def __init__(self, verifier: VerifierLike, session: TargetSessionLike, prompt_ids: Sequence[int],
                 params: SamplingParams, on_fault: FaultHook, max_reopens: int = MAX_TARGET_REOPENS,
                 want_features: bool = False):
        """want_features: sessions send the target's features (for a draft head), re-opened ones too."""
        self.verifier = verifier
        self.want_features = want_features
        if want_features:
            session.want_features = True  # type: ignore[attr-defined]
        self.session = session
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.on_fault = on_fault
        self.max_reopens = max_reopens
        self.reopens = 0

    def prefill(self, generated: Sequence[int]) -> int:
        try:
            return self.session.prefill()
        except Exception as exc:
            if not is_target_failure(exc):
                raise
            return self._failover(exc, generated)

    @property
    def overlaps(self) -> bool:
        """Whether the session sends a verify step and reads its reply in two calls (a remote
        one), so that other work can run while the target verifies (`start_verify`)."""
        return hasattr(self.session, "start_verify")

    def start_verify(self, proposal: Proposal, generated: Sequence[int]) -> "PendingVerify":
        """Start the step (its `result()`: the outcome, after a failover a FailoverOutcome holding
        just the next token): sent now where the session `overlaps`, else run now. `generated`
        (the tokens emitted so far, what a failover re-opens the session with) must not change
        until `result()` is read."""
        try:
            if self.overlaps:
                return PendingVerify(self, self.session.start_verify(proposal), generated)  # type: ignore[attr-defined]
            return PendingVerify(self, None, generated, self.session.verify(proposal))
        except Exception as exc:
            if not is_target_failure(exc):
                raise
            return PendingVerify(self, None, generated, self._failed(exc, generated))

    def _failed(self, exc: Exception, generated: Sequence[int]) -> VerifyOutcome:
        return FailoverOutcome(num_accepted=0, tokens=[self._failover(exc, generated)])

    def _failover(self, exc: BaseException, generated: Sequence[int]) -> int:
        while True:
            where = _where(self.session)
            _give_up(self.session)
            self.on_fault(TARGET, fault_reason(exc))
            if self.reopens >= self.max_reopens:
                raise Unavailable(f"target replica{where} failed ({describe(exc)}) after {len(generated)} tokens; "
                                  f"this request already moved {self.reopens} times; retry later") from exc
            self.reopens += 1
            log.warning("target replica%s failed (%s) after %d tokens: re-opening the session on another replica "
                        "(%d/%d)", where, describe(exc), len(generated), self.reopens, self.max_reopens)
            try:
                self.session = self.verifier.open_session(self.prompt_ids + list(generated), self.params)
                if self.want_features:
                    self.session.want_features = True  # type: ignore[attr-defined]
            except Unavailable as none_left:
                raise Unavailable(f"target replica{where} failed ({describe(exc)}) after {len(generated)} tokens "
                                  f"and no other target replica can take the request over: {none_left}") from exc
            try:
                return self.session.prefill()
            except Exception as again:
                if not is_target_failure(again):
                    raise
                exc = again

    def new_features(self) -> tuple[int, Any] | None:
        """(first position, rows) of the features the last prefill or verify kept, when sent."""
        return getattr(self.session, "new_features", None) if self.want_features else None

    def close(self) -> None:
        self.session.close()


class DraftLink:
    """A request's draft session: opened on first use, given up when its replica fails (the
    request goes on at k = 0), re-opened after a backoff of steps. Never raises a replica's
    failure; only the request's own deadline passes through."""

    def __init__(self, proposer: Proposer, params: SamplingParams, on_fault: FaultHook):
        self.proposer = proposer
        # A draft head reads the target's features: the link keeps them all, so a session opened
        # (or re-opened) late gets every position's, then each step's new ones.
        self.features = FeatureLog() if getattr(proposer, "needs_features", False) else None
        self.params = params
        self.on_fault = on_fault
        self.session: DraftSession | None = None
        self.retry_at = 0  # the first step at which a new session may be opened
        self.backoff = DRAFT_BACKOFF_STEPS
        self.failures = 0
        self.open_s = 0.0  # of the last propose call: the part spent opening the session

    def propose(self, context: Callable[[], list[int]], k: int, step: int) -> Proposal:
        """k tokens from the draft, opening its session (on `context()`) when needed; an empty
        proposal while the draft is down or backing off."""
        self.open_s = 0.0
        if self.session is None:
            if step < self.retry_at:
                return Proposal()
            start = time.perf_counter()
            try:
                self.session = self.proposer.open_session(context(), self.params)
                if self.features is not None and self.features.length:
                    self.session.add_features(0, self.features.rows())  # type: ignore[attr-defined]
            except Exception as exc:
                self._fail(exc, step)
                return Proposal()
            self.open_s = time.perf_counter() - start
        try:
            proposal = self.session.propose(k)
        except Exception as exc:
            self._fail(exc, step)
            return Proposal()
        self.backoff = DRAFT_BACKOFF_STEPS
        return proposal

    def start_ahead(self, assumed: list[int], k: int, step: int) -> Any:
        """Pipelined drafting: the next block, drafted during the verify (None when it failed)."""
        if self.session is None:
            return None
        try:
            start = getattr(self.session, "start_ahead", None)
            if start is not None:
                return start(assumed, k)  # a remote call in flight: .result() waits for it
            return _Done(self.session.propose_ahead(assumed, k))
        except Exception as exc:
            self._fail(exc, step)
            return None

    def finish_ahead(self, pending: Any, step: int) -> Proposal | None:
        try:
            return pending.result()
        except Exception as exc:
            if self.session is not None:
                self._fail(exc, step)
            return None

    def add_features(self, start: int, rows: Any, step: int) -> None:
        """The target's features of positions start ..; kept, and passed on to the open session."""
        if self.features is None:
            return
        self.features.add(start, rows)
        if self.session is None:
            return
        try:
            self.session.add_features(start, rows)  # type: ignore[attr-defined]
        except Exception as exc:
            self._fail(exc, step)

    def append(self, tokens: Sequence[int], step: int) -> None:
        if self.session is None:
            return
        try:
            self.session.append(tokens)
        except Exception as exc:
            self._fail(exc, step)

    def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            try:
                session.close()
            except Exception:  # closing is best effort; the replica frees the session when the stream ends
                log.debug("closing a draft session raised", exc_info=True)

    def _fail(self, exc: BaseException, step: int) -> None:
        if is_request_deadline(exc):
            raise exc
        where = _where(self.session)
        if self.session is not None:
            _give_up(self.session)
            self.session = None
        self.failures += 1
        self.retry_at = step + self.backoff
        log.log(logging.WARNING if self.failures == 1 else logging.INFO,
                "draft replica%s failed (%s): going on without speculation, retrying in %d steps",
                where, describe(exc), self.backoff, exc_info=not isinstance(exc, (grpc.RpcError, CallTimeout, Unavailable)))
        self.backoff = min(self.backoff * 2, DRAFT_BACKOFF_MAX_STEPS)
        self.on_fault(DRAFT, fault_reason(exc))


class _Done:
    """An already computed pre-drafted block (in-process sessions draft ahead synchronously)."""

    def __init__(self, proposal: Proposal):
        self.proposal = proposal

    def result(self) -> Proposal:
        return self.proposal
