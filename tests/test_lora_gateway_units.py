"""The gateway's adapter loads (gateway/adapters.py, issue 40) against a real sim engine over the real
upstream client: loads behind the engine key, the LRU per replica bounded by `max_loras`, one load for
concurrent requests, an engine's refusal and a slow load as the client's errors, and the holdings another
gateway recorded merged into this one's order."""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import pytest
from aiohttp.test_utils import TestServer

from llmgw.engines.sim_server import SimEngine, make_app
from llmgw.gateway.adapters import AdapterLoads
from llmgw.gateway.routes import Endpoint, _sync_adapters
from llmgw.gateway.upstream import Upstream, parse_target
from llmgw.http.errors import APIError
from llmgw.schemas.catalog import Adapter


async def engine_server(**kw) -> tuple[SimEngine, TestServer]:
    engine = SimEngine("base", 0, 0, **kw)
    server = TestServer(make_app(engine, "k"))
    await server.start_server()
    return engine, server


def endpoint(server: TestServer, max_loras: int, key: str = "k") -> Endpoint:
    url = str(server.make_url("")).rstrip("/")
    target = dataclasses.replace(parse_target(url), auth=f"Authorization: Bearer {key}\r\n".encode())
    return Endpoint("rep-1", url, "node-a", target, max_loras=max_loras)


def adapter(name: str) -> Adapter:
    return Adapter(name=name, source=f"/adapters/{name}")


async def test_loads_behind_the_key_and_unloads_the_least_recently_used_past_max_loras():
    engine, server = await engine_server(max_loras=2)
    upstream = Upstream(5)
    loads = AdapterLoads(None, upstream)
    ep = endpoint(server, 2)
    try:
        await loads.ensure(ep, "base", adapter("a"))
        await loads.ensure(ep, "base", adapter("b"))
        assert list(engine.loras) == ["a", "b"] and list(ep.adapters) == ["a", "b"]
        assert loads.holders([ep], "a", set()) == [ep] and loads.holders([ep], "a", {"rep-1"}) == []
        assert loads.holders([ep], "c", set()) == []
        loads.used(ep, "a")  # a request for a: b is now the least recently used
        await loads.ensure(ep, "base", adapter("c"))
        assert sorted(engine.loras) == ["a", "c"] and list(ep.adapters) == ["a", "c"]
        assert loads.loads == 3 and loads.evictions == 1
        await loads.ensure(ep, "base", adapter("c"))  # held: nothing is called
        assert loads.loads == 3
        # The engine lost it (restarted): forgotten, then loaded again; one it still holds is taken as loaded.
        engine.loras.clear()
        engine.loras["a"] = "/adapters/a"
        loads.forget(ep, "c")
        ep.adapters.clear()
        await loads.ensure(ep, "base", adapter("a"))  # vLLM's 400 "has already been loaded": loaded
        await loads.ensure(ep, "base", adapter("c"))
        assert sorted(engine.loras) == ["a", "c"]
    finally:
        await upstream.close()
        await server.close()


async def test_concurrent_requests_for_one_adapter_cause_one_load():
    engine, server = await engine_server(max_loras=2, lora_load_s=0.3)
    upstream = Upstream(5)
    loads = AdapterLoads(None, upstream)
    ep = endpoint(server, 2)
    try:
        first = asyncio.ensure_future(loads.ensure(ep, "base", adapter("a")))
        await asyncio.sleep(0.05)
        assert loads.holders([ep], "a", set()) == [ep]  # a request now goes to the replica loading it
        await asyncio.gather(first, *(loads.ensure(ep, "base", adapter("a")) for _ in range(5)))
        assert loads.loads == 1 and list(engine.loras) == ["a"]
        assert "a" not in loads.loading
    finally:
        await upstream.close()
        await server.close()


async def test_a_refused_load_a_wrong_key_and_a_slow_load_are_errors_naming_the_adapter():
    engine, server = await engine_server()  # LoRA off: every load refused
    slow_engine, slow = await engine_server(max_loras=1, lora_load_s=2)
    upstream = Upstream(5)
    try:
        with pytest.raises(APIError) as exc:
            await AdapterLoads(None, upstream).ensure(endpoint(server, 1), "base", adapter("a"))
        assert exc.value.status == 503 and exc.value.code == "adapter_load_failed"
        assert "`a`" in exc.value.message and "LoRA is not enabled" in exc.value.message
        with pytest.raises(APIError) as exc:
            await AdapterLoads(None, upstream).ensure(endpoint(server, 1, key="wrong"), "base", adapter("a"))
        assert exc.value.code == "adapter_load_failed" and "HTTP 401" in exc.value.message
        with pytest.raises(APIError) as exc:
            await AdapterLoads(None, upstream, timeout_s=0.2).ensure(endpoint(slow, 1), "base", adapter("a"))
        assert exc.value.status == 504 and exc.value.code == "adapter_load_timeout"
        gone = endpoint(server, 1)
        await server.close()
        with pytest.raises(APIError) as exc:
            await AdapterLoads(None, upstream).ensure(gone, "base", adapter("a"))
        assert "could not be reached" in exc.value.message
    finally:
        await upstream.close()
        await server.close()
        await slow.close()


def test_holdings_another_gateway_recorded_count_as_least_recently_used_here():
    ep = Endpoint("rep-1", "http://127.0.0.1:1", "node-a", parse_target("http://127.0.0.1:1"), max_loras=3)
    ep.adapters = collections.OrderedDict.fromkeys(["a", "b"])
    _sync_adapters(ep, ["b", "c", "a"])  # c loaded by another gateway
    assert list(ep.adapters) == ["c", "a", "b"]
    _sync_adapters(ep, ["c", "b"])  # a unloaded elsewhere
    assert list(ep.adapters) == ["c", "b"]
    _sync_adapters(ep, [])
    assert list(ep.adapters) == []


async def test_a_streaming_request_is_held_with_comments_while_its_adapter_loads():
    engine, server = await engine_server(max_loras=1, lora_load_s=2.3)  # past one HOLD_TICK_S (2 s)
    upstream = Upstream(5)
    loads = AdapterLoads(None, upstream)
    ticks: list[float] = []

    async def hold(waited_s: float) -> None:
        ticks.append(waited_s)
    try:
        await loads.ensure(endpoint(server, 1), "base", adapter("a"), hold)
        assert len(ticks) == 1 and ticks[0] >= 2.0 and list(engine.loras) == ["a"]
    finally:
        await upstream.close()
        await server.close()


def test_a_hot_adapter_spreads_to_a_less_busy_replica():
    """`holders`: the holder while it is not much busier than a replica without the adapter; that replica too
    once every holder has SPREAD_AFTER more in flight; never a second load while one is in progress."""
    from llmgw.gateway.adapters import SPREAD_AFTER

    def ep(rid: str, held: list[str], outstanding: int) -> Endpoint:
        e = Endpoint(rid, "http://127.0.0.1:1", "node-a", parse_target("http://127.0.0.1:1"), max_loras=2)
        e.adapters = collections.OrderedDict.fromkeys(held)
        e.outstanding = outstanding
        return e

    loads = AdapterLoads(None, Upstream(5))
    hot, cold, busy = ep("r1", ["a"], SPREAD_AFTER - 1), ep("r2", [], 0), ep("r3", [], SPREAD_AFTER)
    assert loads.holders([hot, cold, busy], "a", set()) == [hot]
    hot.outstanding = SPREAD_AFTER
    assert loads.holders([hot, cold, busy], "a", set()) == [hot, cold]  # the least busy replica without it
    assert loads.holders([hot, cold, busy], "a", {"r2"}) == [hot]  # (busy has as many in flight as hot)
    loads.loading["a"] = "r2"
    assert loads.holders([hot, cold, busy], "a", set()) == [hot, cold]  # the one loading it, no third
    loads.loading["a"] = "r1"
    assert loads.holders([hot, cold, busy], "a", set()) == [hot]


async def test_the_proxy_loads_a_hot_adapter_into_a_second_replica():
    """Through the real proxy and upstream client to two real sim engines: requests for one adapter in flight
    together go to the replica that loaded it until it is SPREAD_AFTER busier than the other, and then the
    other loads it too and serves."""
    import json

    from llmgw.catalog.context import prompt_bound
    from llmgw.gateway.admission import Gates
    from llmgw.gateway.adapters import SPREAD_AFTER
    from llmgw.gateway.balancer import Balancer
    from llmgw.gateway.demand import Demand
    from llmgw.gateway.proxy import Proxy
    from llmgw.gateway.routes import ModelRoute, RouteTable
    from llmgw.schemas.catalog import Model
    from llmgw.telemetry import GatewayMetrics

    engines, servers = zip(*[await engine_server(max_loras=2) for _ in range(2)])
    for e in engines:
        e.delay = 0.05  # 20 tokens a second: each answer of 20 tokens takes a second, so they overlap
    upstream = Upstream(10)
    try:
        model = Model.model_validate({"name": "base", "profiles": [{"engine": "sim", "max_loras": 2}],
                                      "adapters": [{"name": "a", "source": "/adapters/a"}]})
        eps = [endpoint(s, 2) for s in servers]
        eps[1].replica_id = "rep-2"
        for e in eps:
            e.engine = "sim"
        routes = RouteTable(None, 15.0)  # type: ignore[arg-type]
        routes.models = {"base": ModelRoute(model, prompt_bound(model), endpoints=eps)}
        routes.names = {"base": "base"}
        routes.adapters = {"a": ("base", model.adapters[0])}
        proxy = Proxy(routes, Demand(None, routes, None, 1.0), Gates(), Balancer(), upstream,  # type: ignore[arg-type]
                      GatewayMetrics(), adapters=AdapterLoads(None, upstream))
        body = json.dumps({"model": "a", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}).encode()
        answers: list[dict] = []

        async def call() -> None:
            sent = [{"type": "http.request", "body": body, "more_body": False}]
            chunks: list[bytes] = []

            async def receive():
                return sent.pop() if sent else await asyncio.sleep(3600)

            async def send(msg):
                if msg["type"] == "http.response.start":
                    assert msg["status"] == 200
                elif msg.get("body"):
                    chunks.append(msg["body"])

            await proxy.handle({"type": "http", "path": "/v1/chat/completions", "method": "POST", "headers": []},
                               receive, send, None)
            answers.append(json.loads(b"".join(chunks)))

        calls = []
        for _ in range(SPREAD_AFTER + 1):  # started one by one: each sees the ones before it in flight
            calls.append(asyncio.ensure_future(call()))
            await asyncio.sleep(0.1)
        await asyncio.gather(*calls)
        assert sorted(len(e.loras) for e in engines) == [1, 1] and all("a" in e.loras for e in engines)
        assert [a["system_fingerprint"] for a in answers] == ["lora:a"] * (SPREAD_AFTER + 1)
        assert all("a" in e.adapters for e in eps)
    finally:
        await upstream.close()
        for s in servers:
            await s.close()
