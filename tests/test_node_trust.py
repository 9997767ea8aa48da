"""The node API's trust boundary (issue 36, Build 2 and 7), through real processes:

- it refuses to listen beyond loopback without mutual TLS unless the risk is written out, and says what to
  set; on loopback it still runs without certificates (the dev stack, tests);
- `llmgw ctl cert revoke NODE` puts the node's certificates on a deny-list in Postgres, which every node API
  reads within `revocation_refresh_s`: the next request over a revoked certificate is refused (403
  `certificate_revoked`), on a connection already open too, renewal included; a certificate issued after
  lets the node back, and one serial can be revoked alone;
- a real agent renews its short-lived certificate before it runs out and keeps serving on the new one (its
  old one can then be revoked without effect); once its node is revoked it is refused and cannot renew;
- an engine endpoint reported with a host name is stored and routed at the address verified at report
  time: the gateway never resolves the name again.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import sys
import time

import httpx
import pytest

from llmgw.dev.procs import free_port, stop_process, wait_port
from llmgw.schemas.api import HeartbeatRequest, RegisterRequest, RenewRequest
from llmgw.schemas.inventory import Inventory
from llmgw.security.pki import issue_node, load_cert, make_csr, serial_text
from tests.helpers import ControlPlane, wait_until

pytestmark = pytest.mark.integration

REFRESH_S = 0.3


# ---- listening beyond loopback without mTLS -------------------------------------------------------

def _plain_env(tmp_path, **extra: str) -> dict[str, str]:
    """An environment with no certificate settings and a database nobody listens on (never reached)."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "LLMGW_CA_CERT", "LLMGW_NODE_API_CERT", "LLMGW_NODE_API_KEY", "LLMGW_NODE_API_INSECURE")}
    env.update({"LLMGW_STATE_DIR": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1",
                "LLMGW_DATABASE_URL": f"postgresql://nobody@127.0.0.1:{free_port()}/none",
                "LLMGW_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}", "LLMGW_GATEWAY_PORT": str(free_port()),
                "LLMGW_ADMIN_PORT": str(free_port()), "LLMGW_NODE_API_PORT": str(free_port())})
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw", *args], env=env, capture_output=True, text=True, timeout=60)


def _listens(args: list[str], env: dict[str, str], log_path) -> None:
    """`llmgw ARGS` starts and listens on its node-API port (reached on loopback); stopped after."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "llmgw", *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_port(int(env["LLMGW_NODE_API_PORT"]), 60, proc, "node API")
    finally:
        stop_process(proc, grace_s=10)


def test_the_node_api_refuses_to_listen_beyond_loopback_without_mtls(tmp_path):
    for command in (["node-api"], ["server", "--no-migrate"]):
        r = _run(command, _plain_env(tmp_path, LLMGW_HOST="0.0.0.0"))
        assert r.returncode != 0, r.stderr
        assert "the node API would listen on 0.0.0.0:" in r.stderr and "without mutual TLS" in r.stderr
        assert "LLMGW_NODE_API_INSECURE=anyone-can-claim-any-node" in r.stderr  # what to write to accept the risk
        assert "LLMGW_NODE_API_CERT" in r.stderr and "Traceback" not in r.stderr

    # Any other value of the setting is no acceptance, and says so.
    r = _run(["node-api"], _plain_env(tmp_path, LLMGW_HOST="0.0.0.0", LLMGW_NODE_API_INSECURE="true"))
    assert r.returncode != 0 and "LLMGW_NODE_API_INSECURE='true' is not the value that accepts the risk" in r.stderr

    # Written out exactly, it listens (and warns); on loopback it needs no certificate at all.
    _listens(["node-api"], _plain_env(tmp_path, LLMGW_HOST="0.0.0.0", LLMGW_NODE_API_INSECURE="anyone-can-claim-any-node"),
             tmp_path / "insecure.log")
    assert "runs without mutual TLS" in (tmp_path / "insecure.log").read_text()
    _listens(["node-api"], _plain_env(tmp_path, LLMGW_HOST="127.0.0.1"), tmp_path / "loopback.log")


# ---- revocation through a real server ------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, module_database_url):
    """One `llmgw server` (no Temporal: nothing here needs a workflow) that re-reads the deny-list often."""
    cp = ControlPlane(tmp_path_factory.mktemp("trust"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_REVOCATION_REFRESH_S=str(REFRESH_S))
    try:
        proc = cp.spawn("server", "server")
        wait_port(cp.ports["admin"], 60, proc.proc, "admin API")
        wait_port(cp.ports["node_api"], 60, proc.proc, "node API")
        yield cp
    finally:
        cp.stop()


def client(cp: ControlPlane, node_id: str) -> httpx.Client:
    env = cp.node_env(node_id)
    ctx = ssl.create_default_context(cafile=str(cp.pki / "ca.crt"))
    ctx.load_cert_chain(env["LLMGW_NODE_CERT"], env["LLMGW_NODE_KEY"])
    return httpx.Client(base_url=f"https://127.0.0.1:{cp.ports['node_api']}", verify=ctx, timeout=10)


def register(c: httpx.Client, node_id: str) -> httpx.Response:
    return c.post("/node/v1/register", json=RegisterRequest(node_id=node_id, boot_id="b1", inventory=Inventory(cpus=1))
                  .model_dump(mode="json"))


def heartbeat(c: httpx.Client, node_id: str) -> httpx.Response:
    return c.post("/node/v1/heartbeat", json=HeartbeatRequest(node_id=node_id, boot_id="b1").model_dump(mode="json"))


def renew(c: httpx.Client, node_id: str, csr: str | None = None) -> httpx.Response:
    return c.post("/node/v1/renew", json=RenewRequest(node_id=node_id, csr=csr or make_csr(node_id)[1])
                  .model_dump(mode="json"))


def test_a_revoked_node_is_refused_at_its_next_request_and_a_new_certificate_lets_it_back(server):
    cp = server
    with client(cp, "rv-a") as a, client(cp, "rv-b") as b:
        assert register(a, "rv-a").status_code == 200 and register(b, "rv-b").status_code == 200
        r = cp.ctl("cert", "revoke", "rv-a", "--reason", "machine stolen", "--yes")
        assert r.returncode == 0 and "revoked every certificate of node rv-a issued until now" in r.stdout, r.stderr
        began = time.monotonic()
        # The same kept-alive connection: refused at its next request once the node API has read the list.
        refused = wait_until(lambda: (h := heartbeat(a, "rv-a")).status_code == 403 and h, timeout_s=5,
                             interval_s=0.05, what="rv-a refused")
        assert time.monotonic() - began < 3 * REFRESH_S + 1.5
        err = refused.json()["error"]
        assert err["code"] == "certificate_revoked" and err["type"] == "forbidden"
        assert "every certificate of node rv-a issued before its revocation is revoked (machine stolen)" in err["message"]
        assert "llmgw ctl cert node rv-a --force" in err["message"]
        assert register(a, "rv-a").status_code == 403
        # ... and it cannot renew its way out.
        r = renew(a, "rv-a")
        assert r.status_code == 403 and r.json()["error"]["code"] == "certificate_revoked"
        assert heartbeat(b, "rv-b").status_code == 200  # another node is untouched

    # `ctl nodes remove` no longer says the node will simply register again.
    plan = httpx.post(cp.admin + "/admin/v1/nodes/rv-a/remove", json={"dry_run": True}, timeout=10, headers=cp.admin_headers).json()
    assert "are revoked: it cannot register again unless it is given a new one" in plan["note"]
    plan = httpx.post(cp.admin + "/admin/v1/nodes/rv-b/remove", json={"dry_run": True}, timeout=10, headers=cp.admin_headers).json()
    assert "unless it is stopped or its certificate revoked (llmgw ctl cert revoke rv-b)" in plan["note"]
    listed = cp.ctl("cert", "revoked")
    assert listed.returncode == 0 and "rv-a" in listed.stdout and "machine stolen" in listed.stdout

    # A certificate issued after the revocation (whole seconds: the next one) lets the node back.
    time.sleep(1.1)
    issue_node(cp.pki, "rv-a", replace=True)
    with client(cp, "rv-a") as a:
        assert register(a, "rv-a").status_code == 200

    # One certificate alone, by serial (as `ctl cert node` prints it, any case).
    serial = load_cert(cp.pki / "node-rv-b.crt").serial_number
    r = cp.ctl("cert", "revoke", "rv-b", "--serial", format(serial, "X"), "--yes")
    assert r.returncode == 0, r.stderr
    with client(cp, "rv-b") as b:
        h = wait_until(lambda: (h := heartbeat(b, "rv-b")).status_code == 403 and h, timeout_s=5, what="rv-b refused")
        assert f"certificate {serial_text(serial)} of node rv-b is revoked" in h.json()["error"]["message"]
    with client(cp, "rv-a") as a:
        assert heartbeat(a, "rv-a").status_code == 200  # rv-a's new certificate is not that one

    # A node id no certificate can have: a 400 in the envelope, not a row.
    r = httpx.post(cp.admin + "/admin/v1/nodes/a%20b/revoke", json={}, timeout=10, headers=cp.admin_headers)
    assert r.status_code == 400 and "no certificate names it" in r.json()["error"]["message"]


def test_renewal_signs_the_nodes_own_key_for_its_own_name_and_addresses_only(server):
    cp = server
    issue_node(cp.pki, "rn-api", addresses=["10.7.0.1", "gpu-7.example"], replace=True)
    with client(cp, "rn-api") as c:
        key, csr = make_csr("someone-else")  # the name in the CSR is ignored: the certificate's is used
        r = renew(c, "rn-api", csr)
        assert r.status_code == 200, r.text
        from cryptography import x509

        cert = x509.load_pem_x509_certificate(r.json()["certificate"].encode())
        assert cert.subject.rfc4514_string() == "CN=rn-api"
        assert cert.public_key().public_numbers() == key.public_key().public_numbers()
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"10.7.0.1"}
        assert sans.get_values_for_type(x509.DNSName) == ["gpu-7.example"]
        life = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert abs(life.total_seconds() - (7 * 86400 + 300)) < 5  # node_cert_days (7) from issuance, backdated 5 min
        assert r.json()["serial"] == serial_text(cert.serial_number)

        r = renew(c, "rn-api", "-----BEGIN CERTIFICATE REQUEST-----\nnot one\n-----END CERTIFICATE REQUEST-----\n")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_csr" and r.json()["error"]["param"] == "csr"
        r = renew(c, "rv-other")  # another node's name: refused like any other request
        assert r.status_code == 403 and r.json()["error"]["code"] == "node_identity"


# ---- a real agent renews --------------------------------------------------------------------------

LIFE_S = 20.0  # a node certificate's life here: the agent renews it after 13 s


def test_an_agent_renews_its_certificate_before_it_runs_out_and_a_revoked_one_cannot(tmp_path, database_url):
    days = str(LIFE_S / 86400)
    cp = ControlPlane(tmp_path, database_url, f"127.0.0.1:{free_port()}", LLMGW_REVOCATION_REFRESH_S=str(REFRESH_S),
                      LLMGW_NODE_CERT_DAYS=days)
    try:
        crt, key = cp.pki / "node-rn-1.crt", cp.pki / "node-rn-1.key"
        server = cp.spawn("server", "server")
        wait_port(cp.ports["admin"], 60, server.proc, "admin API")
        wait_port(cp.ports["node_api"], 60, server.proc, "node API")
        issue_node(cp.pki, "rn-1", days=LIFE_S / 86400)
        first = load_cert(crt)
        agent = cp.agent("rn-1")
        cp.wait_nodes("rn-1")

        # Renewed before the first certificate runs out, with a key made on the node.
        key_before = key.read_bytes()
        wait_until(lambda: load_cert(crt).serial_number != first.serial_number, timeout_s=LIFE_S + 10,
                   what="the certificate renewed", why=cp.logs)
        renewed = load_cert(crt)
        assert renewed.not_valid_after_utc > first.not_valid_after_utc
        assert key.read_bytes() != key_before and (key.stat().st_mode & 0o777) == 0o600
        assert "renewed this node's certificate" in agent.log()

        # New connections present the renewed certificate: the old one revoked, the node keeps serving, past
        # the old one's end too.
        assert cp.ctl("cert", "revoke", "rn-1", "--serial", serial_text(first.serial_number), "--yes").returncode == 0
        until = first.not_valid_after_utc.timestamp() + 2
        while time.time() < until:
            time.sleep(0.5)
        time.sleep(3 * REFRESH_S + 2)
        [node] = [n for n in httpx.get(cp.admin + "/admin/v1/nodes", timeout=10, headers=cp.admin_headers).json() if n["id"] == "rn-1"]
        assert node["status"] == "ready" and node["heartbeat_age_s"] < 2.5, node
        assert "certificate_revoked" not in agent.log()

        # The node revoked: its next request is refused, and it cannot renew.
        assert cp.ctl("cert", "revoke", "rn-1", "--yes").returncode == 0
        wait_until(lambda: "certificate_revoked" in agent.log(), timeout_s=10, what="the agent refused", why=cp.logs)
        wait_until(lambda: "the node API refused to renew this node's certificate" in agent.log(),
                   timeout_s=LIFE_S + 5, what="its renewal refused", why=cp.logs)
        assert agent.alive()  # refused, not crashed: an operator can let it back
    finally:
        cp.stop()


# ---- endpoints: the verified address, never the name ---------------------------------------------

class NoTemporal:
    def wake_soon(self, reason: str) -> None:
        pass


def resolving(table: dict[str, str]):
    """A resolver (the event loop's getaddrinfo) that knows only `table`: name -> IPv4 address."""
    async def getaddrinfo(self, host, port, **kw):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "no such name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[host], 0))]
    return getaddrinfo


async def test_an_endpoint_given_as_a_name_is_stored_and_routed_at_the_address_verified_at_report_time(
        database_url, monkeypatch):
    from llmgw.control.fleet_service import FleetService
    from llmgw.db import fleet_repo
    from llmgw.db.engine import async_engine
    from llmgw.gateway.upstream import parse_target
    from llmgw.schemas.api import ShardStatusRequest
    from llmgw.schemas.inventory import ShardReport
    from llmgw.schemas.payloads import ShardPlacement
    from llmgw.security.node_address import NodeAddresses

    engine = async_engine(database_url)
    loop_type = type(asyncio.get_running_loop())
    try:
        async with engine.begin() as conn:
            await fleet_repo.upsert_node(conn, "n7", "b1", Inventory())
            await fleet_repo.create_replica(conn, "r7", "m", "default", [ShardPlacement(node_id="n7")])
            await fleet_repo.upsert_node(conn, "n8", "b1", Inventory())
            await fleet_repo.create_replica(conn, "r8", "m", "default", [ShardPlacement(node_id="n8")])
        fleet = FleetService(engine, NoTemporal())  # type: ignore[arg-type]
        monkeypatch.setattr(loop_type, "getaddrinfo", resolving({"engine.n7.internal": "10.0.0.7",
                                                                 "gpu-8.example": "10.0.0.8"}))
        for node_id, rid, peer, names, host in (("n7", "r7", "10.0.0.7", (), "engine.n7.internal"),
                                                ("n8", "r8", "10.0.5.5", ("gpu-8.example",), "gpu-8.example")):
            ready = ShardReport(shard_id=f"{rid}-r0", replica_id=rid, model="m", profile="default", state="ready",
                                pid=1, endpoint=f"http://{host}:8000/v1", api_key="k" * 43)
            await fleet.shard_status(ShardStatusRequest(node_id=node_id, boot_id="b1", shard=ready),
                                     NodeAddresses(peer=peer, cert_names=names))
        # The start workflow's own "ready", with the name its node returned, does not put the name back.
        async with engine.begin() as conn:
            await fleet_repo.record_ready(conn, "r7", "http://engine.n7.internal:8000/v1")

        # The names now point elsewhere: what the gateway routes to is still the verified address.
        monkeypatch.setattr(loop_type, "getaddrinfo", resolving({"engine.n7.internal": "10.9.9.9",
                                                                 "gpu-8.example": "169.254.169.254"}))
        async with engine.connect() as conn:
            rows = {r.replica_id: r for r in await fleet_repo.routable_replicas(conn)}
        assert rows["r7"].endpoint == "http://10.0.0.7:8000/v1"
        assert rows["r8"].endpoint == "http://10.0.0.8:8000/v1"  # a name the certificate names: its address then
        assert (parse_target(rows["r7"].endpoint).host, parse_target(rows["r7"].endpoint).port) == ("10.0.0.7", 8000)
    finally:
        await engine.dispose()


def test_an_agent_advertising_a_host_name_is_routed_at_its_verified_address(control_plane):
    """Through a real agent, start workflow and gateway: the agent advertises `localhost`; the replica is
    recorded, and the gateway routes, at 127.0.0.1 (the address its node-API connection comes from)."""
    cp = control_plane.start()
    cp.agent("named", LLMGW_ADVERTISE_HOST="localhost")
    model = {"name": "sim-n", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "sim"}]}
    assert cp.apply({"models": [model]}).status_code == 200
    [rep] = cp.wait_replicas("sim-n", timeout_s=90)
    assert rep["endpoint"].startswith("http://127.0.0.1:"), rep
    chat = {"model": "sim-n", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    wait_until(lambda: httpx.post(cp.gateway + "/v1/chat/completions", json=chat, timeout=10).status_code == 200,
               what="sim-n served at its verified address", why=cp.logs)
