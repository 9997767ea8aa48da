"""The snapshot's replicas and model states, kept between passes (db/snapshot_reads.py, issue 42), against a real
Postgres: what a pass reads with the memo equals what it reads without; a row unchanged is the same object
as last pass, a changed one is built again, a new replica's shards are read (by id, or all at once past
`BY_ID_MAX`), an ended and settled replica leaves the read and the memo, and a model's load is applied to a
copy, never to what the memo keeps. And the pass's explanations, saved as one statement, read back."""

from __future__ import annotations

from llmgw.db import catalog_repo, fleet_repo, load_repo, snapshot_reads
from llmgw.db.engine import async_engine
from llmgw.schemas.catalog import Catalog
from llmgw.schemas.inventory import Inventory
from llmgw.schemas.payloads import ShardPlacement


def _by_id(items) -> dict:
    return {x.id if hasattr(x, "id") else x.name: x for x in items}


async def test_replicas_are_built_again_only_when_their_row_changed(database_url, monkeypatch):
    engine = async_engine(database_url)
    memo = snapshot_reads.SnapshotMemo()
    try:
        async with engine.begin() as conn:
            for n in ("sr-a", "sr-b"):
                await fleet_repo.upsert_node(conn, n, "boot", Inventory())
            await fleet_repo.create_replica(conn, "sr-1", "m", "default", [ShardPlacement(node_id="sr-a", gpus=[0, 1])])
            await fleet_repo.create_replica(conn, "sr-2", "m", "default", [
                ShardPlacement(node_id="sr-b", rank=1, gpus=[0]), ShardPlacement(node_id="sr-a", rank=0, gpus=[2])])
            first = _by_id(await snapshot_reads.snapshot_replicas(conn, memo))
            assert first == _by_id(await snapshot_reads.snapshot_replicas(conn))  # with the memo as without
            assert [(s.node_id, s.rank, s.gpus) for s in first["sr-2"].shards] == [("sr-a", 0, [2]), ("sr-b", 1, [0])]

            again = _by_id(await snapshot_reads.snapshot_replicas(conn, memo))
            assert all(again[k] is first[k] for k in first)  # nothing changed: nothing built

            await fleet_repo.transition_replica(conn, "sr-1", "ready", endpoint="http://127.0.0.1:9")
            monkeypatch.setattr(snapshot_reads, "BY_ID_MAX", 1)  # two new replicas: their shards read all at once
            await fleet_repo.create_replica(conn, "sr-3", "m", "default", [ShardPlacement(node_id="sr-b", gpus=[3])])
            await fleet_repo.create_replica(conn, "sr-4", "m", "default", [ShardPlacement(node_id="sr-b", gpus=[4])])
            second = _by_id(await snapshot_reads.snapshot_replicas(conn, memo))
            assert second["sr-2"] is first["sr-2"]
            assert second["sr-1"] is not first["sr-1"] and second["sr-1"].status == "ready"
            assert second["sr-1"].shards == first["sr-1"].shards
            assert second["sr-3"].shards == [ShardPlacement(node_id="sr-b", gpus=[3])]
            assert second == _by_id(await snapshot_reads.snapshot_replicas(conn))

            monkeypatch.setattr(snapshot_reads, "BY_ID_MAX", 500)  # one new replica: asked for by id
            await fleet_repo.create_replica(conn, "sr-5", "m", "default", [ShardPlacement(node_id="sr-a", gpus=[5])])
            await fleet_repo.transition_replica(conn, "sr-2", "lost", failure="test")
            third = _by_id(await snapshot_reads.snapshot_replicas(conn, memo))
            assert third["sr-5"].shards == [ShardPlacement(node_id="sr-a", gpus=[5])]
            assert third["sr-2"].status == "lost" and not third["sr-2"].settled  # ended, not settled: still read
            await fleet_repo.settle_replica(conn, "sr-2")
            fourth = _by_id(await snapshot_reads.snapshot_replicas(conn, memo))
            assert "sr-2" not in fourth and "sr-2" not in memo.replicas
            assert fourth == _by_id(await snapshot_reads.snapshot_replicas(conn))
    finally:
        await engine.dispose()


async def test_model_states_are_built_again_when_changed_and_load_is_applied_to_a_copy(database_url):
    engine = async_engine(database_url)
    memo = snapshot_reads.SnapshotMemo()
    try:
        async with engine.begin() as conn:
            await catalog_repo.apply_catalog(conn, Catalog.model_validate({"models": [
                {"name": "ms-a", "profiles": [{"engine": "sim"}]}, {"name": "ms-b", "profiles": [{"engine": "sim"}]}]}))
            first = _by_id(await snapshot_reads.snapshot_model_states(conn, memo))
            assert first["ms-a"].demand_at is None and first["ms-a"].in_flight == 0
            await catalog_repo.record_demand(conn, "ms-a")
            await load_repo.report(conn, "gw-1", [load_repo.ModelLoad("ms-b", in_flight=3, queued=2)])
            second = _by_id(await snapshot_reads.snapshot_model_states(conn, memo))
            assert second["ms-a"] is not first["ms-a"] and second["ms-a"].demand_at is not None
            assert (second["ms-b"].in_flight, second["ms-b"].queued) == (3, 2)
            assert memo.states["ms-b"][1].in_flight == 0  # the kept one is the row's, without the load
            assert second == _by_id(await catalog_repo.model_states(conn))  # the plain read agrees
    finally:
        await engine.dispose()


async def test_a_pass_explanations_are_saved_in_one_statement_and_read_back(database_url):
    engine = async_engine(database_url)
    try:
        async with engine.begin() as conn:
            await catalog_repo.apply_catalog(conn, Catalog.model_validate({"models": [{"name": "sd-a", "profiles": [{"engine": "sim"}]}]}))
            odd = ["quote \" and backslash \\ and ünïcode", "a line\nwith a newline"]
            await catalog_repo.save_decisions(conn, {"sd-a": ["1 of 1 wanted"], "sd-new": odd})
            lines, at = await catalog_repo.get_decisions_at(conn, "sd-a")
            assert lines == ["1 of 1 wanted"] and at is not None
            assert (await catalog_repo.get_decisions_at(conn, "sd-new"))[0] == odd  # a row made for it
            await catalog_repo.save_decisions(conn, {"sd-a": []})
            assert (await catalog_repo.get_decisions_at(conn, "sd-a"))[0] == []
    finally:
        await engine.dispose()
