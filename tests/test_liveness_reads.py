"""The liveness reads a pass and a route refresh make, each folded into one statement for the cold-start path
(issue 13), against a real Postgres: they must say what the separate reads said. A blind observer stays
None (never "fresh"), a poll time never moves backwards for any of many nodes written at once, and a
route row carries the observers' ages."""

from __future__ import annotations

from datetime import timedelta

from llmgw.db import fleet_repo
from llmgw.db.engine import async_engine
from llmgw.schemas.inventory import Inventory, ShardReport
from llmgw.schemas.payloads import ShardPlacement


async def test_one_statement_reads_say_what_the_separate_reads_said(database_url):
    engine = async_engine(database_url)
    try:
        async with engine.begin() as conn:
            for n in ("a", "b", "c"):
                await fleet_repo.upsert_node(conn, n, "boot", Inventory())
            now = await fleet_repo.db_now(conn)
            # Nothing has ticked yet: both witnesses are blind (None), not fresh.
            seen = await fleet_repo.liveness_reads(conn, 15.0, 600.0)
            assert (seen.node_api_since, seen.pollers_since, seen.doubted_at, seen.recent_lost) == (None, None, None, 0)

            await fleet_repo.set_polled(conn, {"a": now - timedelta(seconds=5), "b": now - timedelta(seconds=50)})
            await fleet_repo.set_polled(conn, {"a": now - timedelta(seconds=30), "b": now - timedelta(seconds=1),
                                               "c": now - timedelta(seconds=9)})
            polled = {n.id: n.polled_at for n in await fleet_repo.list_nodes(conn)}
            assert polled == {"a": now - timedelta(seconds=5), "b": now - timedelta(seconds=1),
                              "c": now - timedelta(seconds=9)}  # a kept its newer time; b and c moved forward

            await fleet_repo.observer_tick(conn, fleet_repo.NODE_API + "p1", 15.0)
            await fleet_repo.observer_tick(conn, fleet_repo.POLLERS, 15.0)
            await fleet_repo.create_replica(conn, "gone", "m", "default", [ShardPlacement(node_id="a")])
            await fleet_repo.transition_replica(conn, "gone", "lost", failure="test")
            seen = await fleet_repo.liveness_reads(conn, 15.0, 600.0)
            assert seen.node_api_since == await fleet_repo.observer_since(conn, 15.0)
            assert seen.pollers_since == await fleet_repo.observer_since(conn, 15.0, fleet_repo.POLLERS)
            assert seen.node_api_since is not None and seen.doubted_at is None and seen.recent_lost == 1

            # A route row carries both observers' ages; with the pollers never ticked they would be None.
            await fleet_repo.create_replica(conn, "up", "m", "default", [ShardPlacement(node_id="b")])
            await fleet_repo.update_shard(conn, "b", ShardReport(shard_id="up-r0", replica_id="up", model="m",
                                                                 profile="default", state="ready",
                                                                 endpoint="http://127.0.0.1:9"))
            await fleet_repo.transition_replica(conn, "up", "ready", endpoint="http://127.0.0.1:9")
            [row] = await fleet_repo.routable_replicas(conn, 15.0)
            assert row.replica_id == "up" and row.observer_age_s is not None and 0.0 <= row.observer_age_s < 5
            pollers_since = await fleet_repo.observer_since(conn, 15.0, fleet_repo.POLLERS)
            assert row.pollers_age_s == (await fleet_repo.db_now(conn) - pollers_since).total_seconds()
            # Nothing ticked within the window (now() is the same in one transaction, so a negative one): None.
            [stale] = await fleet_repo.routable_replicas(conn, -1.0)
            assert stale.observer_age_s is None and stale.pollers_age_s is None
    finally:
        await engine.dispose()
