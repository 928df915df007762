"""`specd certs`: a development CA and the certificates for TLS and mutual TLS between services.

Writes, into one folder (PEM files; keys readable by the owner only):

    ca.crt, ca.key          the development CA (keep ca.key away from the services)
    server.crt, server.key  for every service: serverAuth and clientAuth, so the coordinator
                            presents it to the target and draft replicas as its client certificate
    client.crt, client.key  for clients of the coordinator when it requires client certificates

The server certificate names localhost, 127.0.0.1, ::1, `specd` (for `--upstream-server-name`
when replicas are dialled by pod IP) and the Kubernetes service names (`specd-target`,
`specd-draft`, `specd-coordinator` and the `-headless` pools, with `.NAMESPACE`, `.NAMESPACE.svc`
and `.NAMESPACE.svc.cluster.local`, and wildcards under each for the pods of headless services),
plus any `extra_names`. For development and tests only: production
certificates come from the cluster's issuer (e.g. cert-manager) in the same file layout.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVICE_NAMES = ("specd-target", "specd-draft", "specd-coordinator", "specd-target-headless", "specd-draft-headless")
# "specd": one name every service's certificate has, for --upstream-server-name when the
# coordinator dials replicas by pod IP (dns:/// discovery), which no certificate names.
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1", "specd")


@dataclass(frozen=True)
class CertFiles:
    """The paths `make_dev_certs` wrote."""

    folder: Path

    @property
    def ca(self) -> str:
        return str(self.folder / "ca.crt")

    @property
    def server_cert(self) -> str:
        return str(self.folder / "server.crt")

    @property
    def server_key(self) -> str:
        return str(self.folder / "server.key")

    @property
    def client_cert(self) -> str:
        return str(self.folder / "client.crt")

    @property
    def client_key(self) -> str:
        return str(self.folder / "client.key")


def service_dns_names(namespace: str = "default", services: Sequence[str] = SERVICE_NAMES) -> list[str]:
    """The names a pod reaches a Kubernetes service by, with wildcards for headless-service pods."""
    names: list[str] = []
    for svc in services:
        for name in (svc, f"{svc}.{namespace}", f"{svc}.{namespace}.svc", f"{svc}.{namespace}.svc.cluster.local"):
            names += [name, f"*.{name}"]
    return names


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specd development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days)))


def make_ca(common_name: str = "specd development CA", days: int = 365) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    cert = (_builder(common_name, _name(common_name), key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def issue(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str, names: Iterable[str],
          server: bool, client: bool, days: int = 365) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate signed by the CA, for TLS servers and/or clients, naming `names` (DNS or IP)."""
    key = _key()
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    builder = (_builder(common_name, ca_cert.subject, key.public_key(), days)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    sans = [_general_name(n) for n in dict.fromkeys(names)]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _write(path: Path, data: bytes, private: bool) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def make_dev_certs(out: str | os.PathLike[str], extra_names: Sequence[str] = (), namespace: str = "default",
                   days: int = 365, ca_name: str = "specd development CA") -> CertFiles:
    """Writes a fresh CA, a server certificate and a client certificate into `out` (created if
    missing; existing files are replaced). Returns their paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = make_ca(ca_name, days)
    names = [*LOCAL_NAMES, *service_dns_names(namespace), *extra_names]
    server_cert, server_key = issue(ca_cert, ca_key, "specd", names, server=True, client=True, days=days)
    client_cert, client_key = issue(ca_cert, ca_key, "specd-client", [], server=False, client=True, days=days)
    for stem, cert, key in (("ca", ca_cert, ca_key), ("server", server_cert, server_key), ("client", client_cert, client_key)):
        _write(folder / f"{stem}.crt", _pem_cert(cert), private=False)
        _write(folder / f"{stem}.key", _pem_key(key), private=True)
    return CertFiles(folder)
