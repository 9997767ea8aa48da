"""The node API's steady-state heartbeat, served before FastAPI and written in batches (issue 42), through the
real listener with mutual TLS in this process (so the batcher can be looked at) over a real Postgres:

- heartbeats of a registered node and of one that never registered, arriving together, share a batch and
  each gets its own answer (ok; reregister); in one batch, each node's shards are judged as a beat alone
  judges them (a launched shard it no longer lists fails its replica; one it lists whose replica ended is
  named to stop; one it lists and runs is kept);
- a batch whose transaction fails is served beat by beat: every node still gets its own answer;
- abusive bodies (too large, too deep, wrong types, a bad node id, not JSON, no JSON content type) get the
  same 4xx as the FastAPI route gives them, and the steady-state answer is the route's own bytes;
- a revoked certificate, and one that names another node, are still refused on every heartbeat.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from llmgw.control import heartbeat_path
from llmgw.control.fleet_service import FleetService
from llmgw.control.nodeapi import create_node_api
from llmgw.control.revocations import DenyList
from llmgw.db import revocations_repo
from llmgw.db.engine import async_engine
from llmgw.dev.procs import free_port, port_open
from llmgw.http.jsonbody import BoundedJSON
from llmgw.http.serving import TLS, Listener, ListenerLimits, serve
from llmgw.schemas.api import RegisterRequest
from llmgw.schemas.inventory import Inventory
from llmgw.security.pki import create_ca, issue_node, issue_server, load_cert, serial_text

pytestmark = pytest.mark.integration

BODY_LIMIT = 1 << 20
PATH = heartbeat_path.PATH


class _Temporal:
    """FleetService wakes the reconciler through this; here nothing is woken."""

    def wake_soon(self, why: str) -> None:
        pass


@dataclass
class NodeAPI:
    url: str
    pki: Path
    app: BoundedJSON
    fleet: FleetService

    def client(self, node_id: str) -> httpx.AsyncClient:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / f"node-{node_id}.crt"), str(self.pki / f"node-{node_id}.key"))
        return httpx.AsyncClient(base_url=self.url, verify=ctx, timeout=10)

    @property
    def batcher(self):
        return self.app.lean[PATH].batcher


@pytest.fixture
async def node_api(tmp_path, database_url):
    pki = tmp_path / "pki"
    create_ca(pki)
    server = issue_server(pki, ["127.0.0.1"])
    for node in ("n-known", "n-new", "n-revoked", "n-gone", "n-ended"):
        issue_node(pki, node)
    engine = async_engine(database_url)
    async with engine.begin() as conn:
        serial = serial_text(load_cert(pki / "node-n-revoked.crt").serial_number)
        await revocations_repo.revoke_serial(conn, "n-revoked", serial, "a test")
    deny = DenyList(engine, 60.0)
    await deny.load()
    fleet = FleetService(engine, _Temporal())  # type: ignore[arg-type]
    app = create_node_api(fleet, require_identity=True, deny=deny)
    port = free_port()
    stop = asyncio.Event()
    task = asyncio.create_task(serve([Listener(app, "127.0.0.1", port, "node-api", lifespan="off",
                                               tls=TLS(str(server.cert), str(server.key), str(pki / "ca.crt")),
                                               limits=ListenerLimits(max_body_bytes=BODY_LIMIT))], stop))
    for _ in range(100):
        if await asyncio.to_thread(port_open, port, "127.0.0.1"):
            break
        await asyncio.sleep(0.05)
    try:
        yield NodeAPI(f"https://127.0.0.1:{port}", pki, app, fleet)
    finally:
        stop.set()
        await task
        await engine.dispose()


async def _register(api: NodeAPI, node_id: str) -> None:
    async with api.client(node_id) as c:
        body = RegisterRequest(node_id=node_id, boot_id="b1", inventory=Inventory(cpus=1)).model_dump(mode="json")
        assert (await c.post("/node/v1/register", json=body)).status_code == 200


async def _beats_together(api: NodeAPI, rounds: int = 5) -> list[tuple[httpx.Response, httpx.Response]]:
    """Heartbeats of n-known and n-new sent at the same moment, `rounds` times, each on its own connection."""
    out = []
    async with api.client("n-known") as known, api.client("n-new") as new:
        for _ in range(rounds):
            out.append(tuple(await asyncio.gather(
                known.post(PATH, json={"node_id": "n-known", "boot_id": "b1"}),
                new.post(PATH, json={"node_id": "n-new", "boot_id": "b1"}))))
    return out


async def test_a_batch_answers_each_node_for_itself(node_api):
    await _register(node_api, "n-known")
    node_api.batcher.window_s = 0.2  # the two beats of a round surely share their batch
    for known, new in await _beats_together(node_api):
        assert known.status_code == 200 and known.content == b'{"ok":true,"reregister":false}'
        assert new.status_code == 200 and new.content == b'{"ok":false,"reregister":true}'
    assert node_api.batcher.beats == 10 and node_api.batcher.batches < 10, (node_api.batcher.batches,
                                                                            node_api.batcher.beats)
    # The batch did stamp the node: its heartbeat's age is that of the last beat.
    from llmgw.db import fleet_repo
    async with node_api.fleet.engine.connect() as conn:
        ages = {n.id: n.age_s for n in await fleet_repo.list_nodes(conn)}
    assert set(ages) == {"n-known"} and ages["n-known"] < 1.0


async def test_in_one_batch_each_node_is_judged_as_its_beat_alone_would_be(node_api):
    from sqlalchemy import insert, select

    from llmgw.db.tables import nodes, replicas, shards

    async with node_api.fleet.engine.begin() as conn:
        await conn.execute(insert(nodes), [{"id": n, "boot_id": "b1", "inventory": {}}
                                           for n in ("n-known", "n-gone", "n-ended")])
        await conn.execute(insert(replicas), [{"id": "kept", "model": "m", "profile": "p", "status": "ready"},
                                              {"id": "gone", "model": "m", "profile": "p", "status": "ready"},
                                              {"id": "ended", "model": "m", "profile": "p", "status": "stopped"}])
        await conn.execute(insert(shards), [
            {"id": "kept-r0", "replica_id": "kept", "node_id": "n-known", "status": "ready", "pid": 10},
            {"id": "gone-r0", "replica_id": "gone", "node_id": "n-gone", "status": "ready", "pid": 11,
             "progress": {"source": "hf", "bytes": 1}},
            {"id": "ended-r0", "replica_id": "ended", "node_id": "n-ended", "status": "ready", "pid": 12}])

    def beat(node: str, *listed: tuple[str, str]) -> dict:
        return {"node_id": node, "boot_id": "b1", "shards": [
            {"shard_id": f"{r}-r0", "replica_id": r, "model": "m", "profile": "p", "state": "ready", "pid": 1}
            for r, _ in listed]}

    node_api.batcher.window_s = 0.2
    clients = {n: node_api.client(n) for n in ("n-known", "n-gone", "n-ended", "n-new")}
    try:
        answers = await asyncio.gather(
            clients["n-known"].post(PATH, json=beat("n-known", ("kept", "m"))),
            clients["n-gone"].post(PATH, json=beat("n-gone")),
            clients["n-ended"].post(PATH, json=beat("n-ended", ("ended", "m"))),
            clients["n-new"].post(PATH, json=beat("n-new")))
    finally:
        for c in clients.values():
            await c.aclose()
    assert node_api.batcher.batches == 1 and node_api.batcher.beats == 4
    assert [(r.status_code, r.json()) for r in answers] == [
        (200, {"ok": True, "reregister": False}), (200, {"ok": True, "reregister": False}),
        (200, {"ok": True, "reregister": False, "stop": ["ended-r0"]}), (200, {"ok": False, "reregister": True})]
    async with node_api.fleet.engine.connect() as conn:
        status = dict((await conn.execute(select(replicas.c.id, replicas.c.status))).all())
        failure = (await conn.execute(select(replicas.c.failure).where(replicas.c.id == "gone"))).scalar_one()
        progress = (await conn.execute(select(shards.c.progress).where(shards.c.id == "gone-r0"))).scalar_one()
    assert status == {"kept": "ready", "gone": "failed", "ended": "stopped"}
    assert "node n-gone no longer runs shard gone-r0" in failure
    assert progress is None  # cleared with the beat, as an empty `downloads` clears it


async def test_a_batch_that_fails_is_served_beat_by_beat(node_api, monkeypatch, caplog):
    await _register(node_api, "n-known")
    node_api.batcher.window_s = 0.2

    async def deadlocked(reqs):
        raise RuntimeError("deadlock detected (a stand-in)")

    monkeypatch.setattr(node_api.fleet, "heartbeat_many", deadlocked)
    for known, new in await _beats_together(node_api, rounds=2):
        assert known.status_code == 200 and known.json() == {"ok": True, "reregister": False}
        assert new.status_code == 200 and new.json() == {"ok": False, "reregister": True}
    assert "serving each alone" in caplog.text


def _route_only(api: NodeAPI, node_id: str) -> httpx.AsyncClient:
    """The FastAPI route alone (what served every heartbeat before), its scope given the node's certificate."""
    cert = load_cert(api.pki / f"node-{node_id}.crt")
    tls = {"client_cert_name": node_id, "client_cert_ips": [], "client_cert_names": [], "peer_address": "127.0.0.1",
           "client_cert_serial": format(cert.serial_number, "X"),
           "client_cert_not_before": cert.not_valid_before_utc.strftime("%b %d %H:%M:%S %Y GMT")}
    route = BoundedJSON(api.app.app)

    async def asgi(scope, receive, send):
        await route({**scope, "extensions": {**scope.get("extensions", {}), "tls": tls}}, receive, send)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://node-api")


ABUSIVE = [  # (what, body, content type, status, param)
    ("deep JSON", b'{"node_id": "n-known", "boot_id": "b1", "shards": ' + b"[" * 100 + b"]" * 100 + b"}",
     "application/json", 400, "shards"),
    ("a node id that is a number", b'{"node_id": 5, "boot_id": "b1"}', "application/json", 400, "node_id"),
    ("an empty node id", b'{"node_id": "", "boot_id": "b1"}', "application/json", 400, "node_id"),
    ("a node id too long", b'{"node_id": "' + b"n" * 300 + b'", "boot_id": "b1"}', "application/json", 400, "node_id"),
    ("shards that are not a list", b'{"node_id": "n-known", "boot_id": "b1", "shards": "x"}', "application/json",
     400, "shards"),
    ("a shard off its schema", b'{"node_id": "n-known", "boot_id": "b1", "shards": [{"shard_id": 1}]}',
     "application/json", 400, None),
    ("no boot id", b'{"node_id": "n-known"}', "application/json", 400, "boot_id"),
    ("not JSON", b'{"node_id": "n-known", ', "application/json", 400, None),
    ("NaN", b'{"node_id": "n-known", "boot_id": "b1", "x": NaN}', "application/json", 400, "x"),
    ("a list", b'[1, 2]', "application/json", 400, None),
    ("no JSON content type", b'{"node_id": "n-known", "boot_id": "b1"}', "text/plain", 400, None),
    ("an empty body", b"", "application/json", 400, None),
]


@pytest.mark.parametrize("what,body,ctype,status,param", ABUSIVE, ids=[a[0] for a in ABUSIVE])
async def test_abusive_heartbeats_get_the_routes_clear_4xx(node_api, what, body, ctype, status, param):
    async with node_api.client("n-known") as c, _route_only(node_api, "n-known") as route:
        r = await c.post(PATH, content=body, headers={"content-type": ctype})
        before = await route.post(PATH, content=body, headers={"content-type": ctype})
    assert r.status_code == status, (what, r.text)
    assert r.json() == before.json() and r.status_code == before.status_code, (what, r.text, before.text)
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error", err
    if param is not None:
        assert err["param"] == param, err


async def test_a_body_over_the_listeners_limit_is_refused_before_it_is_read(node_api):
    async with node_api.client("n-known") as c:
        try:
            r = await c.post(PATH, content=b'{"node_id": "n-known", "boot_id": "b1", "x": "' + b"a" * BODY_LIMIT + b'"}',
                             headers={"content-type": "application/json"})
        except (httpx.WriteError, httpx.ReadError, httpx.RemoteProtocolError):
            return  # the answer came while the client still sent, and the connection closed under it
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text


async def test_the_steady_state_answer_is_the_routes_own_bytes(node_api):
    await _register(node_api, "n-known")
    beat = {"node_id": "n-known", "boot_id": "b1"}
    async with node_api.client("n-known") as c, _route_only(node_api, "n-known") as route:
        for body in (beat, {**beat, "boot_id": "b-other"}):
            r, before = await c.post(PATH, json=body), await route.post(PATH, json=body)
            assert (r.status_code, r.content, r.headers["content-type"]) == (
                before.status_code, before.content, before.headers["content-type"])
    assert node_api.batcher.beats == 2  # the real listener's beats took the lean path, the route's did not


async def test_a_revoked_certificate_or_another_nodes_id_is_refused(node_api):
    async with node_api.client("n-revoked") as c:
        r = await c.post(PATH, json={"node_id": "n-revoked", "boot_id": "b1"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "certificate_revoked", r.text
    async with node_api.client("n-known") as c, _route_only(node_api, "n-known") as route:
        body = {"node_id": "n-new", "boot_id": "b1"}
        r, before = await c.post(PATH, json=body), await route.post(PATH, json=body)
    assert r.status_code == 403 and r.json()["error"]["code"] == "node_identity", r.text
    assert r.content == before.content
    assert node_api.batcher.beats == 0
