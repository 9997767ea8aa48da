"""A model stored a moment ago is served, not 404, by a gateway whose route table has not heard of it yet
(gateway/misses.py). Through a real `llmgw server` whose timer refresh is an hour away: the catalog rows
are written with triggers off (`session_replication_role = replica`), so their change notification never
comes, as when it is still on its way. Also the batching that keeps a flood of unknown names from
becoming a flood of queries."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import psycopg
import pytest

from llmgw.db import catalog_repo
from llmgw.db.engine import libpq_url
from llmgw.dev.procs import free_port
from llmgw.gateway import misses
from llmgw.gateway.misses import MissCheck
from tests.fake_engine import FakeEngines
from tests.helpers import ControlPlane

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def engines():
    fe = await FakeEngines().start()
    try:
        yield fe
    finally:
        await fe.close()


@pytest.fixture(scope="module")
async def gw(tmp_path_factory, module_database_url, engines):
    cp = ControlPlane(tmp_path_factory.mktemp("ryw"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_ROUTE_REFRESH_S="3600")
    try:
        await asyncio.to_thread(cp.start, worker=False)
        async with aiohttp.ClientSession() as s:
            async with s.post(cp.admin + "/admin/v1/catalog", headers=cp.admin_headers,
                              json={"catalog": {"models": [{"name": "first", "endpoints": [engines.url("echo")]}]}}) as r:
                assert r.status == 200, await r.text()
        yield cp
    finally:
        await asyncio.to_thread(cp.stop)


def store_silently(database_url: str, spec: dict, position: int = 50) -> None:
    """Write a catalog row the way `ctl apply` does, but with its change notification suppressed."""
    with psycopg.connect(libpq_url(database_url)) as conn:
        conn.execute("SET session_replication_role = replica")
        conn.execute("INSERT INTO catalog_models (name, position, spec) VALUES (%s, %s, %s)",
                     (spec["name"], position, json.dumps(spec)))


async def ask(gw: ControlPlane, model: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + "/v1/chat/completions",
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}]}) as r:
            return r.status, await r.json(content_type=None)


async def test_a_model_stored_before_its_notification_arrives_is_served_not_404(gw, engines, module_database_url):
    assert (await ask(gw, "first"))[0] == 200
    store_silently(module_database_url, {"name": "late", "aliases": ["late-alias"], "endpoints": [engines.url("echo")]})
    status, body = await ask(gw, "late")
    assert status == 200, body
    assert body["choices"][0]["message"]["content"]
    assert (await ask(gw, "late-alias"))[0] == 200

    # By its alias first, and through GET /v1/models/{id}.
    store_silently(module_database_url, {"name": "later", "aliases": ["later-alias"], "endpoints": [engines.url("echo")]})
    assert (await ask(gw, "later-alias"))[0] == 200
    store_silently(module_database_url, {"name": "org/latest", "endpoints": [engines.url("echo")]})
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.gateway + "/v1/models/org/latest") as r:
            assert r.status == 200 and (await r.json())["id"] == "org/latest"


async def test_unknown_and_unreadable_names_still_get_404_at_once(gw, module_database_url):
    status, body = await ask(gw, "never-stored")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    # Stored, but no rule of this version reads it (a profile with no engine): 404, twice, never a 500 or a hang.
    store_silently(module_database_url, {"name": "broken", "profiles": [{"engine": "no-such-engine"}]})
    for _ in range(2):
        status, body = await ask(gw, "broken")
        assert status == 404 and body["error"]["code"] == "model_not_found", body
    # Names no model can have are not looked up (nor are they a 500).
    for name in ("x/../y", "a" * 300, "\u202eevil", ""):
        status, body = await ask(gw, name)
        assert status in (400, 404) and "error" in body, (name, body)


async def test_a_flood_of_unknown_names_is_a_few_batched_queries(module_database_url, monkeypatch):
    from llmgw.db.engine import async_engine
    engine = async_engine(module_database_url)
    calls: list[list[str]] = []
    real = catalog_repo.stored_names

    async def counted(conn, names):
        calls.append(list(names))
        await asyncio.sleep(0.05)  # a slow database: the misses pile up behind one query
        return await real(conn, names)
    monkeypatch.setattr(misses.catalog_repo, "stored_names", counted)
    try:
        check = MissCheck(engine)
        answers = await asyncio.gather(*(check.stored(f"nope-{i}") for i in range(300)))
        assert not any(answers)
        assert len(calls) <= 2, [len(c) for c in calls]  # the first miss's query, then one for all the rest
        assert sum(len(c) for c in calls) == 300
        calls.clear()
        answers = await asyncio.gather(*(check.stored(f"x{i}") for i in range(misses.BATCH_MAX + 10)))
        assert len(calls) <= 3 and max(len(c) for c in calls) <= misses.BATCH_MAX
    finally:
        await engine.dispose()
