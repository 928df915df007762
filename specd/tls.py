"""TLS and mutual TLS for specd's gRPC servers and channels, from certificate paths in the config.

Plaintext stays the default: a server serves TLS when it has a certificate and key, and asks its
clients for a certificate signed by its CA when `require_client_cert` is on (mutual TLS). A
channel uses TLS when it has a CA to verify the server with, and presents its own certificate
when it has one (the coordinator presents its certificate to the target and draft replicas).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate and key (PEM paths), and the CA that signs its clients' certificates."""

    cert: str
    key: str
    ca: str | None = None
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        if self.require_client_cert and not self.ca:
            raise ValueError("require_client_cert: needs tls_ca, the CA that signs the clients' certificates")

    def credentials(self) -> grpc.ServerCredentials:
        key, cert = _read(self.key, "tls_key"), _read(self.cert, "tls_cert")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=_read(self.ca, "tls_ca"),
                                           require_client_auth=self.require_client_cert)

    def uvicorn_options(self) -> dict[str, Any]:
        """The same settings for the HTTP API (uvicorn's ssl_* options)."""
        opts: dict[str, Any] = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.ca:
            opts["ssl_ca_certs"] = self.ca
        if self.require_client_cert:
            opts["ssl_cert_reqs"] = ssl.CERT_REQUIRED
        return opts


@dataclass(frozen=True)
class ClientTLS:
    """What a channel needs for TLS: the CA to verify the server with and, for mutual TLS, its own
    certificate and key. `server_name` overrides the name checked against the server's
    certificate (for addresses that are pod IPs rather than the names in the certificate)."""

    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate needs both its certificate and its key")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "CA"),
                                            private_key=_read(self.key, "client key"),
                                            certificate_chain=_read(self.cert, "client certificate"))

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def server_tls(cert: str | None, key: str | None, ca: str | None, require_client_cert: bool) -> ServerTLS | None:
    """The server's TLS settings from config values; None for plaintext. Raises ValueError for a
    half-given pair or mTLS without TLS."""
    if bool(cert) != bool(key):
        raise ValueError("tls_cert and tls_key: give both to serve TLS, or neither for plaintext")
    if not cert:
        if require_client_cert:
            raise ValueError("require_client_cert: needs tls_cert, tls_key and tls_ca (mutual TLS is TLS)")
        return None
    return ServerTLS(cert, key, ca, require_client_cert)  # type: ignore[arg-type]


def client_tls(ca: str | None, cert: str | None = None, key: str | None = None,
               server_name: str | None = None) -> ClientTLS | None:
    """A channel's TLS settings; None (plaintext) without a CA."""
    if not ca:
        if cert or key:
            raise ValueError("a client certificate is only sent over TLS: give the CA too")
        return None
    return ClientTLS(ca, cert or None, key or None, server_name or None)
