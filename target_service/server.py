"""The target service: gRPC in, verifier sessions and the batching scheduler, gRPC out."""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterator

import grpc

from draft_service.proposers.base import Proposal
from specd.errors import InvalidArgument, ResourceExhausted, Unavailable
from specd.features import features_to_proto
from specd.grpc_server import grpc_errors
from specd.models import LoadedModel
from specd.telemetry import Telemetry, noop_telemetry
from specd.validation import check_request_id
from specd.vocab import vocab_hash
from specd.wire import probs_from_proto, sampling_from_proto
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.kv_budget import session_limit
from target_service.kv_pool import KVShape
from target_service.scheduler import VerifyScheduler
from target_service.verifier import TargetModel, TargetSession

log = logging.getLogger(__name__)
SERVICE_NAME = "specdec.v1.TargetService"


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, model: LoadedModel, max_sessions: int = 64, max_batch_size: int = 16, batch_wait_ms: float = 5.0,
                 session_ttl_s: float = 600.0, telemetry: Telemetry | None = None, kv_budget_mb: float | None = None,
                 straggler_wait_ms: float = 40.0, packed_passes: bool = True, torch_threads: int | None = None):
        """torch_threads: see VerifyScheduler."""
        self.model = model
        self.telemetry = telemetry or noop_telemetry()
        self.session_ttl_s = session_ttl_s
        self._streams: dict[int, tuple[grpc.ServicerContext, list[float]]] = {}  # session id -> (context, [last activity])
        if session_ttl_s > 0:
            threading.Thread(target=self._expire_idle, daemon=True, name="specd-session-ttl").start()
        self.target = TargetModel(model, packed_passes)
        self.scheduler = VerifyScheduler(self.target, max_batch_size, batch_wait_ms, self.telemetry,
                                         straggler_wait_ms=straggler_wait_ms, torch_threads=torch_threads)
        if self.telemetry.metrics_on:
            self.telemetry.target.observe(lambda: len(self.target.sessions), lambda: self.scheduler.queue_depth)
        # The session limit: max_sessions, or fewer when a KV budget holds fewer worst-case sessions;
        # the pool never grows past it, nor past the model's context.
        self.session_limit = session_limit(max_sessions, KVShape.of(model.model.config).bytes_per_token(model.dtype),
                                           model.max_context, kv_budget_mb)
        self.max_sessions = self.session_limit.max_sessions
        self.target.forward.pool.set_limits(self.max_sessions, model.max_context)
        log.info("target session limit: %s", self.session_limit.describe())
        self.max_batch_size = max_batch_size
        self.draining = False
        self._admission = threading.Lock()
        self._info = common_pb2.ModelInfo(
            name=model.name,
            vocab_size=model.vocab_size,
            max_context=model.max_context,
            eos_token_ids=sorted(model.eos_token_ids),
            vocab_hash=vocab_hash(model.tokenizer, model.vocab_size),
        )

    def _expire_idle(self) -> None:
        """Cancel the streams of sessions idle for longer than the TTL; their handlers then free the KV rows."""
        while True:
            time.sleep(min(1.0, self.session_ttl_s / 4))
            now = time.monotonic()
            for session_id, (context, last) in list(self._streams.items()):
                if now - last[0] > self.session_ttl_s:
                    log.warning("session %s idle for over %.0f s: closing it", session_id, self.session_ttl_s)
                    context.cancel()

    def drain(self) -> None:
        """Refuse new sessions; open ones run to completion."""
        self.draining = True

    @grpc_errors
    def GetModelInfo(self, request, context) -> common_pb2.ModelInfo:
        return self._info

    @grpc_errors
    def GetStats(self, request, context) -> target_pb2.TargetStats:
        stats = self.scheduler.stats
        msg = target_pb2.TargetStats(
            open_sessions=len(self.target.sessions),
            max_sessions=self.max_sessions,
            queue_depth=self.scheduler.queue_depth,
            forward_passes=self.target.forward_passes,
            batch_occupancy=stats.mean_batch_size() / self.max_batch_size,
            serving=not self.draining,
        )
        with stats.lock:
            msg.prefills, msg.prefill_ms = stats.prefills, stats.prefill_ms
            if request.load_only:  # the tables are built under the interpreter lock the passes' thread needs
                return msg
            for size, count in sorted(stats.batch_sizes.items()):
                msg.batch_sizes.add(batch_size=size, count=count)
            for (size, block, positions), (count, total) in sorted(stats.latency.items()):
                msg.verify_latency.add(batch_size=size, block_length=block, positions=positions, count=count,
                                       mean_ms=total / count)
        return msg

    @grpc_errors
    def Session(self, request_iterator: Iterator[target_pb2.TargetRequest], context) -> Iterator[target_pb2.TargetResponse]:
        session: TargetSession | None = None
        last_activity = [time.monotonic()]
        try:
            for request in request_iterator:
                last_activity[0] = time.monotonic()
                kind = request.WhichOneof("kind")
                if kind == "open":
                    if session is not None:
                        raise InvalidArgument("open", "the session is already open")
                    # Spans never enclose a `yield`: the reply is built inside, sent outside.
                    with self.telemetry.server_span("target.prefill", request.trace_context) as span:
                        session = self._open(request.open)
                        self._streams[session.session_id] = (context, last_activity)
                        start = time.perf_counter()
                        token, timing = self.scheduler.prefill(session)
                        reply = target_pb2.TargetResponse(opened=target_pb2.TargetSessionOpened(
                            session_id=str(session.session_id), first_token_id=token, context_room=max(session.room, 0),
                            prefill_ms=timing.compute_ms, queue_ms=timing.queue_ms))
                        if session.new_features is not None:
                            reply.opened.features.CopyFrom(features_to_proto(*session.new_features))
                        if span is not None:
                            span.set_attributes({"specd.session_id": str(session.session_id),
                                                 "specd.request_id": request.open.request_id,
                                                 "specd.prompt_tokens": len(request.open.prompt_token_ids),
                                                 "specd.prefill_ms": timing.compute_ms, "specd.queue_ms": timing.queue_ms})
                    yield reply
                    log.debug("session %s prefilled in %.1f ms", session.session_id, (time.perf_counter() - start) * 1000)
                elif kind == "verify":
                    if session is None:
                        raise InvalidArgument("verify", "the first message of a session must be `open`")
                    with self.telemetry.server_span("target.verify", request.trace_context) as span:
                        block = request.verify
                        tokens = list(block.draft_token_ids)
                        probs = probs_from_proto(block.draft_probs, len(tokens), self.model.vocab_size)
                        outcome, timing = self.scheduler.verify(session, Proposal(tokens, probs))
                        reply = target_pb2.TargetResponse(verified=target_pb2.BlockVerified(
                            num_accepted=outcome.num_accepted, token_ids=outcome.tokens, verify_ms=timing.compute_ms,
                            batch_size=timing.batch_size, queue_ms=timing.queue_ms, context_room=max(session.room, 0),
                            pass_block_length=timing.block_length, pass_positions=timing.positions,
                            packed=timing.packed, pass_id=timing.pass_id))
                        if session.new_features is not None:
                            reply.verified.features.CopyFrom(features_to_proto(*session.new_features))
                        if span is not None:
                            span.set_attributes({"specd.session_id": str(session.session_id),
                                                 "specd.block_length": len(tokens) + 1,
                                                 "specd.num_accepted": outcome.num_accepted,
                                                 "specd.batch_size": timing.batch_size, "specd.queue_ms": timing.queue_ms,
                                                 "specd.verify_ms": timing.compute_ms})
                    yield reply
                else:
                    raise InvalidArgument("kind", "a session message must be `open` or `verify`")
                last_activity[0] = time.monotonic()
        finally:
            if session is not None:
                self._streams.pop(session.session_id, None)
                session.close()
                self.scheduler.forget(session)

    def _open(self, msg: target_pb2.OpenTargetSession) -> TargetSession:
        if self.draining:
            raise Unavailable("this target replica is draining; open the session on another replica")
        check_request_id(msg.request_id)
        params = sampling_from_proto(msg.params)
        with self._admission:
            if len(self.target.sessions) >= self.max_sessions:
                raise ResourceExhausted(f"this target replica holds its limit of {self.max_sessions} sessions; retry later")
            session = self.target.open_session(list(msg.prompt_token_ids), params)
        session.want_features = msg.return_features
        return session


def register(servicer: TargetServicer):
    def _register(server: grpc.Server) -> None:
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)

    return _register
