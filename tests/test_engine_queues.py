"""The engines' own queues as the saturation signal, through the real path (issue 37): a real `llmgw
server` and a real sim engine that generates at most 2 requests at once (`--max-num-seqs 2`, vLLM's flag),
behind a model with a queue (`max_queue`) and no `max_concurrency`. Without the engine's queue the gateway
would forward every request and the engine would serve them first come first served; reading it
(gateway/engine_queues.py), the gateway lowers the model's slots to 2, the heavy tenant's backlog waits at
the gateway, and a light tenant's request is served next. The rule itself: tests/test_fairness.py."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import aiohttp
import httpx
import pytest

from llmgw.dev.procs import free_port, stop_process, wait_port
from tests.helpers import ControlPlane, wait_until
from tests.test_tenants import auth, chat, create_key, create_tenant

pytestmark = pytest.mark.integration

SEQS = 2  # the engine's batch
HEAVY = 10  # the heavy tenant's clients, each sending its next request as soon as one ends
TOKENS = 6  # each request streams this many tokens at 30 tokens/s (200 ms)


@pytest.fixture(scope="module")
async def plane(tmp_path_factory, module_database_url):
    port = free_port()
    sim = subprocess.Popen([sys.executable, "-m", "llmgw.engines.sim_server", "--port", str(port), "--model", "q",
                            "--tokens-per-second", "30", "--max-num-seqs", str(SEQS)],
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cp = ControlPlane(tmp_path_factory.mktemp("engine-queues"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_ROUTE_REFRESH_S="0.5", LLMGW_ENGINE_QUEUE_POLL_S="0.2")
    try:
        wait_port(port, 30, sim, "sim engine")
        await asyncio.to_thread(cp.start, worker=False)
        r = cp.apply({"models": [{"name": "q", "endpoints": [f"http://127.0.0.1:{port}"],
                                  "limits": {"max_queue": 100, "queue_timeout_s": 60}}]})
        assert r.status_code == 200, r.text
        cp.engine_url = f"http://127.0.0.1:{port}"
        yield cp
    finally:
        await asyncio.to_thread(cp.stop)
        stop_process(sim)


def gauge(page: str, name: str) -> float | None:
    m = re.search(rf'^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$', page, re.M)
    return float(m.group(1)) if m else None


async def test_an_engines_own_queue_makes_the_gateway_queue_fairly(plane):
    cp = plane
    create_tenant(cp, "eq-heavy")
    create_tenant(cp, "eq-light")
    heavy, light = create_key(cp, "eq-heavy", "eq-heavy"), create_key(cp, "eq-light", "eq-light")
    for key in (heavy, light):
        await asyncio.to_thread(wait_until, lambda: httpx.post(
            cp.gateway + "/v1/chat/completions", headers=auth(key), json=chat("q", max_tokens=1),
            timeout=10).status_code == 200, timeout_s=20, what="the key and the model at the gateway")

    t_end = time.perf_counter() + 6.0
    failures: list[str] = []

    async def first_token(s: aiohttp.ClientSession, key: str) -> float:
        t0 = time.perf_counter()
        async with s.post(cp.gateway + "/v1/chat/completions", headers=auth(key),
                          json=chat("q", max_tokens=TOKENS, stream=True)) as r:
            if r.status != 200:
                failures.append(f"{r.status} {await r.text()}")
                return float("inf")
            first = None
            async for line in r.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - t0
            return first if first is not None else float("inf")

    async def heavy_client(s: aiohttp.ClientSession) -> None:
        while time.perf_counter() < t_end:
            await first_token(s, heavy)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        clients = [asyncio.create_task(heavy_client(s)) for _ in range(HEAVY)]
        await asyncio.sleep(2.5)  # the first burst (all forwarded, most queued in the engine) served; slots learned
        async with httpx.AsyncClient() as c:
            page = (await c.get(cp.gateway + "/metrics")).text
            engine = (await c.get(cp.engine_url + "/metrics")).text
        slots, engine_waiting = gauge(page, 'llmgw_model_slots{model="q"}'), gauge(engine, "sim:num_requests_waiting")
        light_ttft = [await first_token(s, light) for _ in range(3)]
        await asyncio.gather(*clients)
    assert not failures, failures[:3]  # nobody refused or timed out: they waited
    assert slots is not None and slots <= SEQS + 1, page  # lowered to what the engine runs (+1 as it probes)
    assert engine_waiting is not None and engine_waiting <= 1, engine  # the backlog waits at the gateway
    # In the engine's own queue the light request would wait behind ~8 heavy ones: 4 rounds of 200 ms. At the
    # gateway it is next in the fair queue: one round at most.
    assert sorted(light_ttft)[1] < 0.45, light_ttft
