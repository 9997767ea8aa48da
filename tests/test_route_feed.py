"""The route table's refreshes from Postgres's notifications (db/feed.py, gateway/routes.py), with a
real database: a change of replicas only (a replica turning Ready, on the cold-start path) refreshes the
routes without reading the catalog again; a change of the catalog, a refresh whose cause is unknown (the
timer) and one after a failed refresh read it in full."""

from __future__ import annotations

import asyncio

from llmgw.db import catalog_repo, fleet_repo
from llmgw.db.engine import async_engine
from llmgw.gateway import routes as routes_module
from llmgw.db.feed import ChangeFeed
from llmgw.gateway.routes import TABLES, RouteTable
from llmgw.schemas.catalog import Catalog, Model
from llmgw.schemas.inventory import Inventory, ShardReport
from llmgw.schemas.payloads import ShardPlacement


def sim(name: str) -> Model:
    return Model.model_validate({"name": name, "scaling": {"max": 1}, "profiles": [{"engine": "sim"}]})


async def eventually(check, what: str, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_replica_change_refreshes_routes_without_reading_the_catalog(database_url, monkeypatch):
    engine = async_engine(database_url)
    reads: list[int] = []
    real = catalog_repo.get_catalog

    async def counted(conn, memo=None):
        reads.append(1)
        return await real(conn, memo)
    monkeypatch.setattr(routes_module.catalog_repo, "get_catalog", counted)
    table = RouteTable(engine, 15.0)
    refreshes: list[set[str] | None] = []
    real_refresh = table.refresh

    async def refresh(changed=None):
        await real_refresh(changed)
        refreshes.append(changed)
    feed = ChangeFeed(database_url, refresh_s=3600)
    feed.subscribe("routes", TABLES, refresh, partial=True)
    try:
        async with engine.begin() as conn:
            await catalog_repo.apply_catalog(conn, Catalog(models=[sim("m1")]))
            await fleet_repo.upsert_node(conn, "n1", "boot", Inventory())
        await feed.start()
        await eventually(lambda: len(refreshes) >= 2, "the listener's first refresh")  # start, then connected
        assert refreshes[:2] == [None, None] and table.resolve("m1") is not None
        base = len(reads)

        # A replica turns Ready: the routes are refreshed (it is routed), the catalog is not read.
        n = len(refreshes)
        async with engine.begin() as conn:
            await fleet_repo.create_replica(conn, "r1", "m1", "default", [ShardPlacement(node_id="n1")])
            await fleet_repo.update_shard(conn, "n1", ShardReport(shard_id="r1-r0", replica_id="r1", model="m1",
                                                                  profile="default", state="ready",
                                                                  endpoint="http://127.0.0.1:9"))
            await fleet_repo.transition_replica(conn, "r1", "ready", endpoint="http://127.0.0.1:9")
        await eventually(lambda: table.resolve("m1") is not None and table.resolve("m1").endpoints, "r1 routed")
        await eventually(lambda: len(refreshes) > n, "the refresh")
        assert all(c == {"replicas"} for c in refreshes[n:]), refreshes[n:]
        assert len(reads) == base  # the catalog was not read for it

        # The catalog changes: it is read again, and the new model is routed.
        async with engine.begin() as conn:
            await catalog_repo.apply_catalog(conn, Catalog(models=[sim("m1"), sim("m2")]))
        await eventually(lambda: table.resolve("m2") is not None, "m2 in the routes")
        assert len(reads) > base  # (one read per refresh its statements' notifications caused)
        await asyncio.sleep(0.3)  # those refreshes are done

        # A refresh of unknown cause (the timer, a reconnect) reads everything.
        n, before = len(refreshes), len(reads)
        feed.changed()
        await eventually(lambda: len(refreshes) > n, "the timer's refresh")
        assert refreshes[-1] is None and len(reads) == before + 1
    finally:
        await feed.close()
        await engine.dispose()


async def test_after_a_failed_refresh_the_next_one_reads_everything():
    calls: list[set[str] | None] = []

    async def refresh(changed=None):
        calls.append(changed)
        if len(calls) == 1:
            raise RuntimeError("the database is away")
    feed = ChangeFeed("postgresql://unused", refresh_s=3600)
    feed.subscribe("routes", TABLES, refresh, partial=True)
    sub = feed.subscribers[0]
    feed.changed("replicas")
    try:
        await sub.run_refresh()
    except RuntimeError:
        pass
    feed.changed("replicas")
    await sub.run_refresh()
    assert calls == [{"replicas"}, None]  # what the failed refresh would have read is read in full
