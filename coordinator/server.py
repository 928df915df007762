"""The coordinator's gRPC front end: protobuf in, the shared GenerationService, protobuf out."""

from __future__ import annotations

import logging
from typing import Iterator

import grpc

from coordinator.service import GenerationService, PromptInput, RequestHandle
from specd.errors import InvalidArgument
from specd.grpc_server import grpc_errors
from specd.wire import FINISH_TO_PROTO, METHOD_TO_PROTO, method_from_proto, sampling_from_proto
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "specdec.v1.Coordinator"


def downstream_timeout(context: grpc.ServicerContext) -> float | None:
    """The client's remaining deadline, for the calls made on its behalf (None: no deadline).

    grpc reports "no deadline" as a time_remaining of astronomically many seconds.
    """
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 10**7 else remaining


def prompt_from_proto(request: coordinator_pb2.GenerateRequest) -> PromptInput:
    which = request.WhichOneof("input")
    if which == "prompt":
        return PromptInput(text=request.prompt)
    if which == "messages":
        return PromptInput(messages=[{"role": m.role, "content": m.content} for m in request.messages.messages])
    if which == "prompt_token_ids":
        return PromptInput(token_ids=list(request.prompt_token_ids.ids))
    raise InvalidArgument("prompt", "send a prompt, messages or prompt_token_ids")


def result_to_proto(handle: RequestHandle) -> coordinator_pb2.GenerateResult:
    gen, s, times = handle.generation, handle.generation.stats, handle.times
    return coordinator_pb2.GenerateResult(
        text=handle.text,
        token_ids=gen.token_ids,
        finish_reason=FINISH_TO_PROTO.get(gen.finish_reason or "", 0),
        usage=coordinator_pb2.Usage(prompt_tokens=len(gen.prompt_ids), completion_tokens=len(gen.token_ids),
                                    total_tokens=len(gen.prompt_ids) + len(gen.token_ids)),
        stats=coordinator_pb2.SpeculationStats(
            num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
            acceptance_rate=s.acceptance_rate, mean_acceptance_length=s.mean_acceptance_length,
            target_forward_passes=s.target_forward_passes, accepted_per_position=s.accepted_per_position,
            method=METHOD_TO_PROTO[handle.method], k=handle.k, depth=handle.depth, k_per_step=s.k_per_step,
            pipeline_hits=s.pipeline_hits, pipeline_misses=s.pipeline_misses),
        timings=coordinator_pb2.Timings(
            time_to_first_token_ms=(gen.time_to_first_token or 0.0) * 1000, duration_ms=(gen.duration or 0.0) * 1000,
            draft_ms=times.draft_ms, verify_ms=times.verify_ms, rpc_overhead_ms=times.rpc_overhead_ms),
        request_id=handle.request_id,
    )


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, service: GenerationService):
        self.service = service

    def _start(self, request: coordinator_pb2.GenerateRequest, context: grpc.ServicerContext) -> RequestHandle:
        method = k = pipeline = None
        depth = ""
        if request.HasField("speculation"):
            spec = request.speculation
            method = method_from_proto(spec.method)
            k = spec.k if spec.HasField("k") else None
            depth = spec.depth
            pipeline = spec.pipeline if spec.HasField("pipeline") else None
        carrier = dict(context.invocation_metadata()) if self.service.telemetry.tracing_on else None
        return self.service.start(prompt_from_proto(request), sampling_from_proto(request.params), method, k,
                                  request.request_id, downstream_timeout(context), trace_carrier=carrier,
                                  depth=depth, pipeline=pipeline)

    # Admission comes first: a request that waits in the queue holds nothing on the replicas.

    @grpc_errors
    def Generate(self, request, context) -> Iterator[coordinator_pb2.GenerateResponse]:
        with self.service.admission.acquire(downstream_timeout(context), context.is_active):
            handle = self._start(request, context)
            with self.service.track():
                try:
                    steps = handle.generation.stats.k_per_step
                    for index, (ids, text) in enumerate(handle):
                        if not context.is_active():
                            return
                        # chunk 0 is the prefill's token, chunk i the output of verify step i (the
                        # text stream's flush at the end is no step's)
                        k = steps[index - 1] if 1 <= index <= len(steps) else None
                        yield coordinator_pb2.GenerateResponse(chunk=coordinator_pb2.TokenChunk(token_ids=ids, text=text, k=k))
                    yield coordinator_pb2.GenerateResponse(result=result_to_proto(handle))
                finally:
                    handle.close()

    @grpc_errors
    def GenerateUnary(self, request, context) -> coordinator_pb2.GenerateResult:
        with self.service.admission.acquire(downstream_timeout(context), context.is_active):
            handle = self._start(request, context)
            with self.service.track():
                try:
                    for _ in handle:
                        if not context.is_active():
                            break
                finally:
                    handle.close()
        return result_to_proto(handle)


def register(servicer: CoordinatorServicer):
    def _register(server: grpc.Server) -> None:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)

    return _register
