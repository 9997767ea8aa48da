"""Tenants, limits and usage through the real path (issue 15): `llmgw ctl` and the admin API on a real
`llmgw server`, a second `llmgw server` on the same Postgres, real sim engines as static endpoints (their
own `/metrics` counters are what usage is checked against) and a fake engine that records request bodies.

One control plane for the module (no Temporal, no nodes), with budget days shortened to `DAY_S` seconds
(`LLMGW_TEST_BUDGET_DAY_S`) so a spent daily budget is seen to renew. Each test uses tenants of its own.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from datetime import datetime, timezone

import aiohttp
import httpx
import psycopg
import pytest

from llmgw.dev.procs import free_port, stop_process, wait_port
from tests.fake_engine import FakeEngines
from tests.helpers import ControlPlane, wait_until

pytestmark = pytest.mark.integration

DAY_S = 10.0


class Sim:
    """A real sim engine process (no token delay), and its own counters."""

    def __init__(self, model: str, tokens_per_second: float = 0):
        self.model = model
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "llmgw.engines.sim_server", "--port", str(self.port),
                                      "--model", model, "--tokens-per-second", str(tokens_per_second)],
                                     start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def counters(self) -> dict[str, int]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {ln.split()[0]: int(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


@pytest.fixture(scope="module")
async def plane(tmp_path_factory, module_database_url):
    """`.cp` the control plane (its gateway is gateway 1), `.gw2` the second gateway's URL, `.sims` the sim
    engines by model, `.fake` the recording engines."""
    fake = await FakeEngines().start()
    sims = {m: Sim(m) for m in ("sim", "sim-b")}
    slow = Sim("slow", tokens_per_second=20)  # a stream a client can leave before its end
    cp = ControlPlane(tmp_path_factory.mktemp("tenants"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_ROUTE_REFRESH_S="0.5", LLMGW_TEST_BUDGET_DAY_S=str(DAY_S))
    try:
        for s in (*sims.values(), slow):
            wait_port(s.port, 30, s.proc, f"sim engine {s.model}")
        await asyncio.to_thread(cp.start, worker=False)
        g2, a2 = free_port(), free_port()
        second = cp.spawn("server-2", "server", "--no-migrate", env={
            "LLMGW_GATEWAY_PORT": str(g2), "LLMGW_ADMIN_PORT": str(a2), "LLMGW_NODE_API_PORT": "0"})
        await asyncio.to_thread(wait_port, g2, 60, second.proc, "the second gateway")
        r = cp.apply({"models": [
            {"name": "sim", "aliases": ["sim-alias"], "endpoints": [sims["sim"].url]},
            {"name": "sim-b", "endpoints": [sims["sim-b"].url]},
            {"name": "echo", "endpoints": [fake.url("echo")]},
            {"name": "slow", "endpoints": [slow.url]},
            # an operator's cap on what a choice of a request without one may generate (issue 37)
            {"name": "echo-capped", "endpoints": [fake.url("echo")], "limits": {"max_output_tokens": 64}},
            {"name": "hold-capped", "endpoints": [fake.url("hold")], "limits": {"max_output_tokens": 3000}},
        ]})
        assert r.status_code == 200, r.text
        cp.gw2 = f"http://127.0.0.1:{g2}"  # type: ignore[attr-defined]
        cp.admin2 = f"http://127.0.0.1:{a2}"  # type: ignore[attr-defined]
        cp.sims = sims  # type: ignore[attr-defined]
        cp.fake = fake  # type: ignore[attr-defined]
        cp.db = module_database_url  # type: ignore[attr-defined]
        cp.plain_key = create_key(cp, "plain")  # a key of no tenant: the gateways now want keys
        for gw in (cp.gateway, cp.gw2):  # (in a thread: the fake engine answers on this event loop)
            await asyncio.to_thread(
                wait_until, lambda: httpx.post(gw + "/v1/chat/completions", json=chat("echo"), timeout=10,
                                               headers=auth(cp.plain_key)).status_code == 200,
                timeout_s=20, what=f"{gw} routing echo with the plain key")
        yield cp
    finally:
        await asyncio.to_thread(cp.stop)
        for s in (*sims.values(), slow):
            stop_process(s.proc)
        await fake.close()


def chat(model: str, text: str = "hi", **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **kw}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def admin(cp: ControlPlane, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, cp.admin + path, json=body, timeout=10, headers=cp.admin_headers)


def create_tenant(cp: ControlPlane, name: str, **limits) -> dict:
    r = admin(cp, "POST", "/admin/v1/tenants", {"name": name, "limits": limits})
    assert r.status_code == 200, r.text
    return r.json()


def create_key(cp: ControlPlane, name: str, tenant: str | None = None, **limits) -> str:
    r = admin(cp, "POST", "/admin/v1/keys", {"name": name, "tenant": tenant, "limits": limits})
    assert r.status_code == 200, r.text
    return r.json()["key"]


def usage_rows(cp: ControlPlane, tenant: str) -> list[tuple]:
    with psycopg.connect(cp.db) as conn:  # type: ignore[attr-defined]
        return conn.execute("SELECT key_id, model, sum(requests), sum(prompt_tokens), sum(completion_tokens) "
                            "FROM usage WHERE tenant = %s GROUP BY key_id, model ORDER BY model", (tenant,)).fetchall()


def wait_key(cp: ControlPlane, key: str) -> None:
    """Until both gateways know the new key (they are told by NOTIFY); /v1/models counts nothing."""
    for gw in (cp.gateway, cp.gw2):  # type: ignore[attr-defined]
        wait_until(lambda: httpx.get(gw + "/v1/models", headers=auth(key), timeout=10).status_code == 200,
                   timeout_s=10, what="the key at " + gw)


async def test_two_gateways_share_one_tenants_rpm(plane):
    """Each gateway gets 5 requests a second for 10 s (100 in all) under one tenant's 40 per minute.
    Together they admit at most the limit plus one second's traffic (10), plus what a minute boundary
    inside the run lets the previous minute's share fade (40 · 10/60): never the 80 two gateways would
    admit counting alone, and no fewer than the limit."""
    cp = plane
    limit, rate, seconds = 40, 5.0, 10.0
    create_tenant(cp, "shared", rpm=limit)
    key = create_key(cp, "shared-1", "shared")
    wait_key(cp, key)
    statuses: dict[str, list[int]] = {cp.gateway: [], cp.gw2: []}
    refused: list[tuple[dict, dict]] = []
    admitted_headers: list[dict] = []

    async def drive(gw: str) -> None:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            for i in range(int(rate * seconds)):
                await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
                async with s.post(gw + "/v1/chat/completions", json=chat("echo"), headers=auth(key)) as r:
                    body = await r.json()
                    statuses[gw].append(r.status)
                    if r.status == 429:
                        refused.append((dict(r.headers), body))
                    elif r.status == 200:
                        admitted_headers.append(dict(r.headers))

    await asyncio.gather(drive(cp.gateway), drive(cp.gw2))
    admitted = sum(s.count(200) for s in statuses.values())
    assert all(s in (200, 429) for v in statuses.values() for s in v), statuses
    one_second = 2 * rate
    assert limit <= admitted <= limit + one_second + limit * seconds / 60 + 1, (admitted, statuses)
    assert all(v.count(200) and v.count(429) for v in statuses.values()), statuses  # both admitted, both refused
    headers, body = refused[0]
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "rate_limit_exceeded"
    assert "tenant `shared`" in body["error"]["message"] and int(headers["Retry-After"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == str(limit) and headers["x-ratelimit-remaining-requests"] == "0"
    assert all(h["x-ratelimit-limit-requests"] == str(limit) for h in admitted_headers)
    remaining = [int(h["x-ratelimit-remaining-requests"]) for h in admitted_headers]
    assert max(remaining) == limit - 1 and min(remaining) <= 5
    # Counted exactly once: the rows hold every admitted request, from both gateways, and no refused one.
    wait_until(lambda: sum(r[2] for r in usage_rows(cp, "shared")) == admitted, timeout_s=5,
               what="usage rows of every admitted request", why=lambda: usage_rows(cp, "shared"))
    # The refusals by tenant: on each gateway's admin API, behind its token; never on the public port.
    for gw, admin_url in ((cp.gateway, cp.admin), (cp.gw2, cp.admin2)):
        assert 'tenant="shared"' not in httpx.get(gw + "/metrics", timeout=10).text
        text = httpx.get(admin_url + "/metrics", timeout=10, headers=cp.admin_headers).text
        assert f'llmgw_rate_limited_total{{limit="rpm",tenant="shared"}} {float(statuses[gw].count(429))}' in text, text


async def test_a_streamed_answer_is_counted_once_and_its_usage_chunk_reaches_only_a_client_that_asked(plane):
    cp = plane
    sim = cp.sims["sim"]
    create_tenant(cp, "streams")
    key = create_key(cp, "streams-1", "streams")
    wait_key(cp, key)
    before = sim.counters()
    body = chat("sim", "one two three", max_tokens=7, stream=True)

    async def stream(gw: str, req: dict, key: str) -> tuple[dict, list[bytes]]:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw + "/v1/chat/completions", json=req, headers=auth(key)) as r:
                assert r.status == 200
                raw = await r.content.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        return dict(r.headers), [e for e in raw.split(b"\n\n") if e]

    headers, events = await stream(cp.gateway, body, key)  # did not ask: the gateway asks, and strips it
    assert len(events) == 8 and not any(b'"usage"' in e for e in events), events[-2:]
    assert "x-ratelimit-limit-requests" not in headers  # a tenant with no limits: counted, not limited
    headers, events = await stream(cp.gw2, {**body, "stream_options": {"include_usage": True}}, key)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert [c for c in chunks if c.get("usage")] == [chunks[-1]] and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    after = sim.counters()
    engine_prompt = after["sim:prompt_tokens_total"] - before["sim:prompt_tokens_total"]
    engine_generated = after["sim:generation_tokens_total"] - before["sim:generation_tokens_total"]
    assert (engine_prompt, engine_generated) == (6, 14)
    wait_until(lambda: [r[2:] for r in usage_rows(cp, "streams")] == [(2, engine_prompt, engine_generated)],
               timeout_s=5, what="the two streams counted once each", why=lambda: usage_rows(cp, "streams"))
    # Each gateway counted its own stream in its metrics: on its admin API's /metrics, which wants the admin
    # token even on loopback; the public port's /metrics names no tenant (issue 36).
    for gw, admin_url in ((cp.gateway, cp.admin), (cp.gw2, cp.admin2)):
        public = httpx.get(gw + "/metrics", timeout=10).text
        assert "streams" not in public and "tenant=" not in public and "llmgw_requests_total" in public, gw
        refused = httpx.get(admin_url + "/metrics", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_token"
        assert httpx.get(admin_url + "/metrics", timeout=10, headers={"authorization": "Bearer wrong"}).status_code == 401
        text = httpx.get(admin_url + "/metrics", timeout=10, headers=cp.admin_headers).text
        assert 'llmgw_tokens_total{model="sim",tenant="streams",type="completion"} 7.0' in text, gw
        assert 'llmgw_tokens_total{model="sim",tenant="streams",type="prompt"} 3.0' in text, gw

    # The engine is asked only for accounted keys: a key of no tenant streams the client's body untouched.
    fake = cp.fake
    fake.state["bodies"].clear()
    for k in (cp.plain_key, key):
        await stream(cp.gateway, chat("echo", "a b", stream=True), k)
    (_, plain_body), (_, accounted_body) = fake.state["bodies"]
    assert "stream_options" not in plain_body
    assert accounted_body["stream_options"] == {"include_usage": True}


async def test_a_spent_budget_gets_insufficient_quota_until_the_period_turns(plane):
    """A day is DAY_S seconds here (LLMGW_TEST_BUDGET_DAY_S), from the database clock. 30 tokens a day:
    an answer of 17, then one cut to the 13 left (its max_tokens 16 is sent as 12: issue 37) spend it; then
    429 insufficient_quota on both gateways until the day turns, then 200 again."""
    cp = plane

    def db_now() -> float:
        with psycopg.connect(cp.db) as conn:
            return float(conn.execute("SELECT extract(epoch FROM now())").fetchone()[0])

    create_tenant(cp, "budget", tokens_per_day=30)
    key = create_key(cp, "budget-1", "budget")
    monthly = create_key(cp, "monthly", tokens_per_month=10)  # a key of no tenant, with a budget of its own
    wait_key(cp, key)
    wait_key(cp, monthly)
    left = DAY_S - db_now() % DAY_S
    if left < 7:  # spend and check within one day
        await asyncio.sleep(left + 0.2)
    async with aiohttp.ClientSession() as s:
        async def ask(gw: str, key: str = key) -> tuple[int, dict, dict]:
            async with s.post(gw + "/v1/chat/completions", json=chat("sim", max_tokens=16), headers=auth(key)) as r:
                return r.status, dict(r.headers), await r.json()

        assert (await ask(cp.gateway))[0] == 200  # 17 of 30
        assert (await ask(cp.gateway))[0] == 200  # 30: cut to what was left (it had taken 34 before)
        status, headers, body = await ask(cp.gateway)
        turn = (db_now() // DAY_S + 1) * DAY_S
        assert status == 429, body
        assert body["error"]["code"] == "insufficient_quota" and body["error"]["type"] == "insufficient_quota"
        assert "30 of 30" in body["error"]["message"] and headers["x-should-retry"] == "false"
        assert 1 <= int(headers["Retry-After"]) <= DAY_S
        # Its next sync (<= 1 s) writes the spend and the other gateway's next sync (<= 1 s more) reads it:
        # the other gateway knows too, two syncs later (a margin of 1 s for the syncs' own time).
        told = time.monotonic() + 3.0
        while (answer := await ask(cp.gw2))[0] == 200:
            assert time.monotonic() < told, "the other gateway still admits 3 s after the budget was spent"
            await asyncio.sleep(0.2)
        status, _, body = answer
        assert status == 429 and body["error"]["code"] == "insufficient_quota", body
        assert db_now() < turn, "the day turned before the other gateway was asked: the test was too slow"
        while db_now() < turn - 0.5:
            assert (await ask(cp.gateway))[0] == 429
            await asyncio.sleep(0.5)
        while (await ask(cp.gateway))[0] != 200:
            assert db_now() < turn + 3, "the budget did not renew when the day turned"
            await asyncio.sleep(0.2)
        assert db_now() >= turn - 0.2  # renewed by the turn, not before
        # A month's budget on a key of no tenant: spent until the calendar month turns.
        assert (await ask(cp.gateway, monthly))[0] == 200
        status, headers, body = await ask(cp.gateway, monthly)
        err = body["error"]
        assert status == 429 and err["code"] == "insufficient_quota" and "for the month" in err["message"]
        now = db_now()
        d = datetime.fromtimestamp(now, timezone.utc)
        month_end = datetime(d.year + (d.month == 12), d.month % 12 + 1, 1, tzinfo=timezone.utc).timestamp()
        assert abs(int(headers["Retry-After"]) - (month_end - now)) <= 3


async def test_leaving_a_stream_before_its_usage_chunk_is_no_way_around_a_budget(plane):
    """Tokens come from the answer's usage, which a stream sends last: a client that closes the stream
    before it would be charged nothing, and could stream without end under a budget. Such an answer is
    charged what was relayed (an event a token, a token for each 4 characters of prompt). (Its max_tokens of
    200 is cut to the 99 its budget leaves: since issue 37 no stream can pass a budget by generating on.)"""
    cp = plane
    create_tenant(cp, "early", tokens_per_month=100)
    key = create_key(cp, "early-1", "early")
    wait_key(cp, key)
    async with aiohttp.ClientSession() as s:
        async with s.post(cp.gateway + "/v1/chat/completions", headers=auth(key),
                          json=chat("slow", max_tokens=200, stream=True)) as r:
            assert r.status == 200
            events = 0
            async for line in r.content:
                events += line.startswith(b"data:")
                if events == 12:
                    break  # and close the connection: the engine is still at token 12 of 200
        await asyncio.sleep(0.5)  # the gateway sees the client gone and settles
    rows = await asyncio.to_thread(wait_until, lambda: [r for r in usage_rows(cp, "early") if r[1] == "slow" and r[4]],
                                   timeout_s=5, what="the early stream's usage row")
    [(_, _, requests, prompt, completion)] = rows
    assert requests == 1 and prompt >= 1 and 12 <= completion < 99, rows


async def test_ctl_usage_matches_the_engines_own_counts(plane):
    cp = plane
    sims = cp.sims
    assert cp.ctl("tenants", "create", "acct", "--rpm", "10k", "--tpm", "1M").returncode == 0
    keys = []
    for name in ("acct-1", "acct-2"):
        out = cp.ctl("keys", "create", "--name", name, "--tenant", "acct")
        assert out.returncode == 0, out.stderr
        keys.append(out.stdout.strip())
    for k in keys:
        wait_key(cp, k)
    before = {m: s.counters() for m, s in sims.items()}
    async with aiohttp.ClientSession() as s:
        async def go(gw: str, path: str, body: dict, key: str) -> None:
            async with s.post(gw + path, json=body, headers=auth(key)) as r:
                assert r.status == 200, await r.text()
                await r.read()

        for i, (gw, key) in enumerate([(cp.gateway, keys[0]), (cp.gw2, keys[1]), (cp.gw2, keys[0])]):
            await go(gw, "/v1/chat/completions", chat("sim", "a b c " * (i + 1), max_tokens=5 + i), key)
            await go(gw, "/v1/chat/completions", chat("sim-alias", "d e", max_tokens=9, stream=True), key)
            await go(gw, "/v1/chat/completions", chat("sim-b", "f", max_tokens=3, stream=True,
                                                      stream_options={"include_usage": True}), key)
            await go(gw, "/v1/completions", {"model": "sim-b", "prompt": "g h i j", "max_tokens": 4 + i}, key)
            await go(gw, "/v1/embeddings", {"model": "sim-b", "input": ["x", "y"]}, key)
    after = {m: s.counters() for m, s in sims.items()}
    engine = {m: (after[m]["sim:requests_total"] - before[m]["sim:requests_total"],
                  after[m]["sim:prompt_tokens_total"] - before[m]["sim:prompt_tokens_total"],
                  after[m]["sim:generation_tokens_total"] - before[m]["sim:generation_tokens_total"]) for m in sims}

    def by_model():
        out = cp.ctl("usage", "--tenant", "acct", "--by", "model", "-o", "json")
        assert out.returncode == 0, out.stderr
        return {r["model"]: (r["requests"], r["prompt_tokens"], r["completion_tokens"])
                for r in json.loads(out.stdout)["rows"]}
    wait_until(lambda: by_model() == engine, timeout_s=5, what="ctl usage by model = the engines' counters",
               why=lambda: f"ctl: {by_model()}, engines: {engine}")
    out = cp.ctl("usage", "--tenant", "acct", "--by", "key", "-o", "json")
    rows = json.loads(out.stdout)["rows"]
    assert {r["key_name"] for r in rows} == {"acct-1", "acct-2"}
    assert sum(r["total_tokens"] for r in rows) == sum(p + c for _, p, c in engine.values())
    assert [r["requests"] for r in sorted(rows, key=lambda r: r["key_name"])] == [10, 5]
    out = cp.ctl("usage", "--tenant", "acct", "--by", "day")
    header = out.stdout.splitlines()[0].split()
    assert out.returncode == 0 and header[:2] == ["TENANT", "DAY"] and "LAST" in header
    total = sum(p + c for _, p, c in engine.values())
    assert str(total) in out.stdout.splitlines()[1]
    out = cp.ctl("usage", "--since", "5x")
    assert out.returncode == 1 and "since" in out.stderr and "Traceback" not in out.stderr
    out = cp.ctl("usage", "--tenant", "acc")  # no such tenant: said, not "no use"
    assert out.returncode == 1 and "no tenant named 'acc'; did you mean 'acct'?" in out.stderr, out.stderr
    out = cp.ctl("tenants", "list")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("acct "))
    assert out.stdout.splitlines()[0].split()[0] == "NAME"
    assert line.split()[1:3] == ["10k", "1M"], line  # as they were written (--rpm 10k --tpm 1M), not 10000 1000000
    out = cp.ctl("keys", "list", "-o", "wide")  # a tenant's key without limits of its own is not "unlimited"
    assert "OWN LIMITS" in out.stdout.splitlines()[0], out.stdout
    line = next(ln for ln in out.stdout.splitlines() if " acct-1 " in ln)
    assert "none: tenant acct's limits apply" in line and "unlimited" not in line, out.stdout
    assert cp.ctl("tenants", "set", "acct", "--rpm", "none").returncode == 0
    acct = next(t for t in admin(cp, "GET", "/admin/v1/tenants").json() if t["name"] == "acct")
    assert acct["limits"]["rpm"] is None and acct["limits"]["tpm"] == 1_000_000 and acct["keys"] == 2


async def test_a_key_may_use_only_the_models_its_tenant_allows(plane):
    cp = plane
    create_tenant(cp, "narrow", models=["sim-al*"])  # a pattern over an alias of `sim`
    key = create_key(cp, "narrow-1", "narrow")
    wait_key(cp, key)
    for model in ("sim", "sim-alias"):
        r = httpx.post(cp.gateway + "/v1/chat/completions", json=chat(model, max_tokens=1), headers=auth(key), timeout=10)
        assert r.status_code == 200, r.text
    r = httpx.post(cp.gateway + "/v1/chat/completions", json=chat("sim-b"), headers=auth(key), timeout=10)
    err = r.json()["error"]
    assert r.status_code == 403 and err["code"] == "model_not_allowed" and err["param"] == "model"
    assert "tenant `narrow`" in err["message"] and "sim-al*" in err["message"]
    r = httpx.post(cp.gateway + "/v1/chat/completions", json=chat("nope"), headers=auth(key), timeout=10)
    assert r.status_code == 404  # an unknown model is still unknown
    # A misspelt name gets the model meant, but only one the key may use: never a model it may not.
    r = httpx.post(cp.gateway + "/v1/chat/completions", json=chat("sim-alais"), headers=auth(key), timeout=10)
    assert r.status_code == 404 and "Did you mean `sim-alias`?" in r.json()["error"]["message"], r.text
    r = httpx.post(cp.gateway + "/v1/chat/completions", json=chat("sim-bb"), headers=auth(key), timeout=10)
    assert r.status_code == 404 and "Did you mean" not in r.json()["error"]["message"], r.text  # sim-b: not its
    r = httpx.post(cp.gateway + "/v1/chat/completions", json=chat("sim-bb"), headers=auth(cp.plain_key), timeout=10)
    assert "Did you mean `sim-b`?" in r.json()["error"]["message"], r.text
    listed = httpx.get(cp.gateway + "/v1/models", headers=auth(key), timeout=10).json()["data"]
    assert [m["id"] for m in listed] == ["sim"]
    assert httpx.get(cp.gateway + "/v1/models/sim-b", headers=auth(key), timeout=10).status_code == 403
    every = httpx.get(cp.gateway + "/v1/models", headers=auth(cp.plain_key), timeout=10).json()["data"]
    assert {m["id"] for m in every} == {"sim", "sim-b", "echo", "slow", "echo-capped", "hold-capped"}



async def test_a_fallback_serves_only_a_key_that_may_use_the_fallback_model(plane):
    """A model whose engine is down falls back to another: for a key whose tenant allows only the asked
    model, the fallback must not answer (it had served `sim-b` to a key refused `sim-b`); a key of no
    tenant is served by the fallback."""
    cp = plane
    dead = f"http://127.0.0.1:{free_port()}"
    models = [m for m in httpx.get(cp.admin + "/admin/v1/catalog", timeout=10, headers=cp.admin_headers).json()["models"]
              if m["name"] != "down"]
    models.append({"name": "down", "endpoints": [dead], "fallbacks": ["sim-b"]})
    assert cp.apply({"models": models}).status_code == 200
    create_tenant(cp, "no-fallback", models=["down"])
    key = create_key(cp, "no-fallback-1", "no-fallback")
    wait_key(cp, key)
    async with httpx.AsyncClient(timeout=10) as c:
        deadline = time.monotonic() + 10
        while (r := await c.post(cp.gateway + "/v1/chat/completions", headers=auth(cp.plain_key),
                                 json=chat("down", max_tokens=1))).status_code == 404 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # until the route table has the new catalog
        assert r.status_code == 200 and r.json()["model"] == "sim-b", r.text  # the fallback works
        before = cp.sims["sim-b"].counters()  # type: ignore[attr-defined]
        r = await c.post(cp.gateway + "/v1/chat/completions", headers=auth(key), json=chat("down", max_tokens=1))
        assert r.status_code in (502, 503), r.text  # the engine is down (or its breaker open), and no fallback
        assert cp.sims["sim-b"].counters() == before  # type: ignore[attr-defined]  # sim-b never saw it
        r = await c.post(cp.gateway + "/v1/chat/completions", headers=auth(key), json=chat("sim-b", max_tokens=1))
        assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"

BAD_LIMITS = [({"rpm": -1}, "limits.rpm"), ({"rpm": 0}, "limits.rpm"), ({"rpm": 1.5}, "limits.rpm"),
              ({"rpm": "60"}, "limits.rpm"), ({"rpm": True}, "limits.rpm"), ({"rpm": 10**12}, "limits.rpm"),
              ({"tpm": 10**15}, "limits.tpm"), ({"tokens_per_day": -1}, "limits.tokens_per_day"),
              ({"tokens_per_month": 10**18}, "limits.tokens_per_month"), ({"models": []}, "limits.models"),
              ({"models": ["llama["]}, "limits.models"), ({"models": ["a b"]}, "limits.models"),
              ({"models": ["x"] * 65}, "limits.models"), ({"models": "sim"}, "limits.models"),
              ({"models": ["\u202esim"]}, "limits.models"), ({"burst": 5}, "limits.burst"),
              # fair queues (issue 37): a weight from 0.01 to 100, a band by name
              ({"weight": 0}, "limits.weight"), ({"weight": -1}, "limits.weight"), ({"weight": 1e300}, "limits.weight"),
              ({"weight": "2"}, "limits.weight"), ({"weight": True}, "limits.weight"), ({"band": "bulk"}, "limits.band"),
              ({"band": 1}, "limits.band")]


def test_abusive_input_on_the_tenant_surfaces_gets_400_naming_the_field(plane):
    cp = plane

    def refused(r: httpx.Response, status: int, param: str | None) -> dict:
        assert r.status_code == status, (r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and "Traceback" not in r.text
        if param is not None:
            assert err["param"] == param, err
        return err

    for name in ("Team-A", "ｔｅａｍ", " team", "team\n", "", "-x", "a" * 64, "a/b", "tеam", "x" * 5000, 7, None):
        err = refused(admin(cp, "POST", "/admin/v1/tenants", {"name": name}), 400, "name")
        if name == "Team-A":
            assert "write 'team-a'" in err["message"] and "Value error" not in err["message"], err
    for limits, field in BAD_LIMITS:
        refused(admin(cp, "POST", "/admin/v1/tenants", {"name": "abuse", "limits": limits}), 400, field)
    r = httpx.post(cp.admin + "/admin/v1/tenants", content=b'{"name": "abuse", "limits": {"rpm": 1' + b"0" * 30 + b"}}",
                   headers={"content-type": "application/json", **cp.admin_headers}, timeout=10)
    refused(r, 400, None)  # beyond int64: refused before it is parsed
    for raw in (b"NaN", b"Infinity", b"1e999"):  # a weight JSON cannot carry
        r = httpx.post(cp.admin + "/admin/v1/tenants", content=b'{"name": "abuse", "limits": {"weight": ' + raw + b"}}",
                       headers={"content-type": "application/json", **cp.admin_headers}, timeout=10)
        refused(r, 400, None)
    assert admin(cp, "GET", "/admin/v1/tenants").status_code == 200
    assert "abuse" not in [t["name"] for t in admin(cp, "GET", "/admin/v1/tenants").json()]
    create_tenant(cp, "abuse")
    refused(admin(cp, "POST", "/admin/v1/tenants", {"name": "abuse"}), 409, "name")
    for limits, field in BAD_LIMITS:
        refused(admin(cp, "POST", "/admin/v1/tenants/abuse", {"limits": limits}), 400, field)
    refused(admin(cp, "POST", "/admin/v1/tenants/Abuse", {"limits": {"rpm": 5}}), 400, "name")
    refused(admin(cp, "POST", "/admin/v1/tenants/nobody", {"limits": {"rpm": 5}}), 404, "name")
    refused(admin(cp, "POST", "/admin/v1/tenants/abuse", {"rpm": 5}), 400, None)  # limits are under `limits`
    # keys: a name is free text, but plain: no terminal escapes, line breaks, bidi overrides or zero-width
    # characters (`ctl keys list` prints it), no spaces around it, NFC, at most 200 characters
    for name, says in (("\x1b[2J\x1b[31mroot", "U+001B"), ("alice\nbob", "U+000A"), ("\u202eecila", "U+202E"),
                       ("al\u200bice", "U+200B"), (" alice ", "write 'alice'"), ("Cafe\u0301", "write 'Café'"),
                       ("x" * 201, "200"), (7, None)):
        err = refused(admin(cp, "POST", "/admin/v1/keys", {"name": name}), 400, "name")
        assert says is None or says in err["message"], err
    assert admin(cp, "POST", "/admin/v1/keys", {"name": "Café team (Zoë), on-call"}).status_code == 200
    refused(admin(cp, "POST", "/admin/v1/keys", {"name": "k", "tenant": "Abuse"}), 400, "tenant")
    err = refused(admin(cp, "POST", "/admin/v1/keys", {"name": "k", "tenant": "nobody"}), 400, "tenant")
    assert err["code"] == "tenant_not_found"
    for limits, field in BAD_LIMITS:
        refused(admin(cp, "POST", "/admin/v1/keys", {"name": "k", "limits": limits}), 400, field)
    key_id = admin(cp, "POST", "/admin/v1/keys", {"name": "k", "tenant": "abuse"}).json()["id"]
    for limits, field in BAD_LIMITS[:4]:
        refused(admin(cp, "POST", f"/admin/v1/keys/{key_id}", {"limits": limits}), 400, field)
    refused(admin(cp, "POST", "/admin/v1/keys/no-such-key", {"limits": {"rpm": 5}}), 404, "id")
    # usage
    for query, param in (("since=5x", "since"), ("since=401d", "since"), ("since=", "since"), ("by=minute", "by"),
                         ("tenant=Abuse", "tenant"), ("since=" + "9" * 100, None)):
        refused(admin(cp, "GET", "/admin/v1/usage?" + query), 400, param)
    # and as an operator sees it: one line, exit status 1, no traceback
    for args in (("tenants", "create", "Team A"), ("tenants", "create", "abuse2", "--rpm", "1000000000000"),
                 ("tenants", "create", "abuse3", "--models", "a,,b"), ("keys", "create", "--tenant", "nobody")):
        out = cp.ctl(*args)
        assert out.returncode == 1 and out.stderr.startswith("error (400)") and "Traceback" not in out.stderr, out
    # a limit under 1 is refused by ctl itself, in the option's words (tests/test_ctl.py), before anything is sent
    out = cp.ctl("tenants", "create", "abuse2", "--rpm", "-5")
    assert out.returncode == 1 and out.stderr.startswith("--rpm -5: a limit is at least 1") and "Traceback" not in out.stderr, out
    r = admin(cp, "POST", "/admin/v1/tenants/abuse", {"limits": {"rpm": 7, "models": ["nothing-*"]}})
    assert r.status_code == 200 and r.json()["limits"] == {"rpm": 7, "models": ["nothing-*"], "tpm": None,
                                                           "tokens_per_day": None, "tokens_per_month": None,
                                                           "weight": None, "band": None}
    assert r.json()["notes"] == ["models: 'nothing-*' matches no model of the catalog now"]


def test_ctl_tenants_delete_refuses_while_keys_are_active_then_revokes_them_with_it(plane):
    """`ctl tenants delete`: refused (naming the keys, nothing changed) while the tenant has active keys;
    with `--revoke-keys` its keys are revoked in the same transaction and both gateways refuse them; its
    usage stays in `ctl usage`; a key can no longer be made for it, and the name can be used again."""
    cp = plane
    assert cp.ctl("tenants", "create", "gone", "--rpm", "1k").returncode == 0
    key = create_key(cp, "gone-1", "gone")
    wait_key(cp, key)
    r = httpx.post(cp.gateway + "/v1/chat/completions", json=chat("sim", max_tokens=1), headers=auth(key), timeout=10)
    assert r.status_code == 200, r.text
    key_id = next(k["id"] for k in admin(cp, "GET", "/admin/v1/keys").json() if k["name"] == "gone-1")

    for yes in (["--yes"], []):  # refused without asking first "delete?" (it would be refused anyway)
        out = cp.ctl("tenants", "delete", "gone", *yes)
        assert out.returncode == 1 and out.stderr.count("\n") == 1 and "delete?" not in out.stdout, out
        assert f"has 1 active key(s): {key_id} (gone-1)" in out.stderr and "--revoke-keys" in out.stderr, out.stderr
    assert httpx.post(cp.gateway + "/v1/chat/completions", json=chat("sim", max_tokens=1), headers=auth(key),
                      timeout=10).status_code == 200  # nothing was changed
    assert "gone" in {t["name"] for t in admin(cp, "GET", "/admin/v1/tenants").json()}
    out = cp.ctl("tenants", "delete", "gnoe", "--yes")
    assert out.returncode == 1 and "no tenant named 'gnoe'; did you mean 'gone'?" in out.stderr, out.stderr

    out = cp.ctl("tenants", "delete", "gone", "--revoke-keys", "--yes")
    assert out.returncode == 0 and out.stdout.strip().endswith(f"deleted tenant gone; revoked {key_id}"), out
    for gw in (cp.gateway, cp.gw2):  # type: ignore[attr-defined]
        wait_until(lambda: httpx.post(gw + "/v1/chat/completions", json=chat("sim", max_tokens=1), headers=auth(key),
                                      timeout=10).status_code == 401, timeout_s=10, what=f"the key refused at {gw}")
    assert "gone" not in {t["name"] for t in admin(cp, "GET", "/admin/v1/tenants").json()}
    [k] = [k for k in admin(cp, "GET", "/admin/v1/keys").json() if k["id"] == key_id]
    assert k["revoked_at"] and k["tenant"] is None
    wait_until(lambda: usage_rows(cp, "gone"), timeout_s=5, what="gone's usage row")  # written within a second
    report = admin(cp, "GET", "/admin/v1/usage?tenant=gone&since=1h").json()
    assert report["rows"][0]["requests"] == 2, report  # its use (both answers) is history, kept

    r = admin(cp, "POST", "/admin/v1/keys", {"name": "late", "tenant": "gone"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "tenant_not_found", r.text
    assert cp.ctl("tenants", "create", "gone").returncode == 0  # the name is free again
    assert admin(cp, "DELETE", "/admin/v1/tenants/gone", {}).status_code == 200  # no keys: no flag needed
    for bad in ("Gone", "x" * 300, "..", "%2e%2e"):
        r = admin(cp, "DELETE", f"/admin/v1/tenants/{bad}", {})
        assert r.status_code in (400, 404) and "error" in r.json(), (bad, r.status_code, r.text)


async def test_a_burst_admitted_at_once_cannot_pass_a_budget_by_more_than_a_request(plane):
    """20 requests at once under a budget of 100 tokens, each able to use 41 (a prompt of 1 token, max_tokens
    40): tokens are known only as answers end, so before, all 20 were admitted and used 820. Now each holds
    what it may use until it ends: 3 are admitted (41, 82, 123: the last passes the figure, never further),
    the rest get 429 rate_limit_exceeded with Retry-After 1 (not insufficient_quota: the budget is not
    spent yet), and once they are counted the budget is spent."""
    cp = plane
    create_tenant(cp, "burst", tokens_per_month=100)
    key = create_key(cp, "burst-1", "burst")
    wait_key(cp, key)
    async with aiohttp.ClientSession() as s:
        async def ask() -> tuple[int, dict, dict]:
            async with s.post(cp.gateway + "/v1/chat/completions", headers=auth(key),
                              json=chat("slow", text="hi", max_tokens=40)) as r:
                return r.status, dict(r.headers), await r.json()
        answers = await asyncio.gather(*[ask() for _ in range(20)])
        ok = [a for a in answers if a[0] == 200]
        refused = [a for a in answers if a[0] != 200]
        assert len(ok) == 3, [a[0] for a in answers]
        for status, headers, body in refused:
            assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
            assert "held by requests in flight" in body["error"]["message"] and headers["Retry-After"] == "1", body
        status, _, body = await ask()
        assert status == 429 and body["error"]["code"] == "insufficient_quota", body
    rows = await asyncio.to_thread(wait_until, lambda: usage_rows(cp, "burst"), timeout_s=5, what="burst's usage")
    [(_, _, requests, prompt, completion)] = rows
    assert requests == 3 and prompt + completion <= 3 * 41, rows


async def test_a_client_that_leaves_before_the_answer_is_charged_the_prompt_the_engine_read(plane):
    """The engine reads a long prompt, the client gives up before the answer: the engine's work (its
    prefill) was free before, limited only by the rpm. Now the prompt is charged, a token for each 4
    characters, once the request has reached an engine; one that never did (a 400 from the engine) is not."""
    cp = plane
    create_tenant(cp, "leaver", tokens_per_month=10**9)
    key = create_key(cp, "leaver-1", "leaver")
    wait_key(cp, key)
    async with httpx.AsyncClient(timeout=1.0) as c:
        with pytest.raises(httpx.TimeoutException):  # `slow` takes 3 s for 60 tokens
            await c.post(cp.gateway + "/v1/chat/completions", headers=auth(key),
                         json=chat("slow", text="x" * 8000, max_tokens=60))
    rows = await asyncio.to_thread(wait_until, lambda: [r for r in usage_rows(cp, "leaver") if r[3]], timeout_s=8,
                                   what="the left request's usage row")
    [(_, model, requests, prompt, completion)] = rows
    assert model == "slow" and requests == 1 and prompt >= 2000 and completion == 0, rows


async def test_a_stream_whose_engine_reports_no_usage_is_charged_the_events_it_relayed(plane):
    """The fake engine streams 3 events and no usage chunk, all of it in one read: the events were counted
    only inside the relay's loop, which a stream read whole never enters, so it was charged nothing."""
    cp = plane
    create_tenant(cp, "nousage", tokens_per_month=10**9)
    key = create_key(cp, "nousage-1", "nousage")
    wait_key(cp, key)
    async with httpx.AsyncClient(timeout=10) as c:  # (the fake engine answers on this event loop)
        r = await c.post(cp.gateway + "/v1/chat/completions", headers=auth(key),
                         json=chat("echo", text="one two", stream=True))
    assert r.status_code == 200 and r.text.count("data:") == 4, r.text  # 3 events and [DONE]
    rows = await asyncio.to_thread(wait_until, lambda: usage_rows(cp, "nousage"), timeout_s=5, what="its usage row")
    [(_, _, requests, prompt, completion)] = rows
    assert requests == 1 and prompt >= 1 and completion == 3, rows


async def test_an_error_answer_to_an_accounted_request_carries_its_rate_limit_headers(plane):
    """A request admitted and counted, whose engine then refused it (400) or could not be reached (502),
    is answered with the `x-ratelimit-*` headers as every other answer of a key with limits is."""
    cp = plane
    dead = f"http://127.0.0.1:{free_port()}"
    models = [m for m in httpx.get(cp.admin + "/admin/v1/catalog", timeout=10, headers=cp.admin_headers).json()["models"]
              if m["name"] not in ("refuse", "dead")]
    models += [{"name": "refuse", "endpoints": [cp.fake.url("refuse400")]},  # type: ignore[attr-defined]
               {"name": "dead", "endpoints": [dead]}]
    assert cp.apply({"models": models}).status_code == 200
    create_tenant(cp, "headers", rpm=1000, tpm=10**6)
    key = create_key(cp, "headers-1", "headers")
    wait_key(cp, key)
    async with httpx.AsyncClient(timeout=10) as c:  # (the fake engine answers on this event loop)
        for model, status in (("echo", 200), ("refuse", 400), ("dead", 502)):
            deadline = time.monotonic() + 10
            while (r := await c.post(cp.gateway + "/v1/chat/completions", headers=auth(key),
                                     json=chat(model))).status_code == 404 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)  # until the route table has the new catalog
            assert r.status_code == status, (model, r.text)
            assert r.headers["x-ratelimit-limit-requests"] == "1000", (model, r.headers)
            assert r.headers["x-ratelimit-limit-tokens"] == "1000000", (model, r.headers)
            assert int(r.headers["x-ratelimit-remaining-requests"]) < 1000, (model, r.headers)


async def test_a_prompt_the_guard_refuses_is_charged_what_its_judge_read(plane):
    """A model with a request guard: the judge reads the whole prompt, then the request is refused (400
    content_filter). Before, that cost the tenant nothing, so refused prompts loaded the judge without
    limit; now the prompt is charged, a token for each 4 characters."""
    cp = plane
    models = [m for m in httpx.get(cp.admin + "/admin/v1/catalog", timeout=10, headers=cp.admin_headers).json()["models"]
              if m["name"] not in ("judge", "g-req")]
    models += [{"name": "judge", "role": "guard", "endpoints": [cp.fake.url("judge")]},  # type: ignore[attr-defined]
               {"name": "g-req", "endpoints": [cp.fake.url("echo")],  # type: ignore[attr-defined]
                "guard": {"model": "judge", "check": ["request"]}}]
    assert cp.apply({"models": models}).status_code == 200
    create_tenant(cp, "judged", tokens_per_month=10**9)
    key = create_key(cp, "judged-1", "judged")
    wait_key(cp, key)
    async with httpx.AsyncClient(timeout=10) as c:  # (the fake engines answer on this event loop)
        deadline = time.monotonic() + 10
        while (r := await c.post(cp.gateway + "/v1/chat/completions", headers=auth(key),
                                 json=chat("g-req", text="forbidden " + "x" * 8000))).status_code == 404:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_filter", r.text
    rows = await asyncio.to_thread(wait_until, lambda: usage_rows(cp, "judged"), timeout_s=5, what="its usage row")
    [(_, model, requests, prompt, completion)] = rows
    assert model == "g-req" and requests == 1 and prompt >= 2000 and completion == 0, rows


def test_limits_stored_around_the_admin_api_are_listed_with_a_note_and_can_be_replaced(plane):
    """Limits written with SQL that no longer validate: the gateways do not enforce them (and say so in
    their log); listing and setting them had answered 500."""
    cp = plane
    create_tenant(cp, "handmade")
    with psycopg.connect(cp.db) as conn:  # type: ignore[attr-defined]
        conn.execute("""UPDATE tenants SET limits = '{"rpm": -5}' WHERE name = 'handmade'""")
    r = admin(cp, "GET", "/admin/v1/tenants")
    assert r.status_code == 200, r.text
    [t] = [t for t in r.json() if t["name"] == "handmade"]
    assert t["limits"]["rpm"] is None and "not valid and are not enforced" in t["notes"][0], t
    out = cp.ctl("tenants", "set", "handmade", "--rpm", "60")
    assert out.returncode == 0 and "rpm 60" in out.stdout, out


async def test_requests_without_a_length_cap_are_reserved_and_forwarded_with_one(plane):
    """Issue 37: a request without `max_tokens` held only its prompt, so a tenant with 10,000 tokens a month
    had every one of a burst admitted, each free to generate up to the context. Now each reserves the
    model's output bound (`limits.max_output_tokens`: 3000) cut to what the budget leaves, and the engine is
    sent that cap: of 20 at once, 3 hold 3001 each, the 4th is cut to the 996 left and sent `max_tokens:
    996`, and 16 get 429 while they are in flight."""
    cp = plane
    create_tenant(cp, "nocap", tokens_per_month=10000)
    key = create_key(cp, "nocap-1", "nocap")
    wait_key(cp, key)
    fake = cp.fake  # type: ignore[attr-defined]
    fake.state["release"] = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as s:
            async def ask() -> tuple[int, dict]:
                async with s.post(cp.gateway + "/v1/chat/completions", headers=auth(key),
                                  json=chat("hold-capped", text="hi")) as r:
                    return r.status, await r.json()
            asks = [asyncio.ensure_future(ask()) for _ in range(20)]
            await asyncio.sleep(0)
            refused = []
            for done in asyncio.as_completed(asks):  # the refused come back while the admitted are held
                refused.append(await done)
                if len(refused) == 16:
                    break
            fake.state["release"].set()
            answers = [a.result() if a.done() else await a for a in asks]
    finally:
        fake.state["release"] = asyncio.Event()
    ok = [body for status, body in answers if status == 200]
    no = [body for status, body in answers if status != 200]
    assert len(ok) == 4 and len(no) == 16, [status for status, _ in answers]
    assert sorted(b["received"]["max_tokens"] for b in ok) == [996, 3000, 3000, 3000]
    for body in no:
        assert body["error"]["code"] == "rate_limit_exceeded" and "held by requests in flight" in body["error"]["message"]


async def test_n_multiplies_the_reservation_and_every_length_field_is_clamped_to_it(plane):
    """What the engine receives, through the real gateway: a request without a cap is sent the model's
    `max_output_tokens`, or, for a model without one, what the tenant's budget leaves each of its `n`
    choices; llama.cpp's `n_predict`, which llama-server prefers to `max_tokens`, is clamped to the
    reserved cap (`{"max_tokens": 1, "n_predict": 100000}` had reserved 1 token); a request whose own cap
    fits is sent as it came; an unaccounted key's request is never rewritten."""
    cp = plane
    create_tenant(cp, "capped", tokens_per_month=1000)
    key = create_key(cp, "capped-1", "capped")
    wait_key(cp, key)
    async with httpx.AsyncClient(timeout=10) as c:  # (the fake engine answers on this event loop)
        async def sent(model: str, who: str = key, **kw) -> dict:
            r = await c.post(cp.gateway + "/v1/chat/completions", headers=auth(who), json=chat(model, **kw))
            assert r.status_code == 200, r.text
            return r.json()["received"]

        got = await sent("echo-capped", n=4)
        assert got["max_tokens"] == 64 and got["n"] == 4, got
        got = await sent("echo", n=4)  # no output bound the engine would stop at: the budget's share, 999 // 4
        assert got["max_tokens"] <= 249 and got["n"] == 4, got
        got = await sent("echo", max_tokens=1, n_predict=100000)
        assert got["n_predict"] == 1 and got["max_tokens"] == 1, got
        got = await sent("echo", max_new_tokens=10**6, n_predict=-1)  # SGLang's field; llama.cpp's "no limit"
        assert 0 < got["max_new_tokens"] <= 1000 and got["n_predict"] == got["max_tokens"] == got["max_new_tokens"], got
        got = await sent("echo", n_predict=3)  # one engine's field: the others are told too (vLLM ignores it)
        assert got["n_predict"] == got["max_tokens"] == 3, got
        got = await sent("echo", max_tokens=5)
        salt = got.pop("cache_salt")  # its tenant's prefix-cache salt (gateway/isolation.py): the one change
        assert got == chat("echo", max_tokens=5) and salt.startswith("llmgw-"), got  # its own cap fits
        got = await sent("echo-capped", who=cp.plain_key, n=4)  # type: ignore[attr-defined]
        assert "max_tokens" not in got, got  # unaccounted: nothing reserved, nothing rewritten


@pytest.mark.parametrize("field, value", [("n", 129), ("n", 10**12), ("n", -1), ("n", 0), ("n", 1.5), ("n", "4"),
                                          ("best_of", 1000), ("best_of", True), ("n_predict", -2),
                                          ("n_predict", 2**31), ("max_new_tokens", -1), ("max_new_tokens", 2.0)])
def test_abusive_choice_and_length_counts_get_400_naming_the_field(plane, field, value):
    cp = plane
    r = httpx.post(cp.gateway + "/v1/chat/completions", headers=auth(cp.plain_key),  # type: ignore[attr-defined]
                   json=chat("echo", **{field: value}), timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"`{field}` must be an integer" in err["message"], err
