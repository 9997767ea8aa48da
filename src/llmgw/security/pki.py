"""llmgw's private certificate authority and the certificates of the node API's mutual TLS.

A node's identity is what it proves, not what it says: the node API requires a client certificate from
this CA and compares its common name with the node id the request claims (seeds 001, "Add a private CA
and mutual TLS"). A public CA cannot issue these: public authorities stopped issuing the clientAuth usage.

The server certificate lists every host agents dial as a subject alternative name (IP addresses as IP
SANs): hostname verification reads SANs and ignores the common name, so a certificate without the
address agents use is refused whatever its subject says.

Files (PEM): `ca.crt`/`ca.key` (the key stays on the control-plane machine), `server.crt`/`server.key`,
`node-<id>.crt`/`node-<id>.key`, and beside the CA the key that signs node activities,
`activity-signing.key` (control plane only) and `activity-signing.pub` (to every node with `ca.crt`;
security/activity_origin.py). Keys are written mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass
class Issued:
    cert: Path
    key: Path


def _write_key(path: Path, key) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def create_ca(directory: Path, name: str = "llmgw CA", days: int = 3650) -> Issued:
    """Create `ca.crt` and `ca.key` in `directory`. Refuses to overwrite an existing CA."""
    cert_path, key_path = directory / "ca.crt", directory / "ca.key"
    if cert_path.exists() or key_path.exists():
        raise FileExistsError(f"{directory} already holds a CA; remove it first to make a new one")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(_now() - dt.timedelta(minutes=5))
        .not_valid_after(_now() + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    from llmgw.security.activity_origin import create_signing_key

    create_signing_key(directory)  # node activities' proof of origin: its .pub travels with ca.crt
    return Issued(cert_path, key_path)


def _load_ca(directory: Path):
    cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    return cert, key


def _issue(directory: Path, stem: str, common_name: str, usage, sans: list[x509.GeneralName], days: int,
           replace: bool = False) -> Issued:
    out = Issued(directory / f"{stem}.crt", directory / f"{stem}.key")
    if not replace and (out.cert.exists() or out.key.exists()):
        # A running node API or node worker may be using it: replaced under it, the next restart fails its
        # TLS handshakes (a server certificate without the address agents dial, a node's key it no longer has).
        raise FileExistsError(f"{out.cert} already exists and may be in use; pass --force to replace it, then "
                              "restart what uses it")
    ca_cert, ca_key = _load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(_now() - dt.timedelta(minutes=5)).not_valid_after(_now() + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_key(out.key, key)
    _write_cert(out.cert, cert)
    return out


def issue_server(directory: Path, hosts: list[str], days: int = 825, replace: bool = False) -> Issued:
    """The node API's certificate, valid for every name and address in `hosts` (IPs become IP SANs)."""
    if not hosts:
        raise ValueError("give at least one host the agents dial (a DNS name or an IP address)")
    return _issue(directory, "server", hosts[0], ExtendedKeyUsageOID.SERVER_AUTH, _sans(hosts), days, replace)


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _sans(hosts: list[str]) -> list[x509.GeneralName]:
    """Each host as an IP address or a DNS name; anything else (`a b`, `10.0.0.0/8`) is a `ValueError`."""
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            continue
        except ValueError:
            pass
        name = h[:-1] if h.endswith(".") else h
        if not (0 < len(name) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in name.split("."))):
            raise ValueError(f"{h!r} is neither an IP address nor a DNS name: write one such as 10.0.0.5 or "
                             "gpu-07.example.internal (one per --host/--address)")
        sans.append(x509.DNSName(name))
    return sans


def issue_node(directory: Path, node_id: str, days: int = 825, addresses: list[str] | None = None,
               replace: bool = False) -> Issued:
    """A node's client certificate: common name = node id, usage clientAuth. `addresses` (IPs or DNS names)
    are where its engines listen when that is not the address its node-API connection comes from; the node
    API accepts engine endpoints at the connection's address and at these (security/node_address.py)."""
    if not NODE_ID_RE.match(node_id):
        raise ValueError(f"node id {node_id!r}: use letters, digits, '.', '_' and '-' (up to 63)")
    return _issue(directory, f"node-{node_id}", node_id, ExtendedKeyUsageOID.CLIENT_AUTH, _sans(addresses or []), days,
                  replace)


def cert_addresses(peercert: dict | None) -> tuple[list[str], list[str]]:
    """(IP addresses, DNS names) in the subject alternative names of `ssl.SSLSocket.getpeercert()`'s dict."""
    ips, names = [], []
    for kind, value in (peercert or {}).get("subjectAltName", ()):
        if kind == "IP Address":
            ips.append(value)
        elif kind == "DNS":
            names.append(value)
    return ips, names


def common_name(peercert: dict | None) -> str | None:
    """The subject CN from `ssl.SSLSocket.getpeercert()`'s dict, or None."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None
