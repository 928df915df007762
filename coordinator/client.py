"""A small client of the coordinator's Generate API (used by `specd generate --address`, tests, bench)."""

from __future__ import annotations

from typing import Iterator

import grpc

from specd.auth import auth_metadata
from specd.grpc_server import make_channel
from specd.sampling import SamplingParams
from specd.tls import ClientTLS
from specd.wire import METHOD_TO_PROTO, sampling_to_proto
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc


def build_request(prompt: str | list[int], params: SamplingParams, chat: bool = False, method: str | None = None,
                  k: int | str | None = None, request_id: str = "",
                  pipeline: bool | None = None) -> coordinator_pb2.GenerateRequest:
    """k: a fixed depth (int or digits) or a depth policy ("auto", "schedule:...", "...,floor=A")."""
    req = coordinator_pb2.GenerateRequest(params=sampling_to_proto(params), request_id=request_id)
    if isinstance(prompt, list):
        req.prompt_token_ids.ids.extend(prompt)
    elif chat:
        req.messages.messages.add(role="user", content=prompt)
    else:
        req.prompt = prompt
    if method is not None:
        req.speculation.method = METHOD_TO_PROTO[method]
    if k is not None:
        if isinstance(k, int) or str(k).strip().isdigit():
            req.speculation.k = int(k)
        else:
            req.speculation.depth = str(k)
    if pipeline is not None:
        req.speculation.pipeline = pipeline
    return req


class CoordinatorClient:
    """`token`: the bearer token the coordinator requires; `tls`: its CA (and a client certificate
    for mutual TLS); both default to none (plaintext, no token)."""

    def __init__(self, address: str, token: str | None = None, tls: ClientTLS | None = None):
        self.channel = make_channel(address, tls=tls)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.metadata = auth_metadata(token)

    def stream(self, request: coordinator_pb2.GenerateRequest, timeout: float | None = None) -> Iterator[coordinator_pb2.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def generate(self, request: coordinator_pb2.GenerateRequest, timeout: float | None = None) -> coordinator_pb2.GenerateResult:
        return self.stub.GenerateUnary(request, timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def result_to_dict(result: coordinator_pb2.GenerateResult) -> dict:
    """The same JSON shape `specd generate --json` prints in embedded mode."""
    s = result.stats
    return {
        "text": result.text,
        "token_ids": list(result.token_ids),
        "prompt_tokens": result.usage.prompt_tokens,
        "finish_reason": {1: "stop", 2: "length"}.get(result.finish_reason, "unknown"),
        "time_to_first_token_s": round(result.timings.time_to_first_token_ms / 1000, 4),
        "duration_s": round(result.timings.duration_ms / 1000, 4),
        "request_id": result.request_id,
        "stats": {
            "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "acceptance_rate": round(s.acceptance_rate, 4),
            "mean_acceptance_length": round(s.mean_acceptance_length, 4),
            "target_forward_passes": s.target_forward_passes,
            "accepted_per_position": list(s.accepted_per_position),
        },
        "timings_ms": {
            "draft": round(result.timings.draft_ms, 2),
            "verify": round(result.timings.verify_ms, 2),
            "rpc_overhead": round(result.timings.rpc_overhead_ms, 2),
        },
    }


__all__ = ["CoordinatorClient", "build_request", "result_to_dict", "grpc"]
