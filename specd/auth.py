"""Bearer-token authentication of the coordinator's client API (gRPC metadata and HTTP headers).

The token comes from the config (`api_token`, i.e. `SPECD_API_TOKEN`) or a file
(`api_token_file`, e.g. a mounted Kubernetes Secret; read once at start, surrounding whitespace
stripped). Clients send `authorization: Bearer <token>`. Health checking and server reflection
stay open so that probes and `grpcurl list` work without it; every other method answers
UNAUTHENTICATED (HTTP 401) to a missing or wrong token.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import grpc

from specd.grpc_server import HEALTH_SERVICE_NAME, REFLECTION_SERVICE_NAME

# Services every caller may use: probes and service discovery.
OPEN_SERVICES = (HEALTH_SERVICE_NAME, REFLECTION_SERVICE_NAME, "grpc.reflection.v1.ServerReflection")
TOKEN_ENV = "SPECD_API_TOKEN"


def load_token(token: str | None, token_file: str | None) -> str | None:
    """The API token: `token` if set, else the contents of `token_file`; None when neither is set
    (no authentication). Raises ValueError for an unreadable or empty file."""
    if token:
        return token
    if not token_file:
        return None
    try:
        value = Path(token_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"api_token_file: cannot read {token_file}: {exc.strerror or exc}") from None
    if not value:
        raise ValueError(f"api_token_file: {token_file} is empty")
    return value


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def token_matches(expected: str, presented: str | None) -> bool:
    """Constant-time comparison, so response timing does not leak the token."""
    return presented is not None and hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8"))


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries `token` (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _service_of(method: str) -> str:
    """"/pkg.Service/Method" -> "pkg.Service"."""
    return method.lstrip("/").split("/", 1)[0]


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by an UNAUTHENTICATED abort (same call shape)."""

    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return handler._replace(stream_stream=refuse)
    if handler.request_streaming:
        return handler._replace(stream_unary=refuse)
    if handler.response_streaming:
        return handler._replace(unary_stream=refuse)
    return handler._replace(unary_unary=refuse)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` (except `open_services`)."""

    def __init__(self, token: str, open_services: Collection[str] = OPEN_SERVICES):
        if not token:
            raise ValueError("the API token must not be empty")
        self.token = token
        self.open_services = frozenset(open_services)

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or _service_of(details.method) in self.open_services:
            return handler
        metadata = dict(details.invocation_metadata or ())
        presented = bearer_token(metadata.get("authorization"))
        if token_matches(self.token, presented):
            return handler
        reason = "missing bearer token" if presented is None else "invalid bearer token"
        return _refusing(handler, f"{reason}: send the metadata 'authorization: Bearer <token>'")
