"""The Ray transport: the engine's target and draft sessions over Ray Serve deployment handles.

The counterpart of coordinator/remote.py (gRPC streams). A session's first call (`open`) goes
where the request router puts new sessions; the reply's session id names the replica that holds
the session's state, and every later call carries it as the request's `session_id`, which the
router (specd.ray_serve.router) follows. The engine loop and its exactness are untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from coordinator.remote import CallTimes, RemoteVerifyOutcome
from draft_service.proposers.base import Proposal
from specd.errors import SpecdError
from specd.sampling import SamplingParams
from target_service.rejection_sampler import VerifyOutcome

log = logging.getLogger(__name__)


def call(method: Any, timeout: float | None, *args: Any) -> Any:
    """Calls a deployment method and waits for its result. A specd error raised on the replica
    (InvalidArgument, NotFound, ...) comes back as itself, so the front ends map it as usual."""
    from ray.exceptions import RayTaskError

    try:
        return method.remote(*args).result(timeout_s=timeout)
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, SpecdError):
            raise cause from None
        raise


class RayTargetSession:
    def __init__(self, handle: Any, prompt_ids: Sequence[int], params: SamplingParams, request_id: str,
                 timeout: float | None, times: CallTimes):
        self.handle = handle
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.request_id = request_id
        self.timeout = timeout
        self.times = times
        self.session_id = ""
        self._pinned: Any = None
        self._room = 0
        self.closed = False

    @property
    def room(self) -> int:
        return self._room

    def prefill(self) -> int:
        opened = call(self.handle.open, self.timeout, self.prompt_ids, self.params, self.request_id)
        self.session_id = opened["session_id"]
        self._pinned = self.handle.options(session_id=self.session_id)
        self._room = opened["room"]
        return opened["first_token"]

    def verify(self, proposal: Proposal) -> VerifyOutcome:
        start = time.perf_counter()
        reply = call(self._pinned.verify, self.timeout, self.session_id, list(proposal.tokens), proposal.probs)
        self.times.verify_wall_ms += (time.perf_counter() - start) * 1000
        self.times.verify_ms += reply["verify_ms"]
        self._room = reply["room"]
        return RemoteVerifyOutcome(num_accepted=reply["num_accepted"], tokens=list(reply["tokens"]),
                                   batch_size=max(int(reply["batch_size"]), 1), queue_ms=max(float(reply["queue_ms"]), 0.0),
                                   pass_block_length=int(reply["pass_block_length"]),
                                   pass_positions=int(reply.get("pass_positions", 0)), packed=bool(reply.get("packed")),
                                   compute_ms=max(float(reply["verify_ms"]), 0.0), pass_id=int(reply.get("pass_id", 0)))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._pinned is not None:
            try:
                call(self._pinned.close, 10.0, self.session_id)
            except Exception:  # the replica may be gone; its session TTL frees the row then
                log.warning("closing target session %s failed", self.session_id, exc_info=True)


class RayVerifier:
    """The target deployment as the engine's verifier."""

    def __init__(self, handle: Any, request_id: str = "", timeout: float | None = None, times: CallTimes | None = None):
        self.handle = handle
        self.request_id = request_id
        self.timeout = timeout
        self.times = times or CallTimes()

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> RayTargetSession:
        return RayTargetSession(self.handle, prompt_ids, params, self.request_id, self.timeout, self.times)


class RayDraftSession:
    """Feedback is buffered and travels with the next step call: one round trip a step."""

    def __init__(self, handle: Any, method: str, prompt_ids: Sequence[int], params: SamplingParams,
                 timeout: float | None, times: CallTimes):
        self.timeout = timeout
        self.times = times
        self._appended: list[int] = []
        self.session_id = call(handle.open, timeout, list(prompt_ids), params, method)
        self._pinned = handle.options(session_id=self.session_id)
        self.closed = False

    def propose(self, k: int) -> Proposal:
        start = time.perf_counter()
        tokens, probs, draft_ms = call(self._pinned.step, self.timeout, self.session_id, self._appended, k)
        self.times.draft_wall_ms += (time.perf_counter() - start) * 1000
        self.times.draft_ms += draft_ms
        self._appended = []
        return Proposal(list(tokens), probs)

    def append(self, tokens: Sequence[int]) -> None:
        self._appended.extend(tokens)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                call(self._pinned.close, 10.0, self.session_id)
            except Exception:
                log.warning("closing draft session %s failed", self.session_id, exc_info=True)


class RayProposer:
    """The draft deployment as the engine's proposer, for one method."""

    def __init__(self, handle: Any, method: str, timeout: float | None = None, times: CallTimes | None = None):
        self.handle = handle
        self.name = method
        self.timeout = timeout
        self.times = times or CallTimes()

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> RayDraftSession:
        return RayDraftSession(self.handle, self.name, prompt_ids, params, self.timeout, self.times)
