"""`model_state.replaced` (`ctl models` RESTARTS): every replica of a model that ends failed or lost counts
once, in the transaction that ends it, and nothing sets it back. The real path (an engine killed while
serving, a start that dies) is asserted in tests/test_dev_e2e.py and tests/test_operator_view.py; here the
counting rules and the migration's backfill, on a real Postgres."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from sqlalchemy import select

from llmgw.db import catalog_repo, fleet_repo
from llmgw.db.engine import async_engine
from llmgw.db.migrate import upgrade
from llmgw.db.tables import model_state
from llmgw.schemas.payloads import ShardPlacement

pytestmark = pytest.mark.integration


async def replaced(engine, name: str) -> int | None:
    async with engine.connect() as conn:
        return (await conn.execute(select(model_state.c.replaced).where(model_state.c.name == name))).scalar()


async def test_each_failed_or_lost_replica_counts_once_and_nothing_sets_it_back(database_url):
    engine = async_engine(database_url)
    try:
        async with engine.begin() as conn:
            for rid in ("r1", "r2", "r3"):
                await fleet_repo.create_replica(conn, rid, "m", "default", [ShardPlacement(node_id="n1")])
        async with engine.begin() as conn:
            assert (await fleet_repo.transition_replica(conn, "r1", "failed", failure="killed by SIGKILL")).applied
        assert await replaced(engine, "m") == 1
        async with engine.begin() as conn:  # the same transition again (a retried activity): not applied
            assert not (await fleet_repo.transition_replica(conn, "r1", "failed", failure="again")).applied
            assert not (await fleet_repo.transition_replica(conn, "r1", "lost")).applied
        assert await replaced(engine, "m") == 1
        async with engine.begin() as conn:
            assert (await fleet_repo.transition_replica(conn, "r2", "lost", failure="node n1 lost")).applied
            assert (await fleet_repo.transition_replica(conn, "r3", "stopped", reason="idle")).applied
        assert await replaced(engine, "m") == 2  # a stop the control plane asked for is no restart
        async with engine.begin() as conn:  # a start that reaches Ready, or `ctl retry`, clears failures only
            await catalog_repo.reset_failures(conn, "m")
        assert await replaced(engine, "m") == 2
    finally:
        await engine.dispose()


def test_the_migration_counts_the_replicas_that_had_already_failed(postgres):
    name = "t_" + uuid.uuid4().hex[:12]
    admin = postgres.url_for("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = postgres.url_for(name)
    try:
        upgrade(url, "0008_model_failed_at")
        with psycopg.connect(url) as conn:
            conn.execute("INSERT INTO model_state (name, failures) VALUES ('a', 0), ('b', 2)")
            conn.execute("INSERT INTO replicas (id, model, profile, status) VALUES "
                         "('1', 'a', 'default', 'failed'), ('2', 'a', 'default', 'lost'), "
                         "('3', 'a', 'default', 'stopped'), ('4', 'a', 'default', 'ready'), ('5', 'b', 'default', 'failed')")
        upgrade(url)
        with psycopg.connect(url) as conn:
            got = dict(conn.execute("SELECT name, replaced FROM model_state").fetchall())
        assert got == {"a": 2, "b": 1}
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
