"""The coordinator's security settings from its config: the API token, and TLS to the replicas."""

from __future__ import annotations

from dataclasses import dataclass

from specd.auth import load_token
from specd.grpc_server import server_tls_of, set_default_client_tls
from specd.tls import ClientTLS, ServerTLS, client_tls


@dataclass(frozen=True)
class CoordinatorSecurity:
    token: str | None  # bearer token of the client API (None: open)
    server: ServerTLS | None  # TLS of its gRPC and HTTP APIs (None: plaintext)
    upstream: ClientTLS | None  # TLS of its channels to target and draft replicas (None: plaintext)

    def describe(self) -> str:
        api = "plaintext" if self.server is None else ("mutual TLS" if self.server.require_client_cert else "TLS")
        up = "plaintext" if self.upstream is None else ("mutual TLS" if self.upstream.cert else "TLS")
        return f"client API {api}, bearer token {'required' if self.token else 'off'}; replicas over {up}"


def coordinator_security(cfg: object) -> CoordinatorSecurity:
    """Reads the token (config or file), checks the TLS settings, and makes every channel the
    process opens to a replica use the upstream TLS. Call before any replica channel is opened.
    Raises ValueError for unreadable files or incomplete settings."""
    get = lambda name: getattr(cfg, name, None)  # noqa: E731
    token = load_token(get("api_token"), get("api_token_file"))
    ca = get("upstream_ca")
    cert = get("upstream_cert") or (get("tls_cert") if ca else None)
    key = get("upstream_key") or (get("tls_key") if ca else None)
    upstream = client_tls(ca, cert, key, get("upstream_server_name"))
    if upstream is not None:
        upstream.credentials()  # reads the files now: a bad path fails the start, not the first request
    set_default_client_tls(upstream)
    return CoordinatorSecurity(token, server_tls_of(cfg), upstream)
