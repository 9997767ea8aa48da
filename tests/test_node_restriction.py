"""The node API: a node speaks only for itself (Kubernetes' NodeRestriction; issue 11), through a real
`llmgw server` and mutual TLS with certificates for several nodes.

- node A cannot fail, or claim, node B's shards: B's replica keeps serving, untouched;
- an endpoint a node reports must be at its own address (its connection's, or one its certificate names),
  else it is not adopted and its transition report is refused: the gateway proxies clients there;
- adoption of an engine the control plane has no record of is refused for a profile-hash mismatch, for a
  shard of a multi-node replica, and for a shard that is not ready (control/fleet_service.py,
  `unidentifiable`), and done when all is right (the control that shows the refusals are not vacuous).
"""

from __future__ import annotations

import ssl

import httpx
import psycopg
import pytest

from llmgw.catalog import read_catalog
from llmgw.dev.procs import free_port, wait_port
from llmgw.schemas.api import RegisterRequest, ShardStatusRequest
from llmgw.schemas.inventory import Inventory, ShardReport
from tests.helpers import ControlPlane, wait_until

pytestmark = pytest.mark.integration

CATALOG = {"models": [
    {"name": "sim-a", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0"]}]},
    {"name": "sim-tp", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim", "tp": 2, "nodes": 2}]},
]}
HASH = {m.name: m.profiles[0].spec_hash() for m in read_catalog(CATALOG).catalog.models}


def node_client(cp: ControlPlane, node_id: str, addresses: list[str] | None = None) -> httpx.Client:
    """An mTLS client of the node API holding `node_id`'s certificate (naming `addresses` when given)."""
    from llmgw.security.pki import issue_node

    if addresses:
        issue_node(cp.pki, node_id, addresses=addresses, replace=True)
    env = cp.node_env(node_id)
    ctx = ssl.create_default_context(cafile=str(cp.pki / "ca.crt"))
    ctx.load_cert_chain(env["LLMGW_NODE_CERT"], env["LLMGW_NODE_KEY"])
    return httpx.Client(base_url=f"https://127.0.0.1:{cp.ports['node_api']}", verify=ctx, timeout=30)


def register(c: httpx.Client, node_id: str, *shards: ShardReport) -> dict:
    r = c.post("/node/v1/register", json=RegisterRequest(node_id=node_id, boot_id="b1", inventory=Inventory(cpus=1),
                                                         shards=list(shards)).model_dump(mode="json"))
    assert r.status_code == 200, r.text
    return r.json()


def report(c: httpx.Client, node_id: str, shard: ShardReport) -> httpx.Response:
    return c.post("/node/v1/shards", json=ShardStatusRequest(node_id=node_id, boot_id="b1", shard=shard)
                  .model_dump(mode="json"))


def shard(replica_id: str, model: str = "sim-a", rank: int = 0, state: str = "ready",
          endpoint: str | None = None, profile_hash: str | None = None) -> ShardReport:
    return ShardReport(shard_id=f"{replica_id}-r{rank}", replica_id=replica_id, model=model, profile="default",
                       rank=rank, state=state, pid=4242, endpoint=endpoint or f"http://127.0.0.1:{free_port()}",
                       profile_hash=profile_hash or HASH[model], api_key="k" * 43)


@pytest.fixture(scope="module")
def server(tmp_path_factory, module_database_url, temporal):
    """One `llmgw server` (no worker: nothing here needs a workflow) with the catalog applied."""
    cp = ControlPlane(tmp_path_factory.mktemp("restriction"), module_database_url, temporal.address,
                      LLMGW_TEMPORAL_NAMESPACE=temporal.free_namespaces.pop(0))
    try:
        server = cp.spawn("server", "server")
        wait_port(cp.ports["admin"], 60, server.proc, "admin API")
        wait_port(cp.ports["node_api"], 60, server.proc, "node API")
        assert cp.apply(CATALOG).status_code == 200
        yield cp
    finally:
        cp.stop()


def replica_ids(cp: ControlPlane) -> set[str]:
    return {r["id"] for r in cp.replicas()}


# ---- adoption: refused unless everything matches ------------------------------------------------

def test_adoption_control_a_shard_that_runs_what_the_catalog_asks_is_adopted(server):
    with node_client(server, "adopt-ok") as c:
        got = register(c, "adopt-ok", shard("rep-ok"))
    assert got["adopted"] == ["rep-ok-r0"] and got["stop"] == []
    assert "rep-ok" in replica_ids(server)


def test_adoption_is_refused_for_a_profile_hash_mismatch(server):
    with node_client(server, "adopt-hash") as c:
        got = register(c, "adopt-hash", shard("rep-hash", profile_hash="0" * 32))
    assert got["stop"] == ["rep-hash-r0"] and got["adopted"] == []
    assert "rep-hash" not in replica_ids(server)
    assert "rep-hash-r0, which cannot be adopted (it runs a different profile" in server.procs[0].log()


@pytest.mark.parametrize("rank", [0, 1])
def test_adoption_is_refused_for_a_shard_of_a_multi_node_replica(server, rank):
    node = f"adopt-tp{rank}"
    with node_client(server, node) as c:
        got = register(c, node, shard(f"rep-tp{rank}", model="sim-tp", rank=rank))
    assert got["stop"] == [f"rep-tp{rank}-r{rank}"] and got["adopted"] == []
    assert f"rep-tp{rank}" not in replica_ids(server)
    assert f"rep-tp{rank}-r{rank}, which cannot be adopted (a shard of a multi-node replica" in server.procs[0].log()


@pytest.mark.parametrize("state", ["starting", "draining"])
def test_adoption_is_refused_for_a_shard_not_yet_ready(server, state):
    node = f"adopt-{state}"
    with node_client(server, node) as c:
        got = register(c, node, shard(f"rep-{state}", state=state))
    assert got["stop"] == [f"rep-{state}-r0"] and got["adopted"] == []
    assert f"rep-{state}" not in replica_ids(server)
    assert f"rep-{state}-r0, which cannot be adopted (it is {state}, not serving)" in server.procs[0].log()


# ---- endpoints at the node's own address --------------------------------------------------------

def test_an_adopted_endpoint_must_be_at_the_nodes_own_address(server):
    elsewhere = f"http://10.255.0.9:{free_port()}"
    with node_client(server, "addr-a") as c:
        got = register(c, "addr-a", shard("rep-far", endpoint=elsewhere))
        assert got["stop"] == ["rep-far-r0"] and got["adopted"] == []
        assert "rep-far" not in replica_ids(server)
        assert "endpoint host 10.255.0.9 is not this node's address (its node-API connection comes from 127.0.0.1)" \
            in server.procs[0].log()
        # Its own address (the connection's): adopted; a later report moving it elsewhere is refused.
        near = shard("rep-near")
        assert register(c, "addr-a", near)["adopted"] == ["rep-near-r0"]
        r = report(c, "addr-a", near.model_copy(update={"endpoint": elsewhere, "state": "ready"}))
        assert r.status_code == 403 and r.json()["error"]["code"] == "node_restriction"
        assert "10.255.0.9 is not this node's address" in r.json()["error"]["message"]
    [near_row] = [r for r in server.replicas() if r["id"] == "rep-near"]
    assert near_row["endpoint"] == near.endpoint and near_row["status"] == "ready"
    # An address the node's certificate names is its own too (engines on another network than the node API's).
    with node_client(server, "addr-b", addresses=["10.255.0.9"]) as c:
        assert register(c, "addr-b", shard("rep-named", endpoint=elsewhere))["adopted"] == ["rep-named-r0"]


# ---- node A and node B --------------------------------------------------------------------------

def test_a_node_cannot_fail_or_claim_another_nodes_shards(control_plane):
    cp = control_plane.start()
    cp.agent("node-b")
    other = {"name": "sim-z", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim"}]}
    assert cp.apply({"models": [{**CATALOG["models"][0], "scaling": {"min": 1, "max": 1}}, other]}).status_code == 200
    [rep] = cp.wait_replicas("sim-a", timeout_s=60)
    assert rep["node_id"] == "node-b"
    chat = {"model": "sim-a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    wait_until(lambda: httpx.post(cp.gateway + "/v1/chat/completions", json=chat, timeout=10).status_code == 200,
               what="sim-a serving from node-b")
    pid = cp.shard_pid("node-b", f"{rep['id']}-r0")
    theirs = ShardReport(shard_id=f"{rep['id']}-r0", replica_id=rep["id"], model="sim-a", profile="default",
                         state="failed", exit_code=1, exit_reason="exited with code 1")

    with node_client(cp, "node-a") as a:
        # Node A runs a replica of its own (adopted: the control plane had no record of it) ...
        own = ShardReport(shard_id="rep-a-r0", replica_id="rep-a", model="sim-z", profile="default", state="ready",
                          pid=4242, endpoint=f"http://127.0.0.1:{free_port()}",
                          profile_hash=read_catalog({"models": [other]}).catalog.models[0].profiles[0].spec_hash())
        assert register(a, "node-a", own)["adopted"] == ["rep-a-r0"]
        # ... and reports its own shard failed under B's replica id: refused (this failed B's replica before).
        r = report(a, "node-a", own.model_copy(update={"replica_id": rep["id"], "state": "failed", "exit_code": 1}))
        assert r.status_code == 403 and r.json()["error"]["code"] == "node_restriction"
        assert f"shard rep-a-r0 belongs to replica rep-a, not {rep['id']}" in r.json()["error"]["message"]
        # A transition report on B's shard itself: refused, and B's replica is untouched.
        r = report(a, "node-a", theirs)
        assert r.status_code == 403 and r.json()["error"]["code"] == "node_restriction"
        assert f"shard {rep['id']}-r0 is placed on node node-b, not on node-a" in r.json()["error"]["message"]
        # Claiming B's shard in a registration (with an endpoint of its own): not adopted, told to stop it.
        claim = theirs.model_copy(update={"state": "ready", "endpoint": f"http://127.0.0.1:{free_port()}",
                                          "profile_hash": HASH["sim-a"], "api_key": "k" * 43})
        got = register(a, "node-a", claim)
        assert got["stop"] == [claim.shard_id] and got["adopted"] == []
    # Even node B may not report its shard under another replica's id.
    with node_client(cp, "node-b") as b:
        r = report(b, "node-b", theirs.model_copy(update={"replica_id": "someone-else"}))
        assert r.status_code == 403 and f"belongs to replica {rep['id']}" in r.json()["error"]["message"]

    [after] = [r for r in cp.replicas() if r["id"] == rep["id"]]
    assert after["status"] == "ready" and after["endpoint"] == rep["endpoint"] and after["node_id"] == "node-b"
    assert cp.shard_pid("node-b", f"{rep['id']}-r0") == pid
    assert httpx.post(cp.gateway + "/v1/chat/completions", json=chat, timeout=10).status_code == 200


def test_an_agent_whose_engines_listen_elsewhere_fails_the_start_with_the_reason(control_plane):
    """Through a real agent: its engine listens on 127.0.0.2 while the agent reaches the node API from
    127.0.0.1. The control plane refuses the launch report, the agent stops the engine, and the replica
    fails saying what to set. (An address the certificate names is the node's own: see above.)"""
    cp = control_plane.start()
    cp.agent("far", LLMGW_ADVERTISE_HOST="127.0.0.2")
    assert cp.apply({"models": [{**CATALOG["models"][0], "scaling": {"min": 1, "max": 1}}]}).status_code == 200
    failed = wait_until(lambda: [r for r in cp.replicas() if r["status"] == "failed"], timeout_s=60,
                        what="the start refused", why=cp.logs)
    assert "the control plane refused shard" in failed[0]["failure"]
    assert "endpoint host 127.0.0.2 is not this node's address" in failed[0]["failure"]
    assert not list((cp.state / "shards" / "far").glob("*.json"))  # the engine was stopped


def test_a_replica_is_routed_only_at_the_endpoint_its_node_reported(database_url):
    """An endpoint recorded from elsewhere (a start workflow's result, which a node also supplies but the
    node API never checked) is not routed, and so never gets the engine key."""
    import asyncio

    from sqlalchemy import update

    from llmgw.db import fleet_repo
    from llmgw.db.engine import async_engine
    from llmgw.db.tables import replicas

    async def go() -> tuple[list, list]:
        engine = async_engine(database_url)
        try:
            async with engine.begin() as conn:
                await fleet_repo.upsert_node(conn, "n1", "b1", Inventory())
                assert await fleet_repo.adopt_replica(conn, "n1", shard("rep-1", endpoint="http://127.0.0.1:9001"))
                before = await fleet_repo.routable_replicas(conn)
                await conn.execute(update(replicas).where(replicas.c.id == "rep-1").values(endpoint="http://10.9.9.9:80"))
                after = await fleet_repo.routable_replicas(conn)
            return before, after
        finally:
            await engine.dispose()

    before, after = asyncio.run(go())
    assert [(r.replica_id, r.endpoint, r.api_key) for r in before] == [("rep-1", "http://127.0.0.1:9001", "k" * 43)]
    assert after == []


# ---- "still wanted?" before a launch (issue 13: start_shard asks the control plane itself) ----------

def test_launch_check_answers_a_node_about_its_own_shards_only(server):
    """`POST /node/v1/launch-check`: a node asks whether its shard's replica is still `starting` before it
    fetches for or launches it. It hears the truth about its own shards (here an adopted, Ready replica:
    not wanted, with its fencing generation), "unknown" for a shard nobody placed, 403 for another node's
    shard or another node's name, and 400 for ids longer than any llmgw makes."""
    with node_client(server, "lc-a") as a:
        assert register(a, "lc-a", shard("rep-lc"))["adopted"] == ["rep-lc-r0"]
        r = a.post("/node/v1/launch-check", json={"node_id": "lc-a", "shard_id": "rep-lc-r0", "replica_id": "rep-lc"})
        assert r.status_code == 200 and r.json()["wanted"] is False and r.json()["status"] == "ready", r.text
        assert isinstance(r.json()["generation"], int)
        r = a.post("/node/v1/launch-check", json={"node_id": "lc-a", "shard_id": "nobody-r0", "replica_id": "nobody"})
        assert r.json() == {"wanted": False, "status": "unknown", "generation": 0}
        r = a.post("/node/v1/launch-check", json={"node_id": "lc-b", "shard_id": "rep-lc-r0", "replica_id": "rep-lc"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "node_identity"
        r = a.post("/node/v1/launch-check", json={"node_id": "lc-a", "shard_id": "x" * 5000, "replica_id": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "shard_id", r.text
    with node_client(server, "lc-b") as b:
        r = b.post("/node/v1/launch-check", json={"node_id": "lc-b", "shard_id": "rep-lc-r0", "replica_id": "rep-lc"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "node_restriction"
        assert "rep-lc-r0 is placed on node lc-a" in r.json()["error"]["message"]
        r = b.post("/node/v1/launch-check", json={"node_id": "lc-b", "shard_id": "rep-lc-r0", "replica_id": "other"})
        assert r.status_code == 403


def test_launch_check_names_the_peers_holding_the_weights_at_their_own_addresses(server, module_database_url):
    """Peer fetch (issue 39): a node about to fetch names the cache entry; the answer names the other nodes
    whose inventory holds it and whose peer listener is at their own address (pinned like an engine
    endpoint: one advertised elsewhere is dropped, with a note). A cache name that is not one is a 400."""
    from llmgw.weights.naming import cache_name_for

    name = cache_name_for("mirror:pf.bin")

    def inventory(peer_url: str) -> dict:
        return {"cpus": 1, "cached_sources": [name], "peer_url": peer_url}

    with node_client(server, "pf-a") as a, node_client(server, "pf-c") as c, node_client(server, "pf-b") as b:
        r = a.post("/node/v1/register", json={"node_id": "pf-a", "boot_id": "b1", "inventory": inventory(
            "https://localhost:7001")})
        assert r.status_code == 200, r.text
        r = c.post("/node/v1/register", json={"node_id": "pf-c", "boot_id": "b1", "inventory": inventory(
            "https://10.9.9.9:7001")})
        assert r.status_code == 200, r.text
        r = c.post("/node/v1/heartbeat", json={"node_id": "pf-c", "boot_id": "b1", "inventory": inventory(
            "https://10.9.9.9:7002")})
        assert r.status_code == 200, r.text
        with psycopg.connect(module_database_url) as conn:
            conn.execute("INSERT INTO replicas (id, model, profile, status) VALUES ('rep-pf', 'sim-a', 'default', "
                         "'starting')")
            conn.execute("INSERT INTO shards (id, replica_id, node_id, rank, status) VALUES ('rep-pf-r0', 'rep-pf', "
                         "'pf-b', 0, 'starting')")
            stored = dict(conn.execute("SELECT id, inventory FROM nodes WHERE id IN ('pf-a', 'pf-c')").fetchall())
        assert stored["pf-a"]["peer_url"] == "https://127.0.0.1:7001"  # the name, pinned to the verified address
        assert stored["pf-c"].get("peer_url") is None
        assert any("peer listener not advertised" in n and "10.9.9.9" in n for n in stored["pf-c"]["notes"]), stored

        ask = {"node_id": "pf-b", "shard_id": "rep-pf-r0", "replica_id": "rep-pf"}
        r = b.post("/node/v1/launch-check", json={**ask, "cache_name": name})
        assert r.status_code == 200 and r.json()["wanted"] is True, r.text
        assert r.json()["peers"] == [{"node_id": "pf-a", "url": "https://127.0.0.1:7001"}]
        assert "peers" not in b.post("/node/v1/launch-check", json=ask).json()  # not asked: as before
        for bad in ("../../etc/passwd", "x" * 300, "0" * 32 + "-a b"):
            r = b.post("/node/v1/launch-check", json={**ask, "cache_name": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_name", r.text
        r = b.post("/node/v1/register", json={"node_id": "pf-b", "boot_id": "b1",
                                              "inventory": {"cpus": 1, "peer_url": "http://127.0.0.1:1/x?y"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "inventory.peer_url", r.text


def test_a_late_report_never_moves_a_shard_back(server, module_database_url):
    """A report that arrives late (an agent's retry of one sent before) had set the shard row back:
    `starting` after `ready`, `ready` after `stopped`. Now a shard's status only moves forward; the
    report's other facts (its exit code) are still kept."""
    def row() -> tuple:
        with psycopg.connect(module_database_url) as conn:
            return conn.execute("SELECT status, exit_code FROM shards WHERE id = 'rep-fw-r0'").fetchone()
    with node_client(server, "fw-a") as a:
        assert register(a, "fw-a", shard("rep-fw"))["adopted"] == ["rep-fw-r0"]
        assert row()[0] == "ready"
        assert report(a, "fw-a", shard("rep-fw", state="starting")).status_code == 200
        assert row()[0] == "ready"
        stopped = shard("rep-fw", state="stopped").model_copy(update={"exit_code": 0})
        assert report(a, "fw-a", stopped).status_code == 200
        assert row() == ("stopped", 0)
        late = shard("rep-fw", state="ready").model_copy(update={"exit_code": -9})
        assert report(a, "fw-a", late).status_code == 200
        assert row() == ("stopped", -9)


# ---- a node's goodbye (its agent stops its engines on exit) ----------------------------------------

def test_a_node_may_say_goodbye_only_for_itself_and_only_for_its_current_boot(server):
    """`POST /node/v1/leave`: a node cannot make another node leave (403 for another node's name), a
    goodbye from a boot that is not the registered one changes nothing (a late one from before a restart),
    oversized or malformed fields are 400 (an unknown one is ignored: a newer node's, issue 38), and the
    node's own goodbye loses its replicas and marks it left until it registers again."""
    with node_client(server, "lv-a") as a, node_client(server, "lv-b") as b:
        assert register(a, "lv-a", shard("rep-lv"))["adopted"] == ["rep-lv-r0"]
        register(b, "lv-b")
        r = b.post("/node/v1/leave", json={"node_id": "lv-a", "boot_id": "b1"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "node_identity"
        for body in ({"node_id": "lv-a", "boot_id": "x" * 5000}, {"node_id": "lv-a"},
                     {"node_id": "lv-a", "boot_id": ["b1"]}):
            assert a.post("/node/v1/leave", json=body).status_code == 400, body
        r = a.post("/node/v1/leave", json={"node_id": "lv-a", "boot_id": "an-old-boot"})
        assert r.status_code == 200 and r.json() == {"known": False, "lost": []}

        def rep() -> dict:
            return next(x for x in httpx.get(server.admin + "/admin/v1/replicas?all=true", timeout=10, headers=server.admin_headers).json()
                        if x["id"] == "rep-lv")

        def node(node_id: str) -> dict:
            return next(n for n in httpx.get(server.admin + "/admin/v1/nodes", timeout=10, headers=server.admin_headers).json() if n["id"] == node_id)
        assert rep()["status"] == "ready" and node("lv-a")["status"] == "ready"
        r = a.post("/node/v1/leave", json={"node_id": "lv-a", "boot_id": "b1"})
        assert r.status_code == 200 and r.json() == {"known": True, "lost": ["rep-lv"]}, r.text
        assert rep()["status"] == "lost" and "node lv-a left" in rep()["failure"]
        assert node("lv-a")["status"] == "unreachable" and node("lv-b")["status"] == "ready"
        register(a, "lv-a")
        assert node("lv-a")["status"] == "ready"



# ---- what a node may report: bounded, refused with 400 naming the field --------------------------

@pytest.mark.parametrize("field, value", [
    ("pid", 2**31), ("pid", 0), ("pid", -5), ("rank", 2**40), ("rank", -1), ("exit_code", 10**12),
    ("exit_code", -(2**40)), ("shard_id", "x" * 5000), ("model", "m" * 300), ("output_tail", "t" * 200_000),
    ("gpus", list(range(100))),
])
def test_a_shard_report_out_of_range_is_400_naming_the_field_and_the_registration_is_kept(server, field, value):
    """Out-of-range numbers had reached int32 columns: 500 with a traceback, and the node's registration
    rolled back with it. Now the report is refused naming the field, and a good one still registers."""
    with node_client(server, "abuse-a") as c:
        body = RegisterRequest(node_id="abuse-a", boot_id="b1", inventory=Inventory(cpus=1),
                               shards=[shard("rep-abuse")]).model_dump(mode="json")
        body["shards"][0][field] = value
        r = c.post("/node/v1/register", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "bad_request" and err["param"] == f"shards.0.{field}", err
        assert "Traceback" not in r.text
        assert register(c, "abuse-a")["adopted"] == []  # the node API still answers this node


def test_an_inventory_with_a_gpu_twice_or_a_node_id_too_long_is_refused(server):
    with node_client(server, "abuse-b") as c:
        inv = {"cpus": 1, "gpus": [{"index": 0}, {"index": 0}]}
        r = c.post("/node/v1/register", json={"node_id": "abuse-b", "boot_id": "b1", "inventory": inv})
        assert r.status_code == 400 and "name a GPU twice" in r.json()["error"]["message"], r.text
        r = c.post("/node/v1/heartbeat", json={"node_id": "n" * 300, "boot_id": "b1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "node_id", r.text
        r = c.post("/node/v1/heartbeat", json={"node_id": "abuse-b", "boot_id": "b1",
                                               "downloads": [{"replica_id": "r", "source": "s", "bytes": -1}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "downloads.0.bytes", r.text
