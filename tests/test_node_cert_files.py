"""Node certificate files on the node (security/pki.py): a renewal is installed so that a crash at any point
leaves a pair that works at the next start, and `llmgw dev` issues its node a new certificate when the one
it kept has run out (or is due for renewal) while it was stopped. The lifetime, renewal and revocation
themselves go through real processes in tests/test_node_trust.py."""

from __future__ import annotations

import datetime as dt
import os
import ssl
import time

import pytest

from llmgw.config import Settings
from llmgw.dev.stack import DevStack
from llmgw.security.pki import (
    BACKDATE, CSRRefused, cert_pem, create_ca, finish_renewal, install_renewed, issue_node, load_cert, make_csr,
    renew_after, sign_node_csr,
)


def _pairs(crt, key) -> bool:
    ctx = ssl.create_default_context()
    try:
        ctx.load_cert_chain(str(crt), str(key))
        return True
    except ssl.SSLError:
        return False


@pytest.fixture
def node(tmp_path):
    create_ca(tmp_path)
    out = issue_node(tmp_path, "n1", addresses=["10.0.0.5"])
    key, csr = make_csr("n1")
    new = sign_node_csr(tmp_path / "ca.crt", tmp_path / "ca.key", csr, "n1", ["10.0.0.5"], [], 7)
    return out, key, new


def test_a_renewal_is_installed_whole_and_its_key_kept_private(node):
    out, key, new = node
    install_renewed(out.cert, out.key, cert_pem(new), key)
    assert load_cert(out.cert).serial_number == new.serial_number and _pairs(out.cert, out.key)
    assert (os.stat(out.key).st_mode & 0o777) == 0o600
    assert not list(out.cert.parent.glob("*.new")) and not list(out.cert.parent.glob("*.tmp"))


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def test_a_renewal_cut_short_is_completed_or_discarded_at_the_next_start(node, tmp_path):
    out, key, new = node
    new_cert, new_key = out.cert.with_name(out.cert.name + ".new"), out.key.with_name(out.key.name + ".new")
    # Died after writing both `.new` files: both are put in place.
    new_cert.write_text(cert_pem(new))
    new_key.write_bytes(_pem_key(key))
    assert finish_renewal(out.cert, out.key) is True
    assert load_cert(out.cert).serial_number == new.serial_number and _pairs(out.cert, out.key)

    # Died between replacing the key and the certificate: the certificate follows the key already there.
    old = issue_node(tmp_path, "n1", replace=True)
    newer_key, csr = make_csr("n1")
    newer = sign_node_csr(tmp_path / "ca.crt", tmp_path / "ca.key", csr, "n1", [], [], 7)
    new_cert.write_text(cert_pem(newer))
    out.key.write_bytes(_pem_key(newer_key))
    assert not _pairs(old.cert, out.key)
    assert finish_renewal(out.cert, out.key) is True and _pairs(out.cert, out.key)

    # A `.new` certificate that pairs with no key there (written half, or foreign) is dropped, nothing replaced.
    before = out.cert.read_bytes()
    new_cert.write_text(cert_pem(new))
    assert finish_renewal(out.cert, out.key) is False
    assert not new_cert.exists() and out.cert.read_bytes() == before and _pairs(out.cert, out.key)


def test_the_node_api_signs_only_a_csr_signed_by_its_key(tmp_path):
    create_ca(tmp_path)
    with pytest.raises(CSRRefused, match="not a PEM certificate signing request"):
        sign_node_csr(tmp_path / "ca.crt", tmp_path / "ca.key", "hello", "n1", [], [], 7)
    _, csr = make_csr("n1")
    tampered = csr.replace(csr.splitlines()[3], csr.splitlines()[3][:-4] + "AAAA")
    with pytest.raises(CSRRefused):
        sign_node_csr(tmp_path / "ca.crt", tmp_path / "ca.key", tampered, "n1", [], [], 7)


def test_renewal_is_due_at_two_thirds_of_a_certificates_life_from_issuance(tmp_path):
    create_ca(tmp_path)
    cert = load_cert(issue_node(tmp_path, "n1", days=3).cert)
    issued = cert.not_valid_before_utc + BACKDATE
    assert abs((renew_after(cert) - issued).total_seconds() - 2 * 86400) < 2


def test_dev_issues_its_node_a_new_certificate_when_the_kept_one_ran_out(tmp_path):
    settings = Settings(state_dir=tmp_path / "state")
    stack = DevStack(settings)
    env = stack.ensure_pki()
    first = load_cert(env["LLMGW_NODE_CERT"])
    assert dt.timedelta(days=6.9) < first.not_valid_after_utc - first.not_valid_before_utc < dt.timedelta(days=7.1)
    assert load_cert(stack.ensure_pki()["LLMGW_NODE_CERT"]).serial_number == first.serial_number  # kept while good
    issue_node(tmp_path / "state" / "pki", "local", days=1e-5, replace=True)  # a second's life ...
    time.sleep(1.5)  # ... ran out while dev was stopped
    again = load_cert(stack.ensure_pki()["LLMGW_NODE_CERT"])
    assert again.not_valid_after_utc > dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=6)
    assert _pairs(env["LLMGW_NODE_CERT"], env["LLMGW_NODE_KEY"])


def test_ctl_cert_node_if_due_keeps_a_good_certificate_and_replaces_one_that_ran_out(tmp_path, monkeypatch):
    """What the compose stack's `pki` service runs at every start."""
    from typer.testing import CliRunner

    from llmgw.cli import app

    def cert(*args: str):
        return CliRunner().invoke(app, ["ctl", "cert", *args, "--dir", str(tmp_path)])

    assert cert("ca").exit_code == 0
    assert cert("node", "n1", "--if-due").exit_code == 0  # none there: issued
    first = load_cert(tmp_path / "node-n1.crt")
    out = cert("node", "n1", "--if-due")
    assert out.exit_code == 0 and "kept: valid until" in out.output
    assert load_cert(tmp_path / "node-n1.crt").serial_number == first.serial_number
    monkeypatch.setenv("LLMGW_NODE_CERT_DAYS", "0.00001")
    assert cert("node", "n1", "--force").exit_code == 0
    time.sleep(1.5)
    monkeypatch.delenv("LLMGW_NODE_CERT_DAYS")
    out = cert("node", "n1", "--if-due")
    assert out.exit_code == 0 and "valid until" in out.output and "kept" not in out.output
    assert load_cert(tmp_path / "node-n1.crt").not_valid_after_utc > dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=6)


async def test_renewal_without_a_ca_key_or_a_deny_list_is_a_503_that_says_why(tmp_path):
    """The node API's renewal route on its own (the real listener's scope filled in as TLSIdentityProtocol
    fills it): no CA key, an unreadable one, a deny-list that cannot be read. Each is a 503 in the envelope
    saying what is missing, never a 500 (the happy path and revocation: tests/test_node_trust.py)."""
    import httpx

    from llmgw.control.nodeapi import Renewer, create_node_api
    from llmgw.control.revocations import DenyList

    create_ca(tmp_path)
    cert = load_cert(issue_node(tmp_path, "n1").cert)
    tls = {"client_cert_name": "n1", "client_cert_ips": [], "client_cert_names": [], "peer_address": "127.0.0.1",
           "client_cert_serial": format(cert.serial_number, "X"),
           "client_cert_not_before": cert.not_valid_before_utc.strftime("%b %d %H:%M:%S %Y GMT")}

    def with_tls(app):
        async def asgi(scope, receive, send):
            scope = {**scope, "extensions": {**scope.get("extensions", {}), "tls": tls}}
            await app(scope, receive, send)
        return asgi

    class Unreadable(DenyList):
        async def load(self) -> None:
            raise OSError("connection refused")

    body = {"node_id": "n1", "csr": make_csr("n1")[1]}
    cases = [(None, None, "renewal_unavailable", "set LLMGW_CA_KEY"),
             (None, Renewer(tmp_path / "ca.crt", tmp_path / "missing.key", 7), "renewal_unavailable", "its log says why"),
             (Unreadable(None, 1.0), Renewer(tmp_path / "ca.crt", tmp_path / "ca.key", 7), "revocations_unknown",
              "cannot be read now")]
    for deny, renewer, code, words in cases:
        app = with_tls(create_node_api(None, require_identity=True, deny=deny, renewer=renewer))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node-api") as c:
            r = await c.post("/node/v1/renew", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == code and words in r.json()["error"]["message"]
    ok = with_tls(create_node_api(None, require_identity=True,  # type: ignore[arg-type]
                                  renewer=Renewer(tmp_path / "ca.crt", tmp_path / "ca.key", 7)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ok), base_url="http://node-api") as c:
        r = await c.post("/node/v1/renew", json=body)
    assert r.status_code == 200 and "BEGIN CERTIFICATE" in r.json()["certificate"]  # the control: all set, signed
