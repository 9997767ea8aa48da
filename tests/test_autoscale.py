"""Scale with load, through the real path (issue 13): 40 concurrent clients against a sim model with a
target of 15 requests per replica; the gateway reports the load, the reconciler scales 1 -> 3, and back to
1 by drain once the clients stop, with no failed request. And a burst for an unloaded on-demand model whose
engine takes seconds to become ready is held, not bounced: every request gets 200, one replica starts."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

CLIENTS = 40


def ready(cp, model: str) -> list[dict]:
    return [r for r in cp.replicas() if r["model"] == model and r["status"] == "ready"]


async def client_loop(gateway: str, model: str, stop: asyncio.Event, results: list) -> None:
    async with httpx.AsyncClient(timeout=60) as c:
        while not stop.is_set():
            try:
                r = await c.post(gateway + "/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8})
                results.append(r.status_code if r.status_code == 200 else (r.status_code, r.text[:200]))
            except httpx.HTTPError as exc:
                results.append(("error", repr(exc)))


def test_steady_load_scales_one_to_three_and_back_with_zero_failed_requests(control_plane):
    cp = control_plane.start()
    cp.agent("n1", simulate=sim_spec(gpus=0, memory_gb=64))
    cp.wait_nodes("n1")
    # 8 tokens at 20 tokens/s: each request lasts ~0.4 s, so 40 clients keep ~40 in flight.
    catalog = {"models": [{"name": "busy", "scaling": {"min": 1, "max": 3, "target_in_flight": 15,
                                                       "scale_down_delay": "4s"},
                           "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "20"]}]}]}
    assert cp.apply(catalog).status_code == 200
    cp.wait_replicas("busy", timeout_s=60)

    results: list = []

    async def run():
        stop = asyncio.Event()
        tasks = [asyncio.create_task(client_loop(cp.gateway, "busy", stop, results)) for _ in range(CLIENTS)]
        try:
            deadline = time.monotonic() + 90
            while len(await asyncio.to_thread(ready, cp, "busy")) < 3:
                assert time.monotonic() < deadline, f"never scaled to 3: {cp.explain('busy')}"
                await asyncio.sleep(0.5)
            await asyncio.sleep(3)  # the third replica takes traffic too
        finally:
            stop.set()
            await asyncio.gather(*tasks)

    asyncio.run(run())
    explain = "\n".join(cp.explain("busy")["decisions"])
    failed = [r for r in results if r != 200]
    assert not failed, failed[:5]
    assert len(results) > 100

    # The load is gone: after scale_down_delay the newest replicas drain, one by one, down to min.
    wait_until(lambda: len(ready(cp, "busy")) == 1 and not [r for r in cp.replicas(all=False)
                                                              if r["model"] == "busy" and r["status"] != "ready"],
               timeout_s=90, what="back to one replica", why=lambda: cp.explain("busy"))
    stopped = [r for r in cp.replicas() if r["model"] == "busy" and r["status"] == "stopped"]
    assert len(stopped) == 2
    assert all("wanted" in (r["ended_reason"] or "") for r in stopped), stopped
    assert "target 15 per replica" in explain, explain


def test_a_burst_for_an_unloaded_model_is_held_until_it_serves(control_plane):
    """20 requests (half streaming) for an on-demand model whose engine takes 8 s to become healthy: every
    one is held and answered 200, streaming ones see `: loading` comments, and one replica starts."""
    cp = control_plane
    cp.env["LLMGW_LOAD_WAIT_S"] = "60"
    cp.start()
    cp.agent("n1", simulate=sim_spec(gpus=0, memory_gb=64))
    cp.wait_nodes("n1")
    catalog = {"models": [{"name": "cold", "scaling": {"min": 0, "max": 1, "load_wait": "45s"},
                           "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0",
                                                                   "--startup-delay", "8"]}]}]}
    assert cp.apply(catalog).status_code == 200
    wait_until(lambda: "cold" in {m["id"] for m in httpx.get(cp.gateway + "/v1/models").json()["data"]},
               timeout_s=10, what="cold listed")

    async def one(i: int, c: httpx.AsyncClient) -> tuple[int, str]:
        body = {"model": "cold", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
        if i % 2:
            body["stream"] = True
            async with c.stream("POST", cp.gateway + "/v1/chat/completions", json=body) as r:
                text = "".join([line + "\n" async for line in r.aiter_lines()])
                return r.status_code, text
        r = await c.post(cp.gateway + "/v1/chat/completions", json=body)
        return r.status_code, r.text

    async def burst():
        async with httpx.AsyncClient(timeout=90) as c:
            return await asyncio.gather(*(one(i, c) for i in range(20)))

    started = time.monotonic()
    out = asyncio.run(burst())
    assert time.monotonic() - started > 5  # they were held through the engine's start
    assert [s for s, _ in out] == [200] * 20, [o for o in out if o[0] != 200][:3]
    streamed = [t for i, (_, t) in enumerate(out) if i % 2]
    assert all(t.rstrip().endswith("data: [DONE]") for t in streamed)
    assert any(": loading cold, " in t for t in streamed), streamed[0][:300]
    assert len([r for r in cp.replicas() if r["model"] == "cold"]) == 1


def test_the_hold_queue_is_bounded_and_its_settings_are_checked(control_plane):
    """`scaling.load_queue` bounds how many requests one gateway holds for a model: with 3 allowed and 8
    sent at once while the engine starts, 3 are held and served and 5 get 503 + Retry-After at once,
    saying how many already wait. Negative values for the hold settings are refused when applied."""
    cp = control_plane
    cp.env["LLMGW_LOAD_WAIT_S"] = "60"
    cp.start()
    for bad in ({"load_queue": -1}, {"load_wait": "-5s"}, {"target_in_flight": 0}):
        r = cp.apply({"models": [{"name": "x", "scaling": {"min": 0, "max": 1, **bad},
                                  "profiles": [{"engine": "sim"}]}]})
        assert r.status_code == 400 and next(iter(bad)) in r.text, (bad, r.status_code, r.text)
    cp.agent("n1", simulate=sim_spec(gpus=0, memory_gb=64))
    cp.wait_nodes("n1")
    catalog = {"models": [{"name": "q", "scaling": {"min": 0, "max": 1, "load_wait": "45s", "load_queue": 3},
                           "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0",
                                                                   "--startup-delay", "6"]}]}]}
    assert cp.apply(catalog).status_code == 200
    wait_until(lambda: "q" in {m["id"] for m in httpx.get(cp.gateway + "/v1/models").json()["data"]},
               timeout_s=10, what="q listed")

    async def one(c: httpx.AsyncClient) -> tuple[int, float, httpx.Response]:
        t = time.monotonic()
        r = await c.post(cp.gateway + "/v1/chat/completions", json={
            "model": "q", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        return r.status_code, time.monotonic() - t, r

    async def burst():
        async with httpx.AsyncClient(timeout=90) as c:
            return await asyncio.gather(*(one(c) for _ in range(8)))

    out = asyncio.run(burst())
    served = [o for o in out if o[0] == 200]
    refused = [o for o in out if o[0] != 200]
    assert len(served) == 3 and len(refused) == 5, [(s, round(t, 1), r.text[:120]) for s, t, r in out]
    for status, took, r in refused:
        assert status == 503 and r.headers.get("retry-after"), r.text
        assert "3 requests are already waiting" in r.json()["error"]["message"], r.text
        assert took < 3, took  # answered at once, not held
    assert all(took > 3 for _, took, _ in served)  # held through the engine's start


def test_a_request_held_for_a_model_that_leaves_the_catalog_is_told_at_once(control_plane):
    """A request waits for a model's load (its engine takes 30 s to start); the model is then switched off
    (`max: 0`) or removed. Before, the held request waited out its whole `load_wait` and got 503
    "loading" or "pending" (a control plane asked for a replica it will never place); now it is answered
    within a hold tick: 503 switched off, or 404 for a model that no longer exists."""
    cp = control_plane
    cp.start()
    cp.agent("n1", simulate=sim_spec(gpus=0, memory_gb=64))
    cp.wait_nodes("n1")

    def model(name: str, mx: int = 1) -> dict:
        return {"name": name, "scaling": {"min": 0, "max": mx, "load_wait": "60s"},
                "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0", "--startup-delay", "30"]}]}

    assert cp.apply({"models": [model("off"), model("gone")]}).status_code == 200
    wait_until(lambda: {"off", "gone"} <= {m["id"] for m in httpx.get(cp.gateway + "/v1/models").json()["data"]},
               timeout_s=10, what="both listed")

    async def held(name: str) -> tuple[float, httpx.Response]:
        async with httpx.AsyncClient(timeout=90) as c:
            t = time.monotonic()
            r = await c.post(cp.gateway + "/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            return time.monotonic() - t, r

    async def run():
        waiting = [asyncio.create_task(held("off")), asyncio.create_task(held("gone"))]
        await asyncio.sleep(3)  # both held: their engines take 30 s
        assert not any(w.done() for w in waiting), [w.result()[1].text for w in waiting if w.done()]
        assert cp.apply({"models": [model("off", mx=0)]}).status_code == 200
        changed = time.monotonic()
        out = await asyncio.gather(*waiting)
        return changed, out

    changed, [(off_took, off), (gone_took, gone)] = asyncio.run(run())
    assert off.status_code == 503 and "switched off in the catalog" in off.json()["error"]["message"], off.text
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
    assert time.monotonic() - changed < 8, (off_took, gone_took)  # a hold tick and a route refresh, not 60 s
