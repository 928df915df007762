"""TLS, mutual TLS and bearer tokens on in-process servers (the tiny servicers; no models).

Two development CAs from `specd certs`: "ours" signs every service and client; "theirs" stands
for a stranger's certificates, which must be refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specd.auth import BearerTokenInterceptor, auth_metadata
from specd.certs import CertFiles, make_dev_certs
from specd.cli import main as cli_main
from specd.grpc_server import PLAINTEXT, ServerHandle, build_server, make_channel, set_default_client_tls
from specd.security import coordinator_security
from specd.tls import ClientTLS
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, target_pb2_grpc
from tests.integration.grpc_servicers import COORDINATOR_SERVICE, MODEL_INFO, TARGET_SERVICE, EchoTarget, ProxyCoordinator

TOKEN = "s3cret-token"
HANDSHAKE_REFUSED = (grpc.StatusCode.UNAVAILABLE,)  # how a failed TLS handshake reaches a gRPC client


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> CertFiles:
    return make_dev_certs(tmp_path_factory.mktemp("ours"))


@pytest.fixture(scope="module")
def theirs(tmp_path_factory) -> CertFiles:
    return make_dev_certs(tmp_path_factory.mktemp("theirs"), ca_name="someone else's CA")


def config(**tls) -> SimpleNamespace:
    return SimpleNamespace(host="127.0.0.1", port=0, max_workers=8, grace_seconds=1.0, **tls)


def serve_target(certs: CertFiles, mtls: bool) -> ServerHandle:
    servicer = EchoTarget()
    cfg = config(tls_cert=certs.server_cert, tls_key=certs.server_key, tls_ca=certs.ca, require_client_cert=mtls)
    return build_server(cfg, lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s), [TARGET_SERVICE])


def model_info(address: str, tls, timeout: float = 5) -> common_pb2.ModelInfo:
    with make_channel(address, tls=tls) as ch:
        return target_pb2_grpc.TargetServiceStub(ch).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout)


def refused(address: str, tls) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        model_info(address, tls)
    return err.value.code()


@pytest.fixture(scope="module")
def mtls_target(ours) -> Iterator[ServerHandle]:
    handle = serve_target(ours, mtls=True)
    yield handle
    handle.drain(0)


def test_mutual_tls_accepts_only_certificates_of_its_ca(mtls_target, ours, theirs):
    address = f"127.0.0.1:{mtls_target.port}"
    assert model_info(address, ClientTLS(ours.ca, ours.client_cert, ours.client_key)) == MODEL_INFO
    assert model_info(address, ClientTLS(ours.ca, ours.server_cert, ours.server_key)) == MODEL_INFO  # the coordinator's
    assert refused(address, ClientTLS(ours.ca)) in HANDSHAKE_REFUSED  # no client certificate
    assert refused(address, ClientTLS(ours.ca, theirs.client_cert, theirs.client_key)) in HANDSHAKE_REFUSED
    assert refused(address, PLAINTEXT) in HANDSHAKE_REFUSED
    assert model_info(address, ClientTLS(ours.ca, ours.client_cert, ours.client_key)) == MODEL_INFO  # still serving


def test_tls_client_refuses_a_server_of_another_ca(mtls_target, ours, theirs):
    address = f"127.0.0.1:{mtls_target.port}"
    assert refused(address, ClientTLS(theirs.ca, theirs.client_cert, theirs.client_key)) in HANDSHAKE_REFUSED


def test_server_certificate_names_hold_for_kubernetes_service_names(mtls_target, ours):
    address = f"127.0.0.1:{mtls_target.port}"
    for name in ("localhost", "specd", "specd-target", "specd-target-0.specd-target.default.svc.cluster.local"):
        assert model_info(address, ClientTLS(ours.ca, ours.client_cert, ours.client_key, server_name=name)) == MODEL_INFO
    assert refused(address, ClientTLS(ours.ca, ours.client_cert, ours.client_key, server_name="evil.example")) \
        in HANDSHAKE_REFUSED


def test_tls_without_client_certificates(ours):
    handle = serve_target(ours, mtls=False)
    try:
        address = f"127.0.0.1:{handle.port}"
        assert model_info(address, ClientTLS(ours.ca)) == MODEL_INFO
        assert refused(address, PLAINTEXT) in HANDSHAKE_REFUSED
    finally:
        handle.drain(0)


def test_half_given_tls_settings_fail_the_start(ours):
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        build_server(config(tls_cert=ours.server_cert), lambda s: None, [])
    with pytest.raises(ValueError, match="require_client_cert"):
        build_server(config(require_client_cert=True), lambda s: None, [])


# --- bearer token, and the coordinator's mutual TLS to its replicas ------------------------------


@pytest.fixture(scope="module")
def secured_coordinator(ours, mtls_target, tmp_path_factory) -> Iterator[tuple[str, ClientTLS]]:
    """ProxyCoordinator over mutual TLS and a token file; its GenerateUnary calls the mTLS target
    through the process's upstream TLS, as the real coordinator's replica channels do."""
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    cfg = config(tls_cert=ours.server_cert, tls_key=ours.server_key, tls_ca=ours.ca, require_client_cert=True,
                 api_token=None, api_token_file=str(token_file), upstream_ca=ours.ca)
    security = coordinator_security(cfg)
    assert security.token == TOKEN and security.upstream is not None and security.upstream.cert == ours.server_cert
    proxy = ProxyCoordinator()
    proxy.target_address = f"127.0.0.1:{mtls_target.port}"
    handle = build_server(cfg, lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(proxy, s),
                          [COORDINATOR_SERVICE], interceptors=[BearerTokenInterceptor(security.token)])
    try:
        yield f"127.0.0.1:{handle.port}", ClientTLS(ours.ca, ours.client_cert, ours.client_key)
    finally:
        handle.drain(0)
        set_default_client_tls(None)


def generate(address: str, tls, metadata=()) -> coordinator_pb2.GenerateResult:
    with make_channel(address, tls=tls) as ch:
        return coordinator_pb2_grpc.CoordinatorStub(ch).GenerateUnary(
            coordinator_pb2.GenerateRequest(prompt="ok"), metadata=metadata, timeout=5)


def test_token_is_required_and_checked(secured_coordinator):
    address, tls = secured_coordinator
    for metadata in ((), auth_metadata("wrong"), (("authorization", f"Basic {TOKEN}"),)):
        with pytest.raises(grpc.RpcError) as err:
            generate(address, tls, metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in err.value.details()
    with make_channel(address, tls=tls) as ch:  # streaming methods too
        with pytest.raises(grpc.RpcError) as err:
            list(coordinator_pb2_grpc.CoordinatorStub(ch).Generate(coordinator_pb2.GenerateRequest(prompt="x"), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # With the token the call goes through, and on to the target over mutual TLS.
    assert generate(address, tls, auth_metadata(TOKEN)).text == MODEL_INFO.name


def test_health_and_reflection_stay_open_without_a_token(secured_coordinator):
    address, tls = secured_coordinator
    with make_channel(address, tls=tls) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        assert COORDINATOR_SERVICE in ProtoReflectionDescriptorDatabase(ch).get_services()


def test_the_token_does_not_replace_the_client_certificate(secured_coordinator, ours, theirs):
    address, _ = secured_coordinator
    for tls in (ClientTLS(ours.ca), ClientTLS(ours.ca, theirs.client_cert, theirs.client_key)):
        with pytest.raises(grpc.RpcError) as err:
            generate(address, tls, auth_metadata(TOKEN))
        assert err.value.code() in HANDSHAKE_REFUSED


# --- specd certs --------------------------------------------------------------------------------


def test_specd_certs_writes_a_ca_and_certificates(tmp_path: Path, capsys):
    assert cli_main(["certs", "--out", str(tmp_path), "--name", "specd.example.com", "--namespace", "llm"]) == 0
    assert "--tls-cert" in capsys.readouterr().out
    assert {p.name for p in tmp_path.iterdir()} == {f"{s}.{e}" for s in ("ca", "server", "client") for e in ("crt", "key")}
    assert oct((tmp_path / "server.key").stat().st_mode & 0o777) == "0o600"
    cert = x509.load_pem_x509_certificate((tmp_path / "server.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = set(names.get_values_for_type(x509.DNSName))
    assert {"localhost", "specd", "specd.example.com", "specd-target", "specd-coordinator.llm.svc.cluster.local",
            "*.specd-draft.llm.svc", "specd-target-headless.llm.svc.cluster.local"} <= dns
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)


def test_container_health_check_uses_the_services_tls_settings(mtls_target, ours):
    from specd.healthcheck import check, tls_from_env

    address = f"127.0.0.1:{mtls_target.port}"
    env = {"SPECD_TLS_CERT": ours.server_cert, "SPECD_TLS_KEY": ours.server_key, "SPECD_TLS_CA": ours.ca}
    assert tls_from_env({}) is None
    assert check(address, TARGET_SERVICE, tls=tls_from_env(env)) == "SERVING"
    assert check(address, TARGET_SERVICE, timeout=2) != "SERVING"  # plaintext against mutual TLS
