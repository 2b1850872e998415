"""Test certificates, made at test time with ``cryptography`` (no hand-written crypto).

``make_pki(directory)`` writes PEM files for: a CA; a server and a client certificate it
signed (SANs 127.0.0.1, ::1 and localhost, usable for both ends, as workers are both); an
expired one it signed; and a certificate signed by another CA. Paths come back in a dict.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_ALT_NAMES = x509.SubjectAlternativeName(
    [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    common_name: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, expired: bool = False
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = (
        (now - datetime.timedelta(days=10), now - datetime.timedelta(days=1))
        if expired
        else (
            now - datetime.timedelta(days=1),
            now + datetime.timedelta(days=30),
        )
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(_ALT_NAMES, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def make_pki(directory: Path) -> dict[str, str]:
    """Write the test PKI into ``directory``; returns ``{name: path}`` for ``ca``, ``other_ca``
    and ``<who>_cert``/``<who>_key`` with who in server, client, expired, foreign."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _ca("rpcdist test CA")
    other_ca, other_key = _ca("another CA")
    paths: dict[str, str] = {}
    for name, cert in (("ca", ca), ("other_ca", other_ca)):
        path = directory / f"{name}.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[name] = str(path)
    leaves = {
        "server": _leaf("server", ca, ca_key),
        "client": _leaf("client", ca, ca_key),
        "expired": _leaf("expired", ca, ca_key, expired=True),
        "foreign": _leaf("foreign", other_ca, other_key),
    }
    for who, (cert, key) in leaves.items():
        cert_path, key_path = directory / f"{who}.pem", directory / f"{who}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        paths[f"{who}_cert"], paths[f"{who}_key"] = str(cert_path), str(key_path)
    return paths
