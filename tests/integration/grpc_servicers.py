"""Tiny servicers of the real specdec.v1 services for the gRPC plumbing tests (no models).

Run as `python -m tests.integration.grpc_servicers` it serves EchoTarget on a free port with the
signal handlers installed, prints "PORT <n>", and exits 0 once drained: the SIGTERM test's server.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator

import grpc

from specd import errors
from specd.config import TargetConfig
from specd.grpc_server import build_server, grpc_errors, make_channel
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, target_pb2, target_pb2_grpc

TARGET_SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
COORDINATOR_SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name

MODEL_INFO = common_pb2.ModelInfo(name="echo", vocab_size=100, max_context=64, eos_token_ids=[2], vocab_hash="h")
SLOW_S = 0.5
SECRET = "secret-internal-detail"

# GetModelInfo's behaviour, chosen by the "mode" metadata key.
RAISERS = {
    "invalid": lambda: errors.InvalidArgument("params.top_k", "must not be negative"),
    "too_long": lambda: errors.PromptTooLong(100, 64),
    "failed_precondition": lambda: errors.FailedPrecondition("the session is not open"),
    "resource_exhausted": lambda: errors.ResourceExhausted("all 64 sessions are taken"),
    "unavailable": lambda: errors.Unavailable("draining"),
    "not_found": lambda: errors.NotFound("no session s9"),
    "timeout": lambda: TimeoutError("the forward pass took too long"),
    "boom": lambda: RuntimeError(SECRET),
}


def _mode(context: grpc.ServicerContext) -> str:
    return dict(context.invocation_metadata()).get("mode", "ok")


class EchoTarget(target_pb2_grpc.TargetServiceServicer):
    """GetModelInfo answers MODEL_INFO or fails as the "mode" metadata asks; Session echoes each
    verify block back as accepted, plus token 0. A session opened with request_id "slow" sleeps
    SLOW_S per verify, and "boom" fails unexpectedly."""

    def __init__(self) -> None:
        self.entered = threading.Event()  # set when a slow handler starts sleeping
        self.session_ended = threading.Event()  # set when a Session handler returns or raises

    @grpc_errors
    def GetModelInfo(self, request: common_pb2.GetModelInfoRequest, context: grpc.ServicerContext) -> common_pb2.ModelInfo:
        mode = _mode(context)
        if mode == "slow":
            self.entered.set()
            time.sleep(SLOW_S)
        if mode == "abort":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "no entry")
        if mode in RAISERS:
            raise RAISERS[mode]()
        return MODEL_INFO

    @grpc_errors
    def Session(self, request_iterator: Iterator[target_pb2.TargetRequest],
                context: grpc.ServicerContext) -> Iterator[target_pb2.TargetResponse]:
        self.session_ended.clear()
        try:
            yield from self._session(request_iterator)
        finally:
            self.session_ended.set()

    def _session(self, request_iterator: Iterator[target_pb2.TargetRequest]) -> Iterator[target_pb2.TargetResponse]:
        opened: target_pb2.OpenTargetSession | None = None
        for request in request_iterator:
            kind = request.WhichOneof("kind")
            if opened is None:
                if kind != "open":
                    raise errors.InvalidArgument("open", "the first message of a session must be open")
                if not request.open.prompt_token_ids:
                    raise errors.InvalidArgument("open.prompt_token_ids", "must not be empty")
                if request.open.request_id == "boom":
                    raise RuntimeError(SECRET)
                opened = request.open
                yield target_pb2.TargetResponse(opened=target_pb2.TargetSessionOpened(
                    session_id="s1", first_token_id=opened.prompt_token_ids[-1]))
                continue
            if kind != "verify":
                raise errors.FailedPrecondition("the session is already open")
            if opened.request_id == "slow":
                self.entered.set()
                time.sleep(SLOW_S)
            ids = list(request.verify.draft_token_ids)
            yield target_pb2.TargetResponse(verified=target_pb2.BlockVerified(num_accepted=len(ids), token_ids=ids + [0]))


class ProxyCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Generate streams one chunk, then fails if the prompt is "bad". GenerateUnary calls the
    target's GetModelInfo with the prompt as mode, so downstream errors pass through."""

    def __init__(self) -> None:
        self.target_address = ""

    @grpc_errors
    def Generate(self, request: coordinator_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[coordinator_pb2.GenerateResponse]:
        yield coordinator_pb2.GenerateResponse(chunk=coordinator_pb2.TokenChunk(token_ids=[1], text="a"))
        if request.prompt == "bad":
            raise errors.InvalidArgument("params.max_tokens", "must be at least 1")
        yield coordinator_pb2.GenerateResponse(result=coordinator_pb2.GenerateResult(text="a", token_ids=[1]))

    @grpc_errors
    def GenerateUnary(self, request: coordinator_pb2.GenerateRequest,
                      context: grpc.ServicerContext) -> coordinator_pb2.GenerateResult:
        with make_channel(self.target_address) as channel:
            info = target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(
                common_pb2.GetModelInfoRequest(), metadata=(("mode", request.prompt),), timeout=10)
        return coordinator_pb2.GenerateResult(text=info.name)


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    servicer = EchoTarget()
    handle = build_server(TargetConfig(port=0, max_workers=4, grace_seconds=5.0),
                          lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server),
                          [TARGET_SERVICE])
    handle.add_drain_hook(lambda: print("drain hook called", flush=True))
    handle.install_signal_handlers()
    print(f"PORT {handle.port}", flush=True)
    handle.wait()
    print("exited cleanly", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
