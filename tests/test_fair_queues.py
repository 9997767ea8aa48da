"""Fair queues through the real path (issue 37): a real `llmgw server` and a real sim engine behind a model
whose `limits.max_concurrency` is 1, so every request beyond the first waits for a slot. A light tenant's
request is served ahead of a heavy tenant's backlog; keys of no tenant share one flow and are served in
arrival order, as every request was before fair queues. The rule itself: tests/test_fairness.py."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import httpx
import pytest

from llmgw.dev.procs import free_port, stop_process, wait_port
from tests.helpers import ControlPlane, wait_until
from tests.test_tenants import Sim, auth, chat, create_key, create_tenant

pytestmark = pytest.mark.integration

BACKLOG = 8  # the heavy tenant's requests sent at once; each streams 3 tokens at 20 tokens/s (150 ms)


@pytest.fixture(scope="module")
async def plane(tmp_path_factory, module_database_url):
    sim = Sim("gated", tokens_per_second=20)
    cp = ControlPlane(tmp_path_factory.mktemp("fair"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_ROUTE_REFRESH_S="0.5")
    try:
        wait_port(sim.port, 30, sim.proc, "sim engine")
        await asyncio.to_thread(cp.start, worker=False)
        r = cp.apply({"models": [{"name": "gated", "endpoints": [sim.url],
                                  "limits": {"max_concurrency": 1, "max_queue": 50, "queue_timeout_s": 30}}]})
        assert r.status_code == 200, r.text
        yield cp
    finally:
        await asyncio.to_thread(cp.stop)
        stop_process(sim.proc)


async def first_tokens(cp: ControlPlane, heavy: str, light: str) -> tuple[list[float], float]:
    """The heavy key's backlog sent at once, then, once it waits, one request of the light key: when each got
    its first token (seconds from the start)."""
    t0 = time.perf_counter()

    async def ask(s: aiohttp.ClientSession, key: str) -> float:
        async with s.post(cp.gateway + "/v1/chat/completions", headers=auth(key),
                          json=chat("gated", max_tokens=3, stream=True)) as r:
            assert r.status == 200, await r.text()
            first = None
            async for line in r.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - t0
            assert first is not None
            return first

    async with aiohttp.ClientSession() as s:
        backlog = [asyncio.create_task(ask(s, heavy)) for _ in range(BACKLOG)]
        await asyncio.sleep(0.3)  # the first in flight, the rest waiting for its slot
        light_at = await ask(s, light)
        return await asyncio.gather(*backlog), light_at


async def test_a_light_tenant_is_served_ahead_of_a_heavy_ones_backlog(plane):
    cp = plane
    create_tenant(cp, "fair-heavy")
    create_tenant(cp, "fair-light")
    keys = {name: create_key(cp, name, tenant) for name, tenant in
            (("heavy", "fair-heavy"), ("light", "fair-light"), ("plain-heavy", None), ("plain-light", None))}
    for key in keys.values():
        await asyncio.to_thread(wait_until, lambda: httpx.post(
            cp.gateway + "/v1/chat/completions", headers=auth(key), json=chat("gated", max_tokens=1),
            timeout=10).status_code == 200, timeout_s=20, what="the key and the model at the gateway")

    heavy, light = await first_tokens(cp, keys["heavy"], keys["light"])
    ahead = sum(1 for t in heavy if t < light)
    assert ahead <= 2, (ahead, light, sorted(heavy))  # the one in flight, at most one more: not all 8

    # Keys of no tenant share one flow: the same traffic is served in arrival order, the light request last.
    heavy, light = await first_tokens(cp, keys["plain-heavy"], keys["plain-light"])
    assert sum(1 for t in heavy if t < light) == BACKLOG, (light, sorted(heavy))
