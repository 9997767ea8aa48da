"""Cache isolation's parts on their own (issue 37): tenants' salts, the bodies each engine is sent, the sim
engine's prefix cache. The real path (a gateway, tenants' keys, a sim engine's cache) is in
tests/test_cache_isolation.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from llmgw.engines.sim_cache import BLOCK_TOKENS, PrefixCache, prompt_words
from llmgw.gateway.isolation import (
    MAX_CLIENT_SALT, NO_CACHE, SALTED, Isolated, Isolation, Salts, engine_class, isolated, salt_secret,
)
from llmgw.http.errors import APIError
from llmgw.schemas.catalog import Model


class _Account:
    def __init__(self, tenant):
        self.tenant = tenant


def test_a_tenants_salt_is_stable_secret_and_its_own():
    a, b = Salts(b"k" * 32), Salts(b"k" * 32)
    assert a.salt("ml") == b.salt("ml") == a.salt("ml")  # every gateway, every restart: the same
    assert a.salt("ml") != a.salt("ops") and a.salt("ml") != Salts(b"j" * 32).salt("ml")
    assert "ml" not in a.salt("ml") and a.salt("ml").startswith("llmgw-")
    # A client's own salt splits its tenant's cache, never reaches another's: the fields are length-
    # prefixed, so no tenant and client salt pair reads as another pair.
    assert a.salt("ml", "u1") not in (a.salt("ml"), a.salt("ml", "u2"), a.salt("ops", "u1"))
    assert a.salt("ab", "c") != a.salt("a", "bc")
    assert a.salt("ml", a.salt("ops")) != a.salt("ops")  # naming another tenant's salt gets a third one


@pytest.mark.parametrize("client", [123, 1.5, True, ["x"], {"a": 1}, "", "x" * (MAX_CLIENT_SALT + 1)])
def test_a_client_salt_the_gateway_cannot_fold_in_is_a_400_naming_it(client):
    with pytest.raises(APIError) as e:
        Salts(b"k" * 32).salt("ml", client)
    assert e.value.status == 400 and e.value.param == "cache_salt"


def test_the_secret_comes_from_the_setting_else_the_database_password():
    assert salt_secret("s" * 40, "postgresql://u:p@h/db") == salt_secret("s" * 40, None)
    assert salt_secret(None, "postgresql://u:pw@h:5432/db") == salt_secret(None, "postgresql+psycopg://x:pw@other/db")
    assert salt_secret(None, "postgresql://u:pw@h/db") != salt_secret(None, "postgresql://u:pw2@h/db")
    assert salt_secret(None, "postgresql://u:p%40w@h/db") == salt_secret(None, "postgresql://v:p@w@h/db".replace("p@w@", "p%40w@"))


def test_no_password_anywhere_gives_a_random_secret(monkeypatch):
    monkeypatch.delenv("PGPASSWORD", raising=False)
    assert salt_secret(None, "postgresql://u@h/db") != salt_secret(None, "postgresql://u@h/db")
    monkeypatch.setenv("PGPASSWORD", "pw")
    assert salt_secret(None, "postgresql://u@h/db") == salt_secret(None, "postgresql://x:pw@h/db")


def test_each_engine_gets_its_own_form_of_isolation():
    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body = json.dumps(req).encode() + b"  \n"
    r, b = isolated(req, body, SALTED, "S", True)
    assert json.loads(b) == {**req, "cache_salt": "S"} == r
    r, b = isolated(req, body, NO_CACHE, "S", True)  # llama-server: no salt, no prompt cache
    assert json.loads(b) == {**req, "cache_prompt": False}
    sent = {**req, "cache_salt": "mine", "cache_prompt": True}  # the client's fields are replaced
    assert json.loads(isolated(sent, json.dumps(sent).encode(), SALTED, "S", True)[1])["cache_salt"] == "S"
    assert json.loads(isolated(sent, json.dumps(sent).encode(), NO_CACHE, None, True)[1])["cache_prompt"] is False
    assert isolated(req, body, SALTED, None, True) == (req, body)  # no tenant: an unsalted cache, body untouched
    assert isolated(req, body, NO_CACHE, None, False) == (req, body)  # no tenants in the fleet: llama.cpp as before
    assert engine_class("llamacpp") == NO_CACHE and {engine_class(e) for e in ("vllm", "sglang", "sim", "static")} == {SALTED}


def test_a_shared_model_is_sent_what_the_client_sent():
    req = {"model": "m", "prompt": "x"}
    body = json.dumps(req).encode()
    shared = Model(name="m", endpoints=["http://e"], cache_isolation="shared")
    tenant = Model(name="m", endpoints=["http://e"])
    assert tenant.cache_isolation == "tenant"  # the default
    iso = Isolated("S", True)
    assert iso.body(shared, SALTED, req, body) is body and iso.body(shared, NO_CACHE, req, body) is body
    assert json.loads(iso.body(tenant, SALTED, req, body))["cache_salt"] == "S"


def test_requests_of_no_tenant_are_left_alone_until_the_fleet_has_tenants():
    tenanted = [False]
    iso = Isolation(Salts(b"k" * 32), lambda: tenanted[0])
    assert iso.of(None, {}) is None and iso.of(_Account(None), {}) is None
    tenanted[0] = True
    got = iso.of(None, {"cache_salt": 5})  # not a tenant's: its own salt is the engine's to judge
    assert got.salt is None and got.no_cache
    assert iso.of(_Account("ml"), {}).salt == Salts(b"k" * 32).salt("ml")


def test_the_sim_cache_hits_within_a_salt_and_never_across():
    cache = PrefixCache(1000)
    words = [f"w{i}" for i in range(100)]  # 6 whole blocks
    assert cache.lookup("a", words) == 0
    assert cache.lookup("a", words) == 6 * BLOCK_TOKENS
    assert cache.lookup("b", words) == 0 and cache.lookup(None, words) == 0
    assert cache.lookup("a", words[:40] + ["other"] * 60) == 2 * BLOCK_TOKENS  # the leading blocks alike
    assert cache.lookup("a", words, read=False) == 0  # cache_prompt: false reads nothing
    assert (cache.queries, cache.hits) == (600, 8 * BLOCK_TOKENS)


def test_the_sim_cache_forgets_the_least_recently_used_blocks():
    cache = PrefixCache(8)
    a, b = [f"a{i}" for i in range(64)], [f"b{i}" for i in range(64)]  # 4 blocks each
    cache.lookup(None, a)
    cache.lookup(None, b)
    assert cache.lookup(None, a) == 4 * BLOCK_TOKENS  # both fit
    cache.lookup(None, [f"c{i}" for i in range(64)])  # b is now the oldest: evicted
    assert cache.lookup(None, b) == 0 and len(cache.blocks) == 8


def test_prompt_words_reads_any_shape_without_failing():
    assert prompt_words("a b  c") == ["a", "b", "c"]
    msgs = [{"role": "system", "content": "s t"}, {"role": "user", "content": [
        {"type": "text", "text": "u"}, {"type": "image_url", "image_url": {"url": "data:x"}}, {"type": "text", "text": 5},
        "junk", None]}, {"role": "user", "content": None}, {"role": "tool", "content": {"a": 1}}, 7, "x y", None]
    assert prompt_words(msgs) == ["s", "t", "u", "7", "x", "y"]
    assert prompt_words([1, 2, True]) == ["1", "2"] and prompt_words(None) == [] and prompt_words(3.5) == []


def test_prefill_is_one_at_a_time_and_only_for_what_was_not_found():
    async def run() -> float:
        cache = PrefixCache(0, prefill_tokens_per_second=1000)
        t = time.perf_counter()
        await asyncio.gather(cache.prefill(50), cache.prefill(50), cache.prefill(0))
        return time.perf_counter() - t
    assert asyncio.run(run()) >= 0.095  # two prefills of 50 ms queue behind each other


async def test_the_route_table_knows_each_replicas_engine(database_url):
    """Each routed replica carries its engine's form of isolation, from the profile it runs (a model may have
    a llama.cpp profile and a vLLM one at once), read from Postgres as the gateway reads it."""
    from llmgw.db import catalog_repo, fleet_repo
    from llmgw.db.engine import async_engine
    from llmgw.gateway.routes import RouteTable
    from llmgw.schemas.catalog import Catalog
    from llmgw.schemas.inventory import Inventory, ShardReport
    from llmgw.schemas.payloads import ShardPlacement

    model = Model.model_validate({"name": "mixed", "scaling": {"max": 2}, "profiles": [
        {"name": "cpu", "engine": "llamacpp", "source": "file:///m.gguf"},
        {"name": "gpu", "engine": "vllm", "source": "org/m"}]})
    engine = async_engine(database_url)
    try:
        async with engine.begin() as conn:
            await catalog_repo.apply_catalog(conn, Catalog(models=[model]))
            await fleet_repo.upsert_node(conn, "n1", "boot", Inventory())
            for rid, profile, port in (("r-cpu", "cpu", 9), ("r-gpu", "gpu", 10)):
                url = f"http://127.0.0.1:{port}"
                await fleet_repo.create_replica(conn, rid, "mixed", profile, [ShardPlacement(node_id="n1")])
                await fleet_repo.update_shard(conn, "n1", ShardReport(shard_id=f"{rid}-r0", replica_id=rid, model="mixed",
                                                                      profile=profile, state="ready", endpoint=url))
                await fleet_repo.transition_replica(conn, rid, "ready", endpoint=url)
        table = RouteTable(engine, 15.0)
        await table.refresh()
        kinds = {ep.replica_id: ep.kind for ep in table.resolve("mixed").endpoints}
        assert kinds == {"r-cpu": NO_CACHE, "r-gpu": SALTED}
    finally:
        await engine.dispose()


async def test_the_proxy_sends_each_engine_its_own_form(monkeypatch):
    """Through the real proxy and upstream client to a recording engine: one model with a llama.cpp replica
    and a vLLM one (kinds as the route table gives them); a tenant's request reaches the llama.cpp replica
    with `cache_prompt: false` and no salt, the vLLM one with its tenant's salt; a fallback-free retry to
    the other replica gets that replica's form."""
    from llmgw.gateway.admission import Gates
    from llmgw.gateway.balancer import Balancer
    from llmgw.gateway.demand import Demand
    from llmgw.gateway.proxy import Proxy
    from llmgw.gateway.routes import Endpoint, ModelRoute, RouteTable
    from llmgw.gateway.upstream import Upstream, parse_target
    from llmgw.catalog.context import prompt_bound
    from llmgw.telemetry import GatewayMetrics
    from tests.fake_engine import FakeEngines

    fake = await FakeEngines().start()
    upstream = Upstream(10)
    try:
        model = Model(name="mixed", endpoints=["http://unused"])
        routes = RouteTable(None, 15.0)  # type: ignore[arg-type]
        eps = [Endpoint("r-cpu", fake.url("echo"), "n1", parse_target(fake.url("echo")), kind=NO_CACHE),
               Endpoint("r-gpu", fake.url("echo"), "n1", parse_target(fake.url("echo")), kind=SALTED)]
        routes.models = {"mixed": ModelRoute(model, prompt_bound(model), endpoints=eps)}
        routes.names = {"mixed": "mixed"}
        salts = Salts(b"k" * 32)
        proxy = Proxy(routes, Demand(None, routes, None, 1.0), Gates(), Balancer(), upstream,  # type: ignore[arg-type]
                      GatewayMetrics(), isolation=Isolation(salts, lambda: True))
        body = json.dumps({"model": "mixed", "messages": [{"role": "user", "content": "hi"}]}).encode()

        async def call(account) -> None:
            sent = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                return sent.pop() if sent else await asyncio.sleep(3600)

            async def send(msg):
                if msg["type"] == "http.response.start":
                    assert msg["status"] == 200

            await proxy.handle({"type": "http", "path": "/v1/chat/completions", "method": "POST", "headers": []},
                               receive, send, account)

        fake.state["bodies"].clear()
        for _ in range(2):  # least outstanding with ties rotating: one request to each replica
            await call(_Account("ml"))
        got = sorted((b for _, b in fake.state["bodies"]), key=lambda b: "cache_salt" in b)
        assert got[0].get("cache_prompt") is False and "cache_salt" not in got[0]
        assert got[1]["cache_salt"] == salts.salt("ml") and "cache_prompt" not in got[1]
        fake.state["bodies"].clear()
        for _ in range(2):  # no tenant: no salt; llama.cpp still reads no cache while tenants exist
            await call(None)
        got = sorted((b for _, b in fake.state["bodies"]), key=lambda b: "cache_prompt" in b)
        assert "cache_salt" not in got[0] and "cache_prompt" not in got[0] and got[1]["cache_prompt"] is False
    finally:
        await upstream.close()
        await fake.close()
