"""`python -m specd.healthcheck [HOST:PORT] [--service NAME] [--timeout S]`: one grpc.health.v1 Check.

Exits 0 when the service reports SERVING and 1 otherwise (NOT_SERVING while draining, unknown
service, unreachable, timed out), printing the status. It is the container health check of the
Docker image and docker compose; Kubernetes uses its native gRPC probes on the same health
service instead. The address defaults to 127.0.0.1 and the service's own port ($SPECD_PORT), so
one command fits all three services. Imports only grpc: a check costs well under a second.

With TLS on, it reads the service's own settings from the environment: SPECD_TLS_CA (or
SPECD_UPSTREAM_CA) verifies the server, and SPECD_TLS_CERT/SPECD_TLS_KEY (the service's
certificate, which is also a client certificate) satisfy --require-client-cert.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.tls import ClientTLS, client_tls


def tls_from_env(env: dict[str, str] | os._Environ = os.environ) -> ClientTLS | None:
    """The TLS a check of this container's service needs, from its SPECD_* settings (None: plaintext)."""
    if not env.get("SPECD_TLS_CERT"):
        return None
    ca = env.get("SPECD_TLS_CA") or env.get("SPECD_UPSTREAM_CA")
    return client_tls(ca, env.get("SPECD_TLS_CERT"), env.get("SPECD_TLS_KEY"))


def check(address: str, service: str = "", timeout: float = 3.0, tls: ClientTLS | None = None) -> str:
    """The status name the health service at `address` reports for `service` ("" = the server),
    or a short reason when there is no answer (e.g. "UNAVAILABLE")."""
    channel = grpc.secure_channel(address, tls.credentials()) if tls is not None else grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specd.healthcheck", description=__doc__.split("\n\n")[0])
    default = f"127.0.0.1:{os.environ.get('SPECD_PORT') or 50050}"
    parser.add_argument("address", nargs="?", default=default, help=f"HOST:PORT (default: {default}, from SPECD_PORT)")
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default: 3)")
    args = parser.parse_args(argv)
    status = check(args.address, args.service, args.timeout, tls_from_env())
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
