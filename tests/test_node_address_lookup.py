"""A node re-registering while DNS is failing (often the very outage that cut it off) must not have its
engines stopped: an endpoint whose name cannot be resolved *now* is neither this node's address nor
another's. Refusing it had stopped the engine and fenced its replica for good. Name resolution cannot be
made to fail transiently on this machine, so the resolver is the one part replaced; the rules run as the
node API runs them, on a real Postgres."""

from __future__ import annotations

import asyncio
import socket

import pytest
from sqlalchemy import select

from llmgw.db import fleet_repo
from llmgw.db.engine import async_engine
from llmgw.db.tables import replicas
from llmgw.control.fleet_service import FleetService
from llmgw.schemas.api import RegisterRequest, ShardStatusRequest
from llmgw.schemas.inventory import Inventory, ShardReport
from llmgw.schemas.payloads import ShardPlacement
from llmgw.security.node_address import AddressUnknown, NodeAddresses

pytestmark = pytest.mark.integration


class NoTemporal:
    def wake_soon(self, reason: str) -> None:
        pass


def resolver(errno: int):
    async def getaddrinfo(self, host, port, **kw):
        raise socket.gaierror(errno, "resolver says no")
    return getaddrinfo


async def test_an_endpoint_that_cannot_be_resolved_now_stops_nothing(database_url, monkeypatch):
    engine = async_engine(database_url)
    try:
        async with engine.begin() as conn:
            await fleet_repo.create_replica(conn, "r1", "m", "default", [ShardPlacement(node_id="n1")])
        fleet = FleetService(engine, NoTemporal())  # type: ignore[arg-type]
        node = NodeAddresses(peer="10.0.0.7")
        report = ShardReport(shard_id="r1-r0", replica_id="r1", model="m", profile="default", state="ready",
                             pid=123, endpoint="http://node-7.cluster:8000")
        req = RegisterRequest(node_id="n1", boot_id="b1", inventory=Inventory(), shards=[report])

        loop_type = type(asyncio.get_running_loop())
        monkeypatch.setattr(loop_type, "getaddrinfo", resolver(socket.EAI_AGAIN))  # "temporary failure"
        resp = await fleet.register(req, node)
        assert resp.stop == [] and resp.adopted == []
        async with engine.connect() as conn:
            status = (await conn.execute(select(replicas.c.status).where(replicas.c.id == "r1"))).scalar_one()
        assert status == "starting"  # not lost, not stopped: left as it was
        with pytest.raises(AddressUnknown):  # a transition report: 503 from the node API, and the node retries
            await fleet.shard_status(ShardStatusRequest(node_id="n1", boot_id="b1", shard=report), node)

        monkeypatch.setattr(loop_type, "getaddrinfo", resolver(socket.EAI_NONAME))  # the name does not exist
        resp = await fleet.register(req.model_copy(update={"boot_id": "b2"}), node)
        assert resp.stop == ["r1-r0"]  # a refusal, as before
    finally:
        await engine.dispose()
