"""Budgets hold across gateways (issue 37), through two real `llmgw server`s on one Postgres and a real sim
engine whose own counters are what the usage is checked against.

Before, each gateway judged the fleet's used tokens (as of its last sync) plus only what its *own* requests
in flight held: a tenant's streams spread over two gateways were admitted on each, every one free to use
what was left, and a budget was passed by a whole budget for as long as they lasted. Now each gateway
publishes its holds in its usage sync (every `SYNC_S` here) and judges by the others' as of its last sync,
until they expire (`HOLDS_FRESH_SYNCS` sync intervals after their gateway's last sync: a gateway killed with
requests in flight blocks nobody for longer).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import httpx
import pytest

from llmgw.dev.procs import free_port, stop_process, wait_port
from llmgw.gateway.quotas import HOLDS_FRESH_SYNCS
from tests.helpers import ControlPlane, wait_until
from tests.test_tenants import Sim, auth, chat, create_key, create_tenant, usage_rows, wait_key

pytestmark = pytest.mark.integration

SYNC_S = 0.5  # LLMGW_USAGE_SYNC_S: holds reach the other gateway within two of these
FRESH_S = HOLDS_FRESH_SYNCS * SYNC_S  # a dead gateway's holds count this long after its last sync
BUDGET = 800
CHOICES = 4


@pytest.fixture(scope="module")
async def plane(tmp_path_factory, module_database_url):
    """`.cp` the control plane (its gateway is gateway 1), `.gw2` the second gateway, `.sim` a sim engine
    at 200 tokens a second serving `paced`, a model with no output bound of its own (a request without
    `max_tokens` reserves what its tenant's budget leaves)."""
    sim = Sim("paced", tokens_per_second=200)
    cp = ControlPlane(tmp_path_factory.mktemp("fleet-holds"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_ROUTE_REFRESH_S="0.5", LLMGW_USAGE_SYNC_S=str(SYNC_S))
    try:
        wait_port(sim.port, 30, sim.proc, "sim engine")
        await asyncio.to_thread(cp.start, worker=False)
        cp.gw2 = (await asyncio.to_thread(spawn_gateway, cp, "server-2"))[1]  # type: ignore[attr-defined]
        r = cp.apply({"models": [{"name": "paced", "endpoints": [sim.url]}]})
        assert r.status_code == 200, r.text
        cp.sim = sim  # type: ignore[attr-defined]
        cp.db = module_database_url  # type: ignore[attr-defined]
        plain = create_key(cp, "plain")
        for gw in (cp.gateway, cp.gw2):  # type: ignore[attr-defined]
            wait_until(lambda: httpx.post(gw + "/v1/chat/completions", json=chat("paced", max_tokens=1), timeout=10,
                                          headers=auth(plain)).status_code == 200,
                       timeout_s=20, what=f"{gw} routing paced")
        yield cp
    finally:
        await asyncio.to_thread(cp.stop)
        stop_process(sim.proc)


def spawn_gateway(cp: ControlPlane, name: str):
    """Another `llmgw server` on the control plane's database (gateway and admin API only): (proc, URL)."""
    port, admin = free_port(), free_port()
    proc = cp.spawn(name, "server", "--no-migrate", env={
        "LLMGW_GATEWAY_PORT": str(port), "LLMGW_ADMIN_PORT": str(admin), "LLMGW_NODE_API_PORT": "0"})
    wait_port(port, 60, proc.proc, name)
    return proc, f"http://127.0.0.1:{port}"


def engine_counts(cp) -> tuple[int, int, int]:
    c = cp.sim.counters()
    return c["sim:requests_total"], c["sim:prompt_tokens_total"], c["sim:generation_tokens_total"]


def ctl_usage(cp, tenant: str) -> tuple[int, int, int]:
    """(requests, prompt tokens, completion tokens) `llmgw ctl usage` reports for `tenant`."""
    out = cp.ctl("usage", "--tenant", tenant, "--by", "model", "-o", "json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    return (sum(r["requests"] for r in rows), sum(r["prompt_tokens"] for r in rows),
            sum(r["completion_tokens"] for r in rows))


async def streams(s: aiohttp.ClientSession, gw: str, key: str, count: int) -> list[tuple[int, dict | int]]:
    """`count` streams at once, `n: 4`, no length cap: (status, the error body, or the events read)."""
    async def one() -> tuple[int, dict | int]:
        async with s.post(gw + "/v1/chat/completions", headers=auth(key),
                          json=chat("paced", "hi", n=CHOICES, stream=True)) as r:
            if r.status != 200:
                return r.status, await r.json()
            return r.status, (await r.read()).count(b"data: {")
    return await asyncio.gather(*[one() for _ in range(count)])


def stored(cp, tenant: str) -> tuple[int, int, int]:
    rows = usage_rows(cp, tenant)
    return sum(r[2] for r in rows), sum(r[3] for r in rows), sum(r[4] for r in rows)


async def charged_as_the_engine_counted(cp, tenant: str, before: tuple[int, int, int]) -> tuple[int, int, int]:
    """Waits until the usage stored for `tenant` equals what the sim engine counted since `before`, then
    checks `ctl usage` says the same; returns it."""
    after = engine_counts(cp)
    engine = tuple(a - b for a, b in zip(after, before))
    await asyncio.to_thread(wait_until, lambda: stored(cp, tenant) == engine, timeout_s=5,
                            what="the usage stored = the engine's own counters",
                            why=lambda: f"stored: {stored(cp, tenant)}, engine: {engine}")
    assert await asyncio.to_thread(ctl_usage, cp, tenant) == engine
    return engine  # type: ignore[return-value]


async def test_twenty_streams_over_two_gateways_are_held_to_one_budget(plane):
    """A tenant with 800 tokens sends 20 streams with `n: 4` and no `max_tokens`, 10 to each gateway, the
    second ten once the first gateway's holds have been published (two sync intervals later) and while its
    streams still run. The first gateway admits the first (cut to 199 tokens a choice: 1 + 796 held) and one
    more with what is left (1 token a choice); the second refuses all ten with 429 (the budget held by
    requests in flight on the other gateway). Before, the second admitted two as well: twice the budget.
    The engine generated no more than that, and `ctl usage` says what the engine counted."""
    cp = plane
    create_tenant(cp, "fleet", tokens_per_month=BUDGET)
    key = create_key(cp, "fleet-1", "fleet")
    await asyncio.to_thread(wait_key, cp, key)
    before = engine_counts(cp)
    async with aiohttp.ClientSession() as s:
        first = asyncio.ensure_future(streams(s, cp.gateway, key, 10))
        await asyncio.sleep(2 * SYNC_S + 0.5)
        second = await streams(s, cp.gw2, key, 10)  # type: ignore[attr-defined]
        overlapped = not first.done()
        first = await first
    for status, body in second:
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", second
        assert "of them on other gateways" in body["error"]["message"], body
    assert overlapped  # the first gateway's streams (4 s of tokens) were in flight meanwhile
    admitted = [n for status, n in first if status == 200]
    assert len(admitted) == 2 and sorted(admitted) == [CHOICES, CHOICES * 199], first
    requests, prompt, completion = await charged_as_the_engine_counted(cp, "fleet", before)
    assert requests == 2 and completion == CHOICES * 200
    assert prompt + completion <= BUDGET + 1 + CHOICES  # the last admitted passes it by its 1-token choices


async def test_a_burst_on_both_gateways_at_once_passes_a_budget_by_at_most_what_the_other_admitted(plane):
    """The documented worst case: 10 streams on each gateway at the same instant, before either has seen
    the other's holds. Each admits what it sees left (and one request of 1-token choices), so together they
    pass the budget by what the other admitted within one sync, never more; and the next request, on either
    gateway, is refused once they are counted."""
    cp = plane
    create_tenant(cp, "fleet-burst", tokens_per_month=BUDGET)
    key = create_key(cp, "fleet-burst-1", "fleet-burst")
    await asyncio.to_thread(wait_key, cp, key)
    before = engine_counts(cp)
    async with aiohttp.ClientSession() as s:
        one, two = await asyncio.gather(streams(s, cp.gateway, key, 10), streams(s, cp.gw2, key, 10))  # type: ignore[attr-defined]
    per_gateway = [sum(n for status, n in answers if status == 200) for answers in (one, two)]
    assert all(0 < n <= BUDGET + CHOICES for n in per_gateway), per_gateway  # each: what it saw left
    requests, prompt, completion = await charged_as_the_engine_counted(cp, "fleet-burst", before)
    assert completion == sum(per_gateway) and prompt + completion <= 2 * (BUDGET + 1 + CHOICES)
    async with aiohttp.ClientSession() as s:
        for gw in (cp.gateway, cp.gw2):  # type: ignore[attr-defined]
            [(status, body)] = await streams(s, gw, key, 1)
            assert status == 429 and body["error"]["code"] == "insufficient_quota", body


async def test_a_gateway_killed_with_holds_in_flight_blocks_the_tenant_only_until_they_expire(plane):
    """A third gateway admits a stream holding the whole budget, and is killed (SIGKILL) while it runs: it
    never releases the hold. The other gateways refuse the tenant while the hold counts, and admit it again
    once it has expired, `FRESH_S` after the dead gateway's last sync (plus a sync of theirs)."""
    cp = plane
    create_tenant(cp, "orphan", tokens_per_month=20 * BUDGET)
    key = create_key(cp, "orphan-1", "orphan")
    await asyncio.to_thread(wait_key, cp, key)
    proc, gw3 = await asyncio.to_thread(spawn_gateway, cp, "server-3")
    await asyncio.to_thread(wait_until, lambda: httpx.get(gw3 + "/v1/models", headers=auth(key), timeout=10)
                            .status_code == 200, timeout_s=10, what="the key at the third gateway")

    def ask() -> httpx.Response:
        return httpx.post(cp.gateway + "/v1/chat/completions", headers=auth(key), json=chat("paced", max_tokens=1),
                          timeout=10)

    async with aiohttp.ClientSession() as s:
        held = asyncio.ensure_future(streams(s, gw3, key, 1))  # 16,000 tokens at 200 a second: 80 s
        r = await asyncio.to_thread(wait_until, lambda: (lambda r: r if r.status_code == 429 else None)(ask()),
                                    timeout_s=5, interval_s=0.1, what="gateway 1 refusing for the third's hold")
        assert "of them on other gateways" in r.json()["error"]["message"], r.text
        await asyncio.to_thread(proc.kill)
        killed = time.monotonic()
        assert ask().status_code == 429  # the dead gateway's hold still counts
        await asyncio.to_thread(wait_until, lambda: ask().status_code == 200, timeout_s=FRESH_S + 5, interval_s=0.1,
                                what="gateway 1 admitting the tenant again")
        blocked = time.monotonic() - killed
        held.cancel()
    # its last sync was at most SYNC_S before the kill; the others' next sync at most SYNC_S after expiry
    assert FRESH_S - SYNC_S - 1.0 <= blocked <= FRESH_S + 2 * SYNC_S + 1.0, blocked
