"""Draft/target compatibility on the coordinator, and saying so when speculation is off.

A draft model that does not share the target's tokenizer drafts the ids of other tokens: the
output stays exact (the target rejects them), but every step pays for drafts that are never
accepted, silently and forever. So the two sides compare a hash of the vocabulary and special
tokens (`specd.vocab.vocab_hash`, carried by `ModelInfo.vocab_hash`):

- at start-up the coordinator asks every draft replica it knows for its ModelInfo and logs (and
  counts) each whose draft model disagrees with the target (`check_draft_replicas`);
- every draft_model session open carries the target's model name and hash
  (`OpenDraftSession.target_model`, `.target_vocab_hash`), and a draft replica whose model
  disagrees refuses it with FAILED_PRECONDITION. The coordinator then runs that request without
  speculation (`NoDraftSession`) rather than failing it, logs the refusal once and counts it
  (`DraftCompat.refused`). The refusal is the open's own reply, so this costs no extra round
  trip, and it follows replicas as they come and go (a rolling update of the draft pool).

Model-free methods (ngram, suffix) draft from the target's own token ids and are always
compatible. Every finished request is also counted as speculating or not, with the reason
(`speculation_state`), which is what the "speculation off" alert in k8s/prometheus/ watches.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import grpc

from draft_service.proposers.base import Proposal
from specd.vocab import MISMATCH_MARK, vocab_mismatch

if TYPE_CHECKING:
    from specd.telemetry import Telemetry

log = logging.getLogger(__name__)

# Why a request did not speculate (the `specd.speculation.reason` metric attribute).
OFF_REQUESTED = "requested"  # method none or k = 0, asked for by the client or configured
OFF_INCOMPATIBLE = "incompatible_draft"  # the draft replica refused: another vocabulary
OFF_NO_DRAFTS = "no_drafts"  # a draft session was open but no step carried a draft token
# Why speculation was refused (the `specd.reason` attribute of the disabled counter).
REASON_VOCAB = "vocab_mismatch"
REASON_METHOD = "method_unavailable"  # the replica does not serve the method (no draft model loaded)
MODEL_FREE = "model-free"  # the name a draft replica without a draft model reports


def speculation_state(method: str, off_reason: str | None, num_drafts: int, target_passes: int) -> tuple[str, str]:
    """("on", "") when a finished request speculated, else ("off", why).

    method: the method the request ran with ("none" when it asked for no speculation);
    off_reason: set when speculation was turned off for it (e.g. OFF_INCOMPATIBLE);
    num_drafts: its verify steps that carried at least one draft token;
    target_passes: its target forward passes, prefill included (1: it never reached a step at
    which it could have drafted, e.g. max_tokens 1, and counts as on).
    """
    if off_reason:
        return "off", off_reason
    if method == "none":
        return "off", OFF_REQUESTED
    if num_drafts == 0 and target_passes > 1:
        return "off", OFF_NO_DRAFTS
    return "on", ""


@dataclass(frozen=True)
class DraftReplicaCheck:
    """One draft replica's ModelInfo against the target's; `message` says why it is not compatible."""

    address: str
    draft_model: str  # "" for a model-free replica, or when it could not be asked
    compatible: bool
    message: str = ""


def check_draft_infos(target_model: str, target_hash: str, infos: Iterable[tuple[str, Any]]) -> list[DraftReplicaCheck]:
    """Checks (address, ModelInfo or None) pairs; None (unreachable) and model-free replicas pass."""
    checks = []
    for address, info in infos:
        name = "" if info is None or info.name == MODEL_FREE else info.name
        message = vocab_mismatch(target_model, target_hash, name, info.vocab_hash) if name else None
        checks.append(DraftReplicaCheck(address, name, message is None, message or ""))
    return checks


class NoDraftSession:
    """A draft session that never proposes: the request decodes one target pass per token."""

    def propose(self, k: int) -> Proposal:
        return Proposal()

    def propose_ahead(self, assumed: Sequence[int], k: int) -> Proposal:
        return Proposal()

    def append(self, tokens: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass


def is_refusal(exc: BaseException) -> bool:
    """A draft replica refused the session (FAILED_PRECONDITION): another vocabulary, or a
    replica that does not serve the method. Falling back beats failing the request."""
    code = getattr(exc, "code", None)
    return isinstance(exc, grpc.RpcError) and callable(code) and code() == grpc.StatusCode.FAILED_PRECONDITION


class DraftCompat:
    """What a coordinator knows about compatibility: the target's identity, which travels on every
    draft session open, and the reporting of refusals (logged once per message, counted always)."""

    def __init__(self, target_model: str, target_vocab_hash: str, telemetry: "Telemetry | None" = None):
        self.target_model = target_model
        self.target_vocab_hash = target_vocab_hash
        self.telemetry = telemetry
        self.refusals = 0
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def _count(self, method: str, draft_model: str, reason: str) -> None:
        tel = self.telemetry
        if tel is not None and tel.metrics_on:
            attrs = {"gen_ai.request.model": self.target_model, "specd.method": method, "specd.reason": reason}
            if draft_model:
                attrs["specd.draft.model"] = draft_model
            tel.coordinator.speculation_disabled.add(1, attrs)

    def _log_once(self, message: str) -> bool:
        with self._lock:
            if message in self._logged:
                return False
            self._logged.add(message)
            return True

    def check_startup(self, infos: Iterable[tuple[str, Any]]) -> list[DraftReplicaCheck]:
        """Logs and counts every known draft replica whose draft model disagrees with the target."""
        checks = check_draft_infos(self.target_model, self.target_vocab_hash, infos)
        for c in checks:
            if c.compatible:
                continue
            if self._log_once(f"startup {c.address}: {c.message}"):
                log.error("draft replica %s is incompatible: %s. Requests with method draft_model that land on it "
                          "run without speculation.", c.address, c.message)
            self._count("draft_model", c.draft_model, REASON_VOCAB)
        return checks

    def refused(self, method: str, details: str, draft_model: str = "", steps: Any = None) -> None:
        """A draft session open was refused: log once per distinct message, count it, and mark the
        request (its StepTelemetry, when telemetry is on) as not speculating."""
        with self._lock:
            self.refusals += 1
        if steps is not None and not draft_model:
            draft_model = steps.attrs.get("specd.draft.model", "")
        if self._log_once(f"session: {details}"):
            log.error("draft session refused (%s); serving such requests without speculation", details)
        self._count(method, draft_model, REASON_VOCAB if MISMATCH_MARK in details else REASON_METHOD)
        if steps is not None:
            steps.off_reason = OFF_INCOMPATIBLE


def check_draft_pool(compat: DraftCompat, pool: Any, timeout: float = 2.0) -> list[DraftReplicaCheck]:
    """Asks every draft replica `pool` knows now for its ModelInfo and checks it (see
    `DraftCompat.check_startup`); a replica that does not answer within `timeout` passes (its
    sessions are still checked when they open)."""
    from specdec.v1 import common_pb2, draft_pb2_grpc

    infos: list[tuple[str, Any]] = []
    for replica in list(pool.replicas):
        try:
            info = draft_pb2_grpc.DraftServiceStub(replica.channel).GetModelInfo(
                common_pb2.GetModelInfoRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            log.info("draft replica %s did not answer GetModelInfo (%s); its sessions are checked when they open",
                     replica.address, exc.code())  # type: ignore[attr-defined]
            info = None
        infos.append((replica.address, info))
    return compat.check_startup(infos)
