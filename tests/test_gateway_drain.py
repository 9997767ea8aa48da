"""A gateway that drains (issue 38): two real `llmgw server` gateways on one Postgres, real sim engines
streaming slowly (20 tokens/s), and one gateway stopped with SIGTERM under streaming load.

What is asserted, with the counts: no stream on the stopped gateway ends without `[DONE]`, and none that
stops short ends without an error event; the streams that finish within the drain timeout end with
`[DONE]` and all their tokens; a request held for a model to load is answered at once (503 +
Retry-After, or its stream's error event); new requests to the draining gateway get 503 + Retry-After
while `/readyz` says draining and `/healthz` stays 200; the other gateway keeps serving throughout, its
own streams whole; the stopped gateway exits 0 soon after its drain timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import httpx
import pytest

from llmgw.dev.procs import free_port, stop_process, wait_port
from tests.helpers import ControlPlane, wait_until
from tests.test_tenants import Sim

pytestmark = pytest.mark.integration

DRAIN_S = 4.0  # the stopped gateway's `gateway_drain_timeout_s`
RATE = 20  # tokens per second of the slow sim engine


@pytest.fixture(scope="module")
async def gateways(tmp_path_factory, module_database_url):
    slow = Sim("slow", tokens_per_second=RATE)
    cp = ControlPlane(tmp_path_factory.mktemp("drain"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_ROUTE_REFRESH_S="0.5", LLMGW_GATEWAY_DRAIN_TIMEOUT_S=str(DRAIN_S))
    try:
        await asyncio.to_thread(wait_port, slow.port, 30, slow.proc, "sim engine")
        await asyncio.to_thread(cp.start, worker=False)
        g2 = free_port()
        second = cp.spawn("server-2", "server", "--no-migrate", env={
            "LLMGW_GATEWAY_PORT": str(g2), "LLMGW_ADMIN_PORT": str(free_port()), "LLMGW_NODE_API_PORT": "0"})
        await asyncio.to_thread(wait_port, g2, 60, second.proc, "the second gateway")
        r = cp.apply({"models": [
            {"name": "slow", "endpoints": [slow.url]},
            # a model that loads on demand and never becomes ready here (no control worker, no node)
            {"name": "cold", "profiles": [{"engine": "sim"}],
             "scaling": {"min": 0, "max": 1, "load_wait": 120}},
        ]})
        assert r.status_code == 200, r.text
        cp.gw2 = f"http://127.0.0.1:{g2}"  # type: ignore[attr-defined]
        for gw in (cp.gateway, cp.gw2):
            await asyncio.to_thread(wait_until, lambda: httpx.post(
                gw + "/v1/chat/completions", json=_chat(2), timeout=10).status_code == 200,
                timeout_s=30, what=f"{gw} routing slow")
        yield cp
    finally:
        await asyncio.to_thread(cp.stop)
        stop_process(slow.proc)


def _chat(max_tokens: int, model: str = "slow", stream: bool = False) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
            "stream": stream}


class Stream:
    """One streamed answer as a client sees it: its events in order."""

    def __init__(self) -> None:
        self.status = 0
        self.events: list[str] = []  # each `data:` payload
        self.comments = 0
        self.opened = asyncio.Event()  # the first event or comment arrived

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def errors(self) -> list[dict]:
        return [json.loads(e)["error"] for e in self.events if e.startswith("{") and '"error"' in e[:12]]

    @property
    def tokens(self) -> int:
        return sum(1 for e in self.events if e.startswith("{") and '"error"' not in e[:12]
                   and json.loads(e)["choices"] and json.loads(e)["choices"][0]["delta"].get("content"))


async def _stream(gw: str, body: dict, out: Stream) -> None:
    async with aiohttp.ClientSession() as s:
        try:
            async with s.post(gw + "/v1/chat/completions", json=body) as r:
                out.status = r.status
                async for raw in r.content:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        out.events.append(line[6:])
                        out.opened.set()
                    elif line.startswith(":"):
                        out.comments += 1
                        out.opened.set()
        except aiohttp.ClientError:
            pass  # a cut connection: what `done` and `errors` then show
        finally:
            out.opened.set()


async def test_sigterm_drains_one_of_two_gateways_under_streaming_load(gateways):
    cp = gateways
    gw1, gw2 = cp.gateway, cp.gw2  # type: ignore[attr-defined]
    server = next(p for p in cp.procs if p.name == "server")
    assert (await asyncio.to_thread(httpx.get, gw1 + "/readyz")).json()["status"] == "ready"

    short = [Stream() for _ in range(4)]  # ~1 s of tokens: finish within the drain
    long = [Stream() for _ in range(3)]  # ~15 s: still open when the drain runs out
    other = [Stream() for _ in range(3)]  # on the gateway that keeps serving, past the other's drain
    held = Stream()  # a stream held for `cold` to load (SSE comments meanwhile)
    tasks = [asyncio.create_task(_stream(gw1, _chat(RATE, stream=True), s)) for s in short]
    tasks += [asyncio.create_task(_stream(gw1, _chat(15 * RATE, stream=True), s)) for s in long]
    tasks += [asyncio.create_task(_stream(gw2, _chat(int((DRAIN_S + 2) * RATE), stream=True), s)) for s in other]
    tasks.append(asyncio.create_task(_stream(gw1, _chat(5, model="cold", stream=True), held)))
    held_plain = asyncio.create_task(asyncio.to_thread(
        httpx.post, gw1 + "/v1/chat/completions", json=_chat(5, model="cold"), timeout=60))
    for s in (*short, *long, *other, held):
        await asyncio.wait_for(s.opened.wait(), 30)
    await asyncio.sleep(0.3)  # the plain held request is waiting too

    os.killpg(server.proc.pid, signal.SIGTERM)
    sent = time.monotonic()

    async def after(fn):
        return await asyncio.to_thread(fn)

    # Draining: readiness says so, liveness stays up, new requests are refused; held ones answered at once.
    ready = await after(lambda: wait_until(lambda: (r := httpx.get(gw1 + "/readyz")).status_code == 503 and r,
                                           timeout_s=5, what="readyz draining"))
    assert ready.json()["status"] == "draining" and ready.json()["open"] >= len(long), ready.text
    health = await after(lambda: httpx.get(gw1 + "/healthz"))
    assert health.status_code == 200 and health.json()["draining"] is True
    refused = await after(lambda: httpx.post(gw1 + "/v1/chat/completions", json=_chat(2), timeout=10))
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    assert refused.json()["error"]["code"] == "gateway_draining"
    assert refused.headers.get("connection") == "close"
    plain = await asyncio.wait_for(held_plain, 10)
    assert plain.status_code == 503 and "retry-after" in plain.headers, plain.text
    assert plain.json()["error"]["code"] == "gateway_draining"
    assert time.monotonic() - sent < DRAIN_S, "a held request waited out the drain instead of being answered"
    # the other gateway keeps serving
    served = await after(lambda: httpx.post(gw2 + "/v1/chat/completions", json=_chat(3), timeout=10))
    assert served.status_code == 200, served.text

    await asyncio.wait_for(asyncio.gather(*tasks), DRAIN_S + 20)
    code = await after(lambda: server.proc.wait(15))
    assert code == 0, server.log()[-3000:]

    # Zero cut streams: each ends with [DONE], and each that stopped short with exactly one error event first.
    for s in (*short, *long, *other, held):
        assert s.status == 200 and s.done, (s.status, s.events[-3:])
    assert [s.tokens for s in short] == [RATE] * len(short) and not any(s.errors for s in short)
    for s in long:
        assert [e["code"] for e in s.errors] == ["gateway_draining"] and s.events[-2].startswith('{"error"'), s.events[-3:]
        assert 0 < s.tokens < 15 * RATE
    assert held.comments >= 1 and [e["code"] for e in held.errors] == ["gateway_draining"] and held.tokens == 0
    assert [s.tokens for s in other] == [int((DRAIN_S + 2) * RATE)] * len(other) and not any(s.errors for s in other)
    log = server.log()
    assert "draining: " in log and "ending 3 open request(s)" in log, log[-3000:]
