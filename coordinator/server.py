"""The coordinator service: client requests in, the engine's loop over the draft and target pools."""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import grpc

from coordinator.engine import Generation, SpeculativeEngine
from coordinator.remote import CallTimes, RemoteProposer, RemoteVerifier, ReplicaPool
from specd.errors import InvalidArgument
from specd.grpc_server import grpc_errors
from specd.models import encode_chat
from specd.text import TextStream, visible_text
from specd.wire import FINISH_TO_PROTO, METHOD_TO_PROTO, method_from_proto, sampling_from_proto
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "specdec.v1.Coordinator"
MAX_K = 32


def downstream_timeout(context: grpc.ServicerContext) -> float | None:
    """The client's remaining deadline, for the calls made on its behalf (None: no deadline).

    grpc reports "no deadline" as a time_remaining of astronomically many seconds.
    """
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 10**7 else remaining


@dataclass
class RequestPlan:
    prompt_ids: list[int]
    method: str
    k: int
    request_id: str


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, targets: ReplicaPool, drafts: ReplicaPool | None, tokenizer: Any, model_info: common_pb2.ModelInfo,
                 method: str = "ngram", k: int = 8):
        self.targets = targets
        self.drafts = drafts
        self.tokenizer = tokenizer
        self.info = model_info
        self.eos_token_ids = frozenset(model_info.eos_token_ids)
        self.method = method if drafts is not None else "none"
        self.k = k
        self.active = 0
        self._lock = threading.Lock()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _plan(self, request: coordinator_pb2.GenerateRequest) -> RequestPlan:
        which = request.WhichOneof("input")
        if which == "prompt":
            if not request.prompt:
                raise InvalidArgument("prompt", "the prompt is empty")
            ids = list(self.tokenizer(request.prompt)["input_ids"])
        elif which == "messages":
            msgs = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            if not msgs:
                raise InvalidArgument("messages", "no messages")
            bad = [m["role"] for m in msgs if m["role"] not in ("system", "user", "assistant")]
            if bad:
                raise InvalidArgument("messages.role", f"unknown role {bad[0]!r}; use system, user or assistant")
            ids = encode_chat(self.tokenizer, msgs)
        elif which == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
        else:
            raise InvalidArgument("prompt", "send a prompt, messages or prompt_token_ids")
        if not ids:
            raise InvalidArgument("prompt", "the prompt is empty")
        method = self.method
        k = self.k
        if request.HasField("speculation"):
            method = method_from_proto(request.speculation.method) or method
            if request.speculation.HasField("k"):
                k = request.speculation.k
                if k > MAX_K:
                    raise InvalidArgument("speculation.k", f"must be at most {MAX_K}, got {k}")
        if method != "none" and self.drafts is None:
            raise InvalidArgument("speculation.method", "this coordinator has no draft pool; use method none")
        if k == 0:
            method = "none"
        return RequestPlan(ids, method, k, request.request_id or uuid.uuid4().hex)

    def _start(self, request: coordinator_pb2.GenerateRequest, context: grpc.ServicerContext) -> tuple[Generation, RequestPlan, CallTimes]:
        plan = self._plan(request)
        params = sampling_from_proto(request.params)
        times = CallTimes()
        timeout = downstream_timeout(context)
        verifier = RemoteVerifier(self.targets, plan.request_id, timeout, times)
        proposer = None
        if plan.method != "none":
            proposer = RemoteProposer(self.drafts, plan.method, plan.request_id, timeout, times)  # type: ignore[arg-type]
        engine = SpeculativeEngine(verifier, proposer, k=plan.k, eos_token_ids=self.eos_token_ids, decode=self.decode)
        return engine.generate(plan.prompt_ids, params), plan, times

    def _result(self, gen: Generation, plan: RequestPlan, times: CallTimes, params_stop: tuple[str, ...]) -> coordinator_pb2.GenerateResult:
        text = visible_text(self.decode(gen.token_ids), params_stop, final=True)
        s = gen.stats
        return coordinator_pb2.GenerateResult(
            text=text,
            token_ids=gen.token_ids,
            finish_reason=FINISH_TO_PROTO.get(gen.finish_reason or "", 0),
            usage=coordinator_pb2.Usage(prompt_tokens=len(gen.prompt_ids), completion_tokens=len(gen.token_ids),
                                        total_tokens=len(gen.prompt_ids) + len(gen.token_ids)),
            stats=coordinator_pb2.SpeculationStats(
                num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
                acceptance_rate=s.acceptance_rate, mean_acceptance_length=s.mean_acceptance_length,
                target_forward_passes=s.target_forward_passes, accepted_per_position=s.accepted_per_position,
                method=METHOD_TO_PROTO[plan.method], k=plan.k if plan.method != "none" else 0),
            timings=coordinator_pb2.Timings(
                time_to_first_token_ms=(gen.time_to_first_token or 0.0) * 1000, duration_ms=(gen.duration or 0.0) * 1000,
                draft_ms=times.draft_ms, verify_ms=times.verify_ms, rpc_overhead_ms=times.rpc_overhead_ms),
            request_id=plan.request_id,
        )

    @grpc_errors
    def Generate(self, request, context) -> Iterator[coordinator_pb2.GenerateResponse]:
        gen, plan, times = self._start(request, context)
        text = TextStream(self.decode, request.params.stop)
        with self._lock:
            self.active += 1
        try:
            for chunk in gen:
                if not context.is_active():
                    return
                yield coordinator_pb2.GenerateResponse(chunk=coordinator_pb2.TokenChunk(token_ids=chunk, text=text.push(chunk)))
            rest = text.flush()
            if rest:
                yield coordinator_pb2.GenerateResponse(chunk=coordinator_pb2.TokenChunk(text=rest))
            yield coordinator_pb2.GenerateResponse(result=self._result(gen, plan, times, tuple(request.params.stop)))
        finally:
            gen.close()
            with self._lock:
                self.active -= 1

    @grpc_errors
    def GenerateUnary(self, request, context) -> coordinator_pb2.GenerateResult:
        gen, plan, times = self._start(request, context)
        try:
            for _ in gen:
                if not context.is_active():
                    break
        finally:
            gen.close()
        return self._result(gen, plan, times, tuple(request.params.stop))


def register(servicer: CoordinatorServicer):
    def _register(server: grpc.Server) -> None:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)

    return _register
