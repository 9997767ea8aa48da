"""The node API's mutual TLS through a real `llmgw server`: a node proves its id with a certificate from
llmgw's CA, and a request claiming another node's id is refused (seeds 001)."""

from __future__ import annotations

import ssl

import httpx
import pytest

from llmgw.dev.procs import wait_port
from llmgw.schemas.api import HeartbeatRequest, RegisterRequest
from llmgw.schemas.inventory import Inventory
from llmgw.security.pki import create_ca, issue_node

pytestmark = pytest.mark.integration


def client(cp, cert_dir, node_id: str | None) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(cp.pki / "ca.crt"))
    if node_id:
        ctx.load_cert_chain(str(cert_dir / f"node-{node_id}.crt"), str(cert_dir / f"node-{node_id}.key"))
    return httpx.Client(base_url=f"https://127.0.0.1:{cp.ports['node_api']}", verify=ctx, timeout=10)


def register(node_id: str) -> dict:
    return RegisterRequest(node_id=node_id, boot_id="b1", inventory=Inventory(cpus=1)).model_dump(mode="json")


def test_node_must_prove_the_id_it_claims(control_plane, tmp_path):
    cp = control_plane
    server = cp.spawn("server", "server")
    wait_port(cp.ports["node_api"], 60, server.proc, "node API")
    cp.node_env("node-a")

    with client(cp, cp.pki, "node-a") as c:
        assert c.post("/node/v1/register", json=register("node-a")).status_code == 200
        r = c.post("/node/v1/register", json=register("node-b"))
        assert r.status_code == 403
        assert "for node 'node-a'" in r.json()["error"]["message"]
        hb = HeartbeatRequest(node_id="node-b", boot_id="b1").model_dump(mode="json")
        assert c.post("/node/v1/heartbeat", json=hb).status_code == 403

    # No client certificate: the handshake itself fails.
    with client(cp, cp.pki, None) as c, pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        c.post("/node/v1/register", json=register("node-a"))

    # A certificate from another CA, even with the right common name, is not accepted.
    other = tmp_path / "other-ca"
    create_ca(other)
    issue_node(other, "node-a")
    with client(cp, other, "node-a") as c, pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        c.post("/node/v1/register", json=register("node-a"))
