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


async def test_the_snapshots_inventory_memo_parses_only_what_changed_and_reads_what_list_nodes_reads(database_url):
    """The snapshot reads every node each pass with an `InventoryMemo` (issue 42): an inventory unchanged in
    Postgres is the same object as last pass (not parsed again), a changed one (a registration, a
    heartbeat carrying one) is read anew, one this version refuses reads as empty with its note, a node
    forgotten leaves the memo; and what it reads equals what `list_nodes` without it reads."""
    from llmgw.schemas.inventory import GPU

    engine = async_engine(database_url)
    memo = fleet_repo.InventoryMemo()
    try:
        async with engine.begin() as conn:
            await fleet_repo.upsert_node(conn, "m1", "boot", Inventory(cpus=8, gpus=[GPU(index=0, memory_mb=81920)]))
            await fleet_repo.upsert_node(conn, "m2", "boot", Inventory(cpus=4))
            first = {n.id: n.inventory for n in await fleet_repo.list_nodes(conn, memo)}
            plain = {n.id: n.inventory for n in await fleet_repo.list_nodes(conn)}
            assert first == plain and first["m1"].gpus[0].memory_mb == 81920
            await fleet_repo.heartbeat(conn, "m2", "boot")  # no inventory: unchanged
            await fleet_repo.heartbeat(conn, "m1", "boot", Inventory(cpus=16))  # a new one
            second = {n.id: n.inventory for n in await fleet_repo.list_nodes(conn, memo)}
            assert second["m2"] is first["m2"]  # not parsed again
            assert second["m1"].cpus == 16 and second["m1"].gpus == []
            await conn.exec_driver_sql(  # two GPUs of one index: refused by this version's rules
                "UPDATE nodes SET inventory = '{\"gpus\": [{\"index\": 0}, {\"index\": 0}]}' WHERE id = 'm2'")
            third = {n.id: n.inventory for n in await fleet_repo.list_nodes(conn, memo)}
            assert third["m2"].gpus == [] and "cannot be read" in " ".join(third["m2"].notes)
            await conn.exec_driver_sql("DELETE FROM nodes WHERE id = 'm2'")
            await fleet_repo.list_nodes(conn, memo)
            assert set(memo.parsed) == {"m1"}
    finally:
        await engine.dispose()


def test_the_collector_is_held_off_for_a_pass_and_on_again_after_the_last_of_overlapping_passes():
    import gc

    from llmgw.control.gc_pause import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # a rollout step beside a decide
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # held off by someone else: left so
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_the_catalog_memo_keeps_an_unchanged_catalog_and_reads_a_changed_one(database_url):
    """The snapshot and the route table read the catalog with a `CatalogMemo`, compared as Postgres's text of
    each spec: unchanged, the same `Catalog` object; changed, read anew (issue 42)."""
    from llmgw.db import catalog_repo
    from llmgw.schemas.catalog import Catalog

    engine = async_engine(database_url)
    memo = catalog_repo.CatalogMemo()
    spec = {"name": "a", "profiles": [{"engine": "sim"}]}
    try:
        async with engine.begin() as conn:
            await catalog_repo.apply_catalog(conn, Catalog.model_validate({"models": [spec]}))
            first, _ = await catalog_repo.read_catalog(conn, memo)
            again, _ = await catalog_repo.read_catalog(conn, memo)
            assert again is first and [m.name for m in first.models] == ["a"]
            await catalog_repo.apply_catalog(conn, Catalog.model_validate({"models": [
                spec, {"name": "b", "profiles": [{"engine": "sim"}]}]}))
            changed, _ = await catalog_repo.read_catalog(conn, memo)
            assert changed is not first and [m.name for m in changed.models] == ["a", "b"]
            assert changed == (await catalog_repo.read_catalog(conn))[0]  # as a read without the memo
    finally:
        await engine.dispose()


async def test_a_heartbeat_records_and_clears_download_progress_in_its_statement(database_url):
    """The heartbeat's progress (issue 42: folded into its UPDATE as a CTE): a download it reports is kept
    on its starting shard, one it no longer reports is cleared, and a heartbeat of a boot that never
    registered changes nothing."""
    from llmgw.schemas.inventory import DownloadProgress

    engine = async_engine(database_url)
    try:
        async with engine.begin() as conn:
            await fleet_repo.upsert_node(conn, "d1", "boot", Inventory())
            for rid in ("r1", "r2"):
                await fleet_repo.create_replica(conn, rid, "m", "default", [ShardPlacement(node_id="d1")])

            async def progress() -> dict:
                rows = (await conn.exec_driver_sql("SELECT replica_id, progress FROM shards ORDER BY 1")).all()
                return {r[0]: (r[1] or {}).get("bytes") for r in rows}

            down = [DownloadProgress(replica_id=rid, source="mirror:x", bytes=n) for rid, n in (("r1", 10), ("r2", 20))]
            assert await fleet_repo.heartbeat(conn, "d1", "boot", downloads=down)
            assert await progress() == {"r1": 10, "r2": 20}
            assert not await fleet_repo.heartbeat(conn, "d1", "stale-boot", downloads=[])  # another boot: nothing
            assert await progress() == {"r1": 10, "r2": 20}
            assert await fleet_repo.heartbeat(conn, "d1", "boot", downloads=down[1:])  # r1 done
            assert await progress() == {"r1": None, "r2": 20}
            assert await fleet_repo.heartbeat(conn, "d1", "boot", downloads=[])
            assert await progress() == {"r1": None, "r2": None}
    finally:
        await engine.dispose()
