"""The gateway through real HTTP: a real `llmgw server` process in front of small engines that misbehave
on purpose (tests/fake_engine.py). One gateway and one catalog for the module; no Temporal, no nodes:
every model here is routed to static endpoints, or has no replica at all.

Covers the issue's "small inputs that must behave" that need no control plane, and the API's contract:
errors in the envelope, pass-through of unknown fields, aliases, fallbacks, retries, the breaker,
limits, guard policy, metrics, the official openai client.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import psycopg
import pytest
from openai import AsyncOpenAI

from llmgw.dev.procs import free_port
from tests.fake_engine import UTF8_TEXT, FakeEngines
from tests.helpers import ControlPlane

pytestmark = pytest.mark.integration

UPSTREAM_TIMEOUT_S = 2.0
BREAKER_FAILURES = 3


@pytest.fixture(scope="module")
async def engines():
    fe = await FakeEngines().start()
    try:
        yield fe
    finally:
        await fe.close()


def catalog(e: FakeEngines, frozen: str, dead: str) -> dict:
    sim_off = {"scaling": {"min": 0, "max": 0}, "profiles": [{"engine": "sim"}]}
    return {"models": [
        {"name": "echo", "aliases": ["echo-alias"], "endpoints": [e.url("echo")]},
        {"name": "org/echo-2", "endpoints": [e.url("echo") + "/v1"]},
        {"name": "nodone", "endpoints": [e.url("nodone")]},
        {"name": "utf8", "endpoints": [e.url("utf8")]},
        {"name": "slow", "endpoints": [e.url("slow")]},
        {"name": "cancel", "endpoints": [e.url("cancel")]},
        {"name": "breaks", "endpoints": [e.url("breaks")]},
        {"name": "stalls", "endpoints": [e.url("stalls")]},
        {"name": "limited", "endpoints": [e.url("delay")], "limits": {"max_concurrency": 4, "max_queue": 8}},
        {"name": "frozen", "endpoints": [frozen]},
        {"name": "flaky", "endpoints": [dead, e.url("echo")]},
        {"name": "busy", "endpoints": [e.url("busy503"), e.url("echo")]},
        {"name": "fail500", "endpoints": [e.url("fail500")]},
        {"name": "refuse400", "endpoints": [e.url("refuse400")]},
        {"name": "judge", "role": "guard", "endpoints": [e.url("judge")]},
        {"name": "guarded", "endpoints": [e.url("trigger")], "guard": {"model": "judge", "check": ["request", "response"]}},
        {"name": "primary", "fallbacks": ["echo"], **sim_off},
        {"name": "fleet-model", **sim_off},
        {"name": "sim-on-demand", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim"}]},
    ]}


@pytest.fixture(scope="module")
async def gw(tmp_path_factory, module_database_url, engines):
    """The gateway's base URL; also `.cp` (the ControlPlane) and `.db` (its database URL)."""
    frozen = await engines.frozen()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cp = ControlPlane(tmp_path_factory.mktemp("gw"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_UPSTREAM_TIMEOUT_S=str(UPSTREAM_TIMEOUT_S), LLMGW_BREAKER_FAILURES=str(BREAKER_FAILURES),
                      LLMGW_BREAKER_OPEN_S="60", LLMGW_LOAD_WAIT_S="1", LLMGW_ROUTE_REFRESH_S="0.5")
    try:
        await asyncio.to_thread(cp.start, worker=False)
        async with aiohttp.ClientSession() as s:
            async with s.post(cp.admin + "/admin/v1/catalog", json={"catalog": catalog(engines, frozen, dead)}) as r:
                assert r.status == 200, await r.text()
            deadline = time.monotonic() + 10
            while True:  # the gateway reloads its routes on the catalog's change notification
                async with s.get(cp.gateway + "/v1/models") as r:
                    if len((await r.json())["data"]) == len(catalog(engines, frozen, dead)["models"]):
                        break
                assert time.monotonic() < deadline, "the gateway never loaded the catalog"
                await asyncio.sleep(0.05)
        yield cp
    finally:
        await asyncio.to_thread(cp.stop)


async def post(gw: ControlPlane, path: str, body: dict, **kw) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + path, json=body, **kw) as r:
            return r.status, dict(r.headers), await r.json(content_type=None)


def chat(model: str, text: str = "hi", **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **kw}


def assert_envelope(body: dict, status: int) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in json.dumps(body)
    assert status != 500
    return err


# ---- streaming -------------------------------------------------------------------------------------

async def test_stream_read_as_raw_bytes_ends_with_done_and_a_blank_line(gw):
    async with aiohttp.ClientSession() as s:
        for model in ("echo", "nodone"):  # `nodone`'s engine forgets [DONE]: the gateway adds it
            async with s.post(gw.gateway + "/v1/chat/completions", json=chat(model, "a b c", stream=True)) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                assert "Content-Length" not in r.headers
                raw = await r.content.read()
            assert raw.endswith(b"\n\ndata: [DONE]\n\n"), raw[-80:]
            assert raw.count(b"data: [DONE]") == 1


async def test_multibyte_characters_split_across_writes_arrive_whole(gw):
    client = AsyncOpenAI(base_url=gw.gateway + "/v1", api_key="unused")
    stream = await client.chat.completions.create(model="utf8", messages=[{"role": "user", "content": "x"}], stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == UTF8_TEXT


async def test_chunks_arrive_as_the_engine_sends_them(gw):
    """The engine sends one chunk every 100 ms for 2 s: the client sees about the same gaps."""
    arrivals = []
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(gw.gateway + "/v1/chat/completions", json=chat("slow", stream=True)) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic() - t0)
    assert len(arrivals) == 20
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:]))
    assert 0.06 < gaps[len(gaps) // 2] < 0.2, gaps  # median gap ~100 ms: nothing held back
    assert arrivals[0] < 0.5 and arrivals[-1] > 1.7, arrivals  # the first chunk did not wait for the last


async def test_client_disconnect_cancels_the_engine_request(gw, engines):
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.gateway + "/v1/chat/completions", json=chat("cancel", stream=True))
        first = await r.content.readline()
        assert first.startswith(b"data: {")
        closed_at = time.monotonic()
        r.close()  # drops the connection
    deadline = time.monotonic() + 3
    while engines.state["cancelled_at"] is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert engines.state["cancelled_at"] is not None, "the engine never saw the request cancelled"
    assert engines.state["cancelled_at"] - closed_at < 1.0


async def test_an_engine_failing_mid_stream_ends_the_stream_with_an_error_event(gw):
    for model, code in (("breaks", "engine_error"), ("stalls", "engine_timeout")):
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.gateway + "/v1/chat/completions", json=chat(model, stream=True)) as r:
                assert r.status == 200  # already sent with the first chunk
                raw = await r.content.read()
        events = [e for e in raw.decode().split("\n\n") if e]
        assert events[0].startswith("data: {") and "partial" in events[0]
        last = json.loads(events[-1].removeprefix("data: "))
        assert last["error"]["code"] == code, raw  # what the openai client raises as an APIError
        assert b"[DONE]" not in raw  # a broken answer is not passed off as complete


# ---- errors ----------------------------------------------------------------------------------------

async def test_bad_requests_get_400_naming_the_field(gw):
    cases = [
        ("/v1/chat/completions", {"model": "echo"}, "messages"),
        ("/v1/chat/completions", {"model": "echo", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "echo", "messages": ["hi"]}, "messages[0]"),
        ("/v1/chat/completions", chat("echo", stream="yes"), "stream"),
        ("/v1/chat/completions", chat("echo", max_tokens=0), "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "model"),
        ("/v1/embeddings", {"model": "echo"}, "input"),
        ("/v1/completions", {"model": "echo"}, "prompt"),
    ]
    for path, body, param in cases:
        status, _, out = await post(gw, path, body)
        assert status == 400, (path, body, out)
        assert assert_envelope(out, status)["param"] == param
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + "/v1/chat/completions", data=b"{not json") as r:
            assert r.status == 400
            assert_envelope(await r.json(), r.status)


async def test_unknown_model_route_and_method_in_the_envelope(gw):
    status, _, out = await post(gw, "/v1/chat/completions", chat("no-such-model"))
    assert status == 404 and assert_envelope(out, status)["code"] == "model_not_found"
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.gateway + "/v1/chat/completions") as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"
            assert_envelope(await r.json(), r.status)
        async with s.get(gw.gateway + "/v1/nothing-here") as r:
            assert r.status == 404
            assert_envelope(await r.json(), r.status)
        async with s.get(gw.gateway + "/v1/models/no/such/model") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_engine_failures_become_envelopes_with_the_right_status(gw):
    status, _, out = await post(gw, "/v1/chat/completions", chat("fail500"))
    assert status == 502  # the engine's own text (a traceback here) stays in the gateway's log
    assert assert_envelope(out, status)["code"] == "engine_error"
    status, _, out = await post(gw, "/v1/chat/completions", chat("refuse400"))
    assert status == 400
    err = assert_envelope(out, status)
    assert err["message"] == "max_tokens is too large" and err["param"] == "max_tokens"


async def test_frozen_engine_gets_504_within_the_timeout_and_spares_the_others(gw):
    async def frozen():
        t0 = time.monotonic()
        status, _, out = await post(gw, "/v1/chat/completions", chat("frozen"))
        return status, out, time.monotonic() - t0

    async def healthy():
        t0 = time.monotonic()
        status, _, _ = await post(gw, "/v1/chat/completions", chat("echo"))
        return status, time.monotonic() - t0

    stuck = [asyncio.create_task(frozen()) for _ in range(BREAKER_FAILURES - 1)]
    await asyncio.sleep(0.2)
    for _ in range(10):  # while the frozen ones hang, the healthy model answers at once
        status, took = await healthy()
        assert status == 200 and took < 1.0
    for status, out, took in await asyncio.gather(*stuck):
        assert status == 504, out
        assert assert_envelope(out, status)["code"] == "engine_timeout"
        assert UPSTREAM_TIMEOUT_S - 0.2 < took < UPSTREAM_TIMEOUT_S + 1.5


# ---- routing ---------------------------------------------------------------------------------------

async def test_unknown_fields_pass_through_and_aliases_resolve(gw, engines):
    body = chat("echo-alias", extra_body_field={"nested": [1, "two"]}, seed=7)
    status, _, out = await post(gw, "/v1/chat/completions", body)
    assert status == 200, out
    received = out["received"]
    assert received["model"] == "echo"  # the alias is rewritten to the model's name ...
    assert received["extra_body_field"] == {"nested": [1, "two"]} and received["seed"] == 7  # ... nothing dropped


async def test_fallback_serves_while_the_model_has_no_replica(gw):
    status, _, out = await post(gw, "/v1/chat/completions", chat("primary", "hello"))
    assert status == 200, out
    assert out["received"]["model"] == "echo"
    assert out["choices"][0]["message"]["content"] == "echo: hello"


async def test_loading_is_said_only_while_a_replica_is_starting(gw, module_database_url):
    """Here no control worker runs, so nothing starts the on-demand model: the answer says so (pending),
    not "loading", which a client would retry for ever. With a replica starting, it is loading."""
    status, headers, out = await post(gw, "/v1/chat/completions", chat("sim-on-demand"))
    assert status == 503 and int(headers["Retry-After"]) > 0
    err = assert_envelope(out, status)
    assert err["code"] == "model_pending" and "no replica starting" in err["message"], err
    assert "loading" not in err["message"]
    with psycopg.connect(module_database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO replicas (id, model, profile, status) VALUES ('starting-1', 'sim-on-demand', "
                     "'default', 'starting')")
    try:
        status, headers, out = await post(gw, "/v1/chat/completions", chat("sim-on-demand"))
        err = assert_envelope(out, status)
        assert status == 503 and err["code"] == "model_loading" and "loading" in err["message"], err
        assert int(headers["Retry-After"]) > 0
    finally:
        with psycopg.connect(module_database_url, autocommit=True) as conn:
            conn.execute("DELETE FROM replicas WHERE id = 'starting-1'")


async def test_dead_and_busy_endpoints_are_retried_then_taken_out_by_the_breaker(gw):
    for model in ("flaky", "busy"):
        for _ in range(BREAKER_FAILURES + 3):
            status, _, out = await post(gw, "/v1/chat/completions", chat(model))
            assert status == 200, (model, out)
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.gateway + "/metrics") as r:
            text = await r.text()
    assert 'llmgw_open_breakers{model="flaky"} 1.0' in text
    assert 'llmgw_open_breakers{model="busy"} 1.0' in text
    assert 'llmgw_upstream_retries_total{model="flaky"}' in text


async def test_route_table_follows_replica_status_and_node_heartbeats(gw, engines):
    """Replicas come from Postgres: a Ready one is routed; Draining, or on a silent node, is not."""
    from sqlalchemy import func, update

    from llmgw.db import fleet_repo
    from llmgw.db.engine import async_engine
    from llmgw.db.tables import nodes
    from llmgw.schemas.inventory import Inventory
    from llmgw.schemas.payloads import ShardPlacement

    engine = async_engine(gw.env["LLMGW_DATABASE_URL"])

    async def ready(conn, rid: str) -> None:  # as a replica becomes Ready: its node reports the endpoint, then its start
        from llmgw.schemas.inventory import ShardReport

        await fleet_repo.update_shard(conn, "n1", ShardReport(shard_id=f"{rid}-r0", replica_id=rid, model="fleet-model",
                                                              profile="default", state="ready", endpoint=engines.url("echo")))
        await fleet_repo.mark_replica(conn, rid, "ready", endpoint=engines.url("echo"))

    async def routed() -> bool:
        status, _, _ = await post(gw, "/v1/chat/completions", chat("fleet-model"))
        assert status in (200, 503)
        return status == 200

    async def eventually(want: bool) -> None:
        deadline = time.monotonic() + 3
        while await routed() != want:
            assert time.monotonic() < deadline, f"fleet-model routed={not want} for 3s"
            await asyncio.sleep(0.05)

    try:
        async with engine.begin() as conn:
            await fleet_repo.upsert_node(conn, "n1", "boot-1", Inventory())
            for rid in ("r1", "r2"):
                await fleet_repo.create_replica(conn, rid, "fleet-model", "default", [ShardPlacement(node_id="n1")])
                await ready(conn, rid)
        await eventually(True)
        async with engine.begin() as conn:
            await fleet_repo.mark_replica(conn, "r1", "draining")
        await eventually(True)  # r2 still serves
        async with engine.begin() as conn:
            await fleet_repo.mark_replica(conn, "r2", "draining")
        await eventually(False)  # both draining: no new requests
        async with engine.begin() as conn:
            await fleet_repo.create_replica(conn, "r3", "fleet-model", "default", [ShardPlacement(node_id="n1")])
            await ready(conn, "r3")
        await eventually(True)
        async with engine.begin() as conn:  # the node goes silent: Unreachable
            await conn.execute(update(nodes).where(nodes.c.id == "n1")
                               .values(last_heartbeat=func.now() - func.make_interval(0, 0, 0, 0, 0, 10)))
        await eventually(False)
    finally:
        await engine.dispose()


# ---- limits ----------------------------------------------------------------------------------------

async def test_fifty_concurrent_requests_against_limit_four_queue_eight(gw, engines):
    engines.state["max_active"] = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one():
            async with s.post(gw.gateway + "/v1/chat/completions", json=chat("limited")) as r:
                return r.status, dict(r.headers), await r.json(content_type=None)
        results = await asyncio.gather(*(one() for _ in range(50)))
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429, 503}, statuses
    for status, headers, body in results:
        if status != 200:
            assert int(headers["Retry-After"]) >= 1
            assert_envelope(body, status)
    assert statuses.count(200) >= 12 and statuses.count(429) >= 1, statuses
    assert engines.state["max_active"] <= 4  # the engine never saw more than the limit


# ---- guard policy -----------------------------------------------------------------------------------

async def test_guard_model_judges_requests_and_responses(gw, engines):
    before = engines.state["hits"]["judge"]
    status, _, out = await post(gw, "/v1/chat/completions", chat("guarded", "a harmless question"))
    assert status == 200, out
    assert engines.state["hits"]["judge"] == before + 2  # the request, then the response

    status, _, out = await post(gw, "/v1/chat/completions", chat("guarded", "something forbidden"))
    assert status == 400
    err = assert_envelope(out, status)
    assert err["code"] == "content_filter" and err["param"] == "messages" and "request" in err["message"]
    assert "S1" in err["message"]

    trigger_hits = engines.state["hits"]["trigger"]
    status, _, out = await post(gw, "/v1/chat/completions", chat("guarded", "please trigger it", stream=True))
    assert status == 400  # the engine answered something the judge refuses: nothing of it reached us
    assert assert_envelope(out, status)["code"] == "content_filter" and "response" in out["error"]["message"]
    assert engines.state["hits"]["trigger"] == trigger_hits + 1

    async with aiohttp.ClientSession() as s:  # a judged stream is held, then relayed whole
        async with s.post(gw.gateway + "/v1/chat/completions", json=chat("guarded", "fine", stream=True)) as r:
            assert r.status == 200
            assert (await r.content.read()).endswith(b"data: [DONE]\n\n")


# ---- the rest of the API ------------------------------------------------------------------------------

async def test_official_openai_client_models_and_every_endpoint(gw):
    client = AsyncOpenAI(base_url=gw.gateway + "/v1", api_key="unused")
    models = {m.id: m.owned_by for m in (await client.models.list()).data}
    assert models["echo"] == "llmgw" and models["primary"] == "llmgw-sim"
    assert (await client.models.retrieve("org/echo-2")).id == "org/echo-2"
    r = await client.chat.completions.create(model="org/echo-2", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == "echo: x"
    r = await client.completions.create(model="echo", prompt="p")
    assert r.choices[0].text == "echo: p"
    e = await client.embeddings.create(model="echo", input="x")
    assert e.data[0].embedding == [0.1, 0.2]


async def test_metrics_count_requests_latency_ttft_and_bound_the_labels(gw):
    await post(gw, "/v1/chat/completions", chat("echo"))
    await post(gw, "/v1/chat/completions", chat("a-model-name-a-client-made-up"))
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + "/v1/chat/completions", json=chat("echo", stream=True)) as r:
            await r.read()
        async with s.get(gw.gateway + "/metrics") as r:
            text = await r.text()
    assert 'llmgw_requests_total{model="echo",status="200"}' in text
    assert 'llmgw_requests_total{model="unknown",status="404"}' in text
    assert "a-model-name-a-client-made-up" not in text
    assert 'llmgw_request_seconds_count{model="echo"}' in text
    assert 'llmgw_ttft_seconds_count{model="echo"}' in text
    assert 'llmgw_in_flight{model="echo"} 0.0' in text
    assert 'llmgw_ready_replicas{model="echo"} 1.0' in text


async def test_chat_page_never_preselects_a_model(gw):
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.gateway + "/") as r:
            page = await r.text()
    assert '<option value="" selected disabled>' in page  # a placeholder, not a model
    assert page.count(" selected") == 1 and ".selected =" not in page and "selected = true" not in page
