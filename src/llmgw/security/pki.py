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

Node certificates are short-lived (`node_cert_days`, 7 by default) and renewed by their node before they run
out (issue 36): at two thirds of its life the agent makes a new key, sends a certificate signing request to
the node API over its current certificate (`POST /node/v1/renew`), and installs what comes back; the key
never leaves the node. Every certificate is backdated by `BACKDATE` (clock skew), so the moment it was
issued is `not_valid_before + BACKDATE` (`issued_at`): the deny-list's "every certificate of NODE issued
before" compares with that (control/revocations.py).
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
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

BACKDATE = dt.timedelta(minutes=5)  # not_valid_before is this much before issuance (clock skew)
RENEW_AT = 2 / 3  # of a node certificate's life (from issuance), when its agent renews it
NODE_CERT_DAYS = 7.0  # config.Settings.node_cert_days
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
        .serial_number(x509.random_serial_number()).not_valid_before(_now() - BACKDATE)
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


def _issue(directory: Path, stem: str, common_name: str, usage, sans: list[x509.GeneralName], days: float,
           replace: bool = False) -> Issued:
    out = Issued(directory / f"{stem}.crt", directory / f"{stem}.key")
    if not replace and (out.cert.exists() or out.key.exists()):
        # A running node API or node worker may be using it: replaced under it, the next restart fails its
        # TLS handshakes (a server certificate without the address agents dial, a node's key it no longer has).
        raise FileExistsError(f"{out.cert} already exists and may be in use; pass --force to replace it, then "
                              "restart what uses it")
    ca_cert, ca_key = _load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _sign(ca_cert, ca_key, key.public_key(), common_name, usage, sans, days)
    _write_key(out.key, key)
    _write_cert(out.cert, cert)
    return out


def _sign(ca_cert, ca_key, public_key, common_name: str, usage, sans: list[x509.GeneralName],
          days: float) -> x509.Certificate:
    now = _now()
    builder = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject).public_key(public_key).serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage if isinstance(usage, list) else [usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def issue_server(directory: Path, hosts: list[str], days: float = 825, replace: bool = False) -> Issued:
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


# A node certificate's uses: clientAuth for the node API, serverAuth for its peer listener.
NODE_USAGE = [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]


def issue_node(directory: Path, node_id: str, days: float = NODE_CERT_DAYS, addresses: list[str] | None = None,
               replace: bool = False) -> Issued:
    """A node's certificate: common name = node id, usage clientAuth (the node API) and serverAuth (its peer
    listener, which serves its weight cache to other nodes: node/peer_server.py). `addresses` (IPs or DNS
    names) are where its engines listen when that is not the address its node-API connection comes from; the
    node API accepts engine endpoints at the connection's address and at these (security/node_address.py)."""
    if not NODE_ID_RE.match(node_id):
        raise ValueError(f"node id {node_id!r}: use letters, digits, '.', '_' and '-' (up to 63)")
    return _issue(directory, f"node-{node_id}", node_id, NODE_USAGE, _sans(addresses or []), days, replace)


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


# ---- node certificates: lifetime, renewal -----------------------------------------------------------

class CSRRefused(ValueError):
    """A certificate signing request the node API will not sign; `str()` says why and what to send."""


def serial_text(serial: int | str) -> str:
    """A certificate serial as the deny-list keeps it: lower-case hex, no leading zeros (`getpeercert()`'s
    `serialNumber` is upper-case hex, maybe zero-padded; x509 gives an int)."""
    n = serial if isinstance(serial, int) else int(serial.replace(":", ""), 16)
    return format(n, "x")


def issued_at(not_valid_before: dt.datetime) -> dt.datetime:
    """When a certificate of this CA was issued, from its `not_valid_before` (aware, UTC)."""
    return not_valid_before + BACKDATE


def renew_after(cert: x509.Certificate) -> dt.datetime:
    """When its agent renews `cert`: `RENEW_AT` of the way from issuance to `not_valid_after`."""
    issued = issued_at(cert.not_valid_before_utc)
    return issued + (cert.not_valid_after_utc - issued) * RENEW_AT


def cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


def make_csr(node_id: str) -> tuple[ec.EllipticCurvePrivateKey, str]:
    """A new key (made here, on the node: it never leaves it) and a PEM CSR for it naming `node_id`."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)])).sign(key, hashes.SHA256()))
    return key, csr.public_bytes(serialization.Encoding.PEM).decode()


def sign_node_csr(ca_cert_path: Path, ca_key_path: Path, csr_pem: str, node_id: str, ips: list[str],
                  names: list[str], days: float) -> x509.Certificate:
    """A renewed certificate for `node_id` over the CSR's public key, naming the addresses (`ips`, `names`)
    of the certificate it replaces: the node chooses its key, never its name or addresses. Raises
    `CSRRefused` for a CSR that does not parse, is not signed by its key, or has a weak key."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode())
    except ValueError:
        raise CSRRefused("csr is not a PEM certificate signing request (-----BEGIN CERTIFICATE REQUEST-----)") from None
    if not csr.is_signature_valid:
        raise CSRRefused("the csr is not signed by its own key")
    key = csr.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey):
        if key.curve.key_size < 256:
            raise CSRRefused(f"an EC key of {key.curve.key_size} bits is too weak; use P-256 or larger")
    elif isinstance(key, rsa.RSAPublicKey):
        if key.key_size < 2048:
            raise CSRRefused(f"an RSA key of {key.key_size} bits is too weak; use 2048 or more")
    else:
        raise CSRRefused("the csr's key must be EC (P-256 or larger) or RSA (2048 bits or more)")
    ca_cert = x509.load_pem_x509_certificate(Path(ca_cert_path).read_bytes())
    ca_key = serialization.load_pem_private_key(Path(ca_key_path).read_bytes(), password=None)
    return _sign(ca_cert, ca_key, key, node_id, NODE_USAGE, _sans([*ips, *names]), days)


def serves_peers(cert: x509.Certificate) -> bool:
    """Whether a node certificate may serve TLS (serverAuth): those issued before peer fetch (issue 39) were
    clientAuth alone, and a peer's TLS client refuses them; such a node serves no peers until it renews."""
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True  # no EKU: any purpose
    return ExtendedKeyUsageOID.SERVER_AUTH in usage


def _replace_file(path: Path, data: bytes, mode: int) -> None:
    """Write `data` to `path` so that a reader sees the old file or the new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def install_renewed(cert_path: Path, key_path: Path, cert_pem: str, key) -> None:
    """Install a renewed certificate and its key over the current ones. Both are written beside them first
    (`.new`), then the key and the certificate are each replaced atomically: a crash between the two
    leaves the pair `finish_renewal` completes at the next start."""
    cert_path, key_path = Path(cert_path), Path(key_path)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    _replace_file(cert_path.with_name(cert_path.name + ".new"), cert_pem.encode(), 0o644)
    _replace_file(key_path.with_name(key_path.name + ".new"), key_pem, 0o600)
    finish_renewal(cert_path, key_path)


def finish_renewal(cert_path: Path, key_path: Path) -> bool:
    """Complete a renewal a crash interrupted: when `<cert>.new` pairs with `<key>.new` (or with the key,
    already replaced), put it in place; a `.new` that pairs with nothing is removed. True when it did."""
    cert_path, key_path = Path(cert_path), Path(key_path)
    new_cert, new_key = cert_path.with_name(cert_path.name + ".new"), key_path.with_name(key_path.name + ".new")
    if not new_cert.exists():
        new_key.unlink(missing_ok=True)
        return False
    candidate = new_key if new_key.exists() else key_path
    try:
        cert = x509.load_pem_x509_certificate(new_cert.read_bytes())
        key = serialization.load_pem_private_key(candidate.read_bytes(), password=None)
        pairs = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) \
            == key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    except (ValueError, OSError):
        pairs = False
    if not pairs:
        new_cert.unlink(missing_ok=True)
        new_key.unlink(missing_ok=True)
        return False
    if candidate == new_key:
        os.replace(new_key, key_path)
    os.replace(new_cert, cert_path)
    return True
