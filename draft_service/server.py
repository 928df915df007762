"""The draft service: one bidirectional stream per session, feedback in, draft blocks out."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Iterator, Sequence

import grpc

from draft_service.proposers import METHODS, Proposer, make_proposer
from draft_service.head.checkpoint import LoadedHead
from draft_service.proposers.base import DraftSession
from specd.errors import FailedPrecondition, InvalidArgument
from specd.features import features_from_proto
from specd.grpc_server import grpc_errors
from specd.models import LoadedModel
from specd.telemetry import Telemetry, noop_telemetry
from specd.validation import check_request_id
from specd.vocab import check_vocab
from specd.wire import METHOD_TO_PROTO, method_from_proto, model_info_of, probs_to_proto, sampling_from_proto
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "specdec.v1.DraftService"
MAX_K = 64


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Serves every model-free method, plus draft_model when a draft model is loaded."""

    def __init__(self, default_method: str = "ngram", draft_model: LoadedModel | None = None, info: common_pb2.ModelInfo | None = None,
                 telemetry: Telemetry | None = None, head: LoadedHead | None = None, max_context: int = 0):
        """head: a trained draft head bound to its target's embedding and LM head (method head);
        max_context: that target's context."""
        if default_method not in METHODS or default_method == "none":
            raise ValueError(f"draft method must be one of ngram, suffix, draft_model, head; got {default_method!r}")
        if default_method == "draft_model" and draft_model is None:
            raise ValueError("method draft_model needs --model (the draft model)")
        if default_method == "head" and head is None:
            raise ValueError("method head needs a trained head (--head DIR, made by specd train-draft)")
        self.default_method = default_method
        self.proposers: dict[str, Proposer] = {m: make_proposer(m) for m in ("ngram", "suffix")}  # type: ignore[misc]
        if draft_model is not None:
            self.proposers["draft_model"] = make_proposer("draft_model", draft_model)  # type: ignore[assignment]
        self.head = head
        if head is not None:
            self.proposers["head"] = make_proposer("head", head=head, max_context=max_context)  # type: ignore[assignment]
        if info is None:  # sessions of draft_model are checked against its vocab_hash
            info = model_info_of(draft_model) if draft_model is not None else common_pb2.ModelInfo(name="model-free")
        self.info = info
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.open_sessions = 0
        self.blocks = 0
        self.draft_ms_total = 0.0
        self.telemetry = telemetry or noop_telemetry()
        if self.telemetry.metrics_on:
            self.telemetry.draft.observe(lambda: self.open_sessions)
        # Per-method metric attributes, built once (with the draft model's name for draft_model).
        self._method_attrs: dict[str, dict[str, str]] = {m: {"specd.method": m} for m in self.proposers}
        if draft_model is not None:
            self._method_attrs["draft_model"]["specd.draft.model"] = draft_model.name
        if head is not None:
            self._method_attrs["head"]["specd.draft.model"] = str(head.meta.get("name", "head"))

    @grpc_errors
    def GetModelInfo(self, request, context) -> common_pb2.ModelInfo:
        return self.info

    @grpc_errors
    def GetStats(self, request, context) -> draft_pb2.DraftStats:
        with self._lock:
            return draft_pb2.DraftStats(
                open_sessions=self.open_sessions,
                methods=[METHOD_TO_PROTO[m] for m in sorted(self.proposers)],
                blocks=self.blocks,
                mean_draft_ms=self.draft_ms_total / self.blocks if self.blocks else 0.0,
            )

    @grpc_errors
    def Session(self, request_iterator: Iterator[draft_pb2.DraftRequest], context) -> Iterator[draft_pb2.DraftBlock]:
        session: DraftSession | None = None
        session_id = ""
        method = ""
        try:
            for request in request_iterator:
                kind = request.WhichOneof("kind")
                if kind == "open":
                    if session is not None:
                        raise InvalidArgument("open", "the session is already open")
                    # Spans never enclose a `yield`: the reply is built inside, sent outside.
                    with self.telemetry.server_span("draft.open", request.trace_context) as span:
                        session = self._open(request.open)
                        session_id = str(next(self._ids))
                        method = method_from_proto(request.open.method) or self.default_method
                        with self._lock:
                            self.open_sessions += 1
                        if span is not None:
                            span.set_attributes({"specd.session_id": session_id, "specd.method": method,
                                                 "specd.request_id": request.open.request_id,
                                                 "specd.prompt_tokens": len(request.open.prompt_token_ids)})
                    yield draft_pb2.DraftBlock(session_id=session_id)
                elif kind == "step":
                    if session is None:
                        raise InvalidArgument("step", "the first message of a session must be `open`")
                    with self.telemetry.server_span("draft.propose", request.trace_context) as span:
                        block = self._step(session, session_id, request.step, method)
                        if span is not None:
                            span.set_attributes({"specd.session_id": session_id, "specd.method": method,
                                                 "specd.k": request.step.k,
                                                 "specd.appended_tokens": len(request.step.appended_token_ids),
                                                 "specd.block_length": len(block.token_ids),
                                                 "specd.draft_ms": block.draft_ms})
                    yield block
                else:
                    raise InvalidArgument("kind", "a draft session message must be `open` or `step`")
        finally:
            if session is not None:
                session.close()
                with self._lock:
                    self.open_sessions -= 1

    def _open(self, msg: draft_pb2.OpenDraftSession) -> DraftSession:
        method = method_from_proto(msg.method) or self.default_method
        if method == "none":
            raise InvalidArgument("method", "method none needs no draft session")
        if method not in self.proposers:
            raise FailedPrecondition(f"this draft replica serves {', '.join(sorted(self.proposers))}, not {method}")
        if not msg.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids", "the prompt is empty")
        check_request_id(msg.request_id)
        self._check_ids("prompt_token_ids", msg.prompt_token_ids, method)
        if method == "draft_model":  # model-free methods draft the target's own ids: always compatible
            check_vocab(msg.target_model, msg.target_vocab_hash, self.info.name, self.info.vocab_hash)
        if method == "head" and self.head is not None:  # a head drafts from (and for) the target it was trained on
            check_vocab(msg.target_model, msg.target_vocab_hash, f"the draft head for {self.head.meta.get('target_model')}",
                        str(self.head.meta.get("target_vocab_hash", "")))
        return self.proposers[method].open_session(list(msg.prompt_token_ids), sampling_from_proto(msg.params))

    def _check_ids(self, field: str, ids: Sequence[int], method: str) -> None:
        """A draft model's ids must index its vocabulary; model-free methods take any id."""
        vocab = self.info.vocab_size if method == "draft_model" else 0
        if method == "head" and self.head is not None:
            vocab = self.head.vocab_size
        if vocab and any(t >= vocab for t in ids):
            raise InvalidArgument(field, f"token id {max(ids)} is outside the draft model's vocabulary (0..{vocab - 1})")

    def _step(self, session: DraftSession, session_id: str, step: draft_pb2.DraftStep, method: str = "") -> draft_pb2.DraftBlock:
        if step.k > MAX_K:
            raise InvalidArgument("k", f"at most {MAX_K} draft tokens per step, got {step.k}")
        self._check_ids("appended_token_ids", step.appended_token_ids, method)
        start = time.perf_counter()
        if step.HasField("target_features"):
            self._add_features(session, step.target_features)
        if step.appended_token_ids:
            session.append(list(step.appended_token_ids))
        block = draft_pb2.DraftBlock(session_id=session_id)
        if step.k:
            assumed = list(step.assumed_token_ids)
            proposal = session.propose_ahead(assumed, step.k) if assumed else session.propose(step.k)
            block.token_ids.extend(proposal.tokens)
            probs = probs_to_proto(proposal.probs)
            if probs is not None:
                block.probs.CopyFrom(probs)
        block.draft_ms = (time.perf_counter() - start) * 1000
        if step.k:
            with self._lock:
                self.blocks += 1
                self.draft_ms_total += block.draft_ms
            if self.telemetry.metrics_on:
                m = self.telemetry.draft
                attrs = self._method_attrs.get(method) or {"specd.method": method}
                m.blocks.add(1, attrs)
                m.tokens.add(len(block.token_ids), attrs)
                m.duration.record(block.draft_ms / 1000, attrs)
        return block

    def _add_features(self, session: DraftSession, msg) -> None:
        """The target's features, for sessions that read them (method head); others ignore them."""
        add = getattr(session, "add_features", None)
        if add is None:
            return
        start, rows = features_from_proto(msg)
        width = self.head.head.config.hidden_size if self.head is not None else rows.shape[1]
        if rows.shape[1] != width:
            raise InvalidArgument("target_features", f"rows of {rows.shape[1]} values; this head reads {width}")
        try:
            add(start, rows)
        except ValueError as exc:
            raise InvalidArgument("target_features", str(exc)) from exc


def register(servicer: DraftServicer):
    def _register(server: grpc.Server) -> None:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)

    return _register
