"""The controller's TLS certificate: made at first start (or given), pinned by agents.

The certificate and key live in the store's settings, so `muster token` (which reads the
same database) can print the certificate's sha256 fingerprint inside the join string, as
kubeadm's discovery-token CA hash does.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import socket
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from muster.errors import UserError
from muster.store import Store


def make_self_signed(hosts: list[str]) -> tuple[str, str]:
    """A new key and a 10-year self-signed certificate for ``hosts`` (PEM cert, PEM key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "muster controller")])
    alt: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return cert_pem, key_pem


def fingerprint(cert_pem: str) -> str:
    der = x509.load_pem_x509_certificate(cert_pem.encode()).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def controller_certificate(
    store: Store, cert_file: Path | None = None, key_file: Path | None = None
) -> tuple[str, str]:
    """The certificate in force: the user's (recorded), else the one made at first start."""
    if cert_file is not None or key_file is not None:
        if cert_file is None or key_file is None:
            raise UserError("--tls-cert and --tls-key go together; give both or neither")
        try:
            cert_pem, key_pem = cert_file.read_text(), key_file.read_text()
            fingerprint(cert_pem)
        except (OSError, ValueError) as exc:
            raise UserError(f"--tls-cert {cert_file}: not a readable PEM certificate") from exc
        store.put_settings({"tls_cert": cert_pem, "tls_key": key_pem})
        return cert_pem, key_pem
    hosts = ["localhost", "127.0.0.1", socket.gethostname()]
    if (cert := store.get_setting("tls_cert")) and (key := store.get_setting("tls_key")):
        return cert, key

    def make() -> dict[str, str]:
        cert_pem, key_pem = make_self_signed(hosts)
        return {"tls_cert": cert_pem, "tls_key": key_pem}

    # The certificate and its key are written in one transaction: never one without the other.
    pair = store.setting_group(make)
    return pair["tls_cert"], pair["tls_key"]


def write_pem_files(directory: Path, cert_pem: str, key_pem: str) -> tuple[Path, Path]:
    """uvicorn reads files: write both, the key readable by the owner only."""
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "controller.crt", directory / "controller.key"
    cert_path.write_text(cert_pem)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key_pem)
    return cert_path, key_path


def join_string(token: str, cert_pem: str | None) -> str:
    """What `muster token` prints: the secret, then the certificate's sha256 fingerprint."""
    return f"{token}.sha256:{fingerprint(cert_pem)}" if cert_pem else token
