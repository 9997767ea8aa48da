"""`llmgw_activation_seconds{model,rung}` through the real path (issue 39, item 5): a real gateway, control
plane, node worker and sim engine. A request held for a cold start is counted under `start`, one held for a
sleeping replica's wake under `wake`, and a request a Ready replica answers at once under neither."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from tests.test_gateway_on_demand import apply, body

pytestmark = pytest.mark.integration

MODEL = "activated"
WAKE_S = 0.4


def catalog() -> dict:
    return {"models": [{"name": MODEL, "scaling": {"min": 0, "max": 1, "sleep_after": 2, "idle_timeout": 60},
                        "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0", "--sleep-s", "0.1",
                                                                "--wake-s", str(WAKE_S)]}]}]}


async def activation(s: aiohttp.ClientSession, gateway: str) -> dict[str, tuple[int, float]]:
    """rung -> (count, sum of seconds) of MODEL's series on the gateway's /metrics."""
    async with s.get(gateway + "/metrics") as r:
        text = await r.text()
    out: dict[str, tuple[int, float]] = {}
    for rung in ("start", "wake"):
        labels = f'model="{MODEL}",rung="{rung}"'
        count = re.search(r"llmgw_activation_seconds_count\{" + re.escape(labels) + r"\} (\S+)", text)
        total = re.search(r"llmgw_activation_seconds_sum\{" + re.escape(labels) + r"\} (\S+)", text)
        if count and total:
            out[rung] = (int(float(count.group(1))), float(total.group(1)))
    return out


async def test_held_requests_are_counted_by_rung_from_arrival_to_first_token(control_plane):
    cp = control_plane
    cp.env.update({"LLMGW_LOAD_WAIT_S": "30", "LLMGW_RECONCILE_INTERVAL_S": "1"})
    await asyncio.to_thread(cp.start)
    cp.agent("node-a")
    await asyncio.to_thread(cp.wait_nodes, "node-a")
    await apply(cp, catalog())
    async with aiohttp.ClientSession() as s:
        assert await activation(s, cp.gateway) == {}
        async with s.post(cp.gateway + "/v1/chat/completions", json=body(MODEL, stream=True)) as r:  # cold start
            assert r.status == 200, await r.text()
            await r.read()
        got = await activation(s, cp.gateway)
        assert set(got) == {"start"} and got["start"][0] == 1, got

        async with s.post(cp.gateway + "/v1/chat/completions", json=body(MODEL)) as r:  # Ready: not held
            assert r.status == 200, await r.text()
        assert await activation(s, cp.gateway) == got

        await asyncio.to_thread(cp.wait_replicas, MODEL, "sleeping", 1, 30)
        async with s.post(cp.gateway + "/v1/chat/completions", json=body(MODEL)) as r:  # held for a wake
            assert r.status == 200, await r.text()
        after = await activation(s, cp.gateway)
        assert after["start"] == got["start"], after
        count, seconds = after["wake"]
        assert count == 1 and WAKE_S <= seconds < 10, after  # at least the engine's own wake
