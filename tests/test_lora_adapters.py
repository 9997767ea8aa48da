"""LoRA adapters through the real path (issue 40): a catalog applied with adapters on a sim base, the
control plane placing a real sim engine through a real node worker, the real gateway loading each adapter
into it with vLLM's runtime call behind the engine key, routing each request to its adapter (the sim's
marker), evicting the least recently used past `max_loras`, refusing a tenant the adapter does not allow,
and counting usage per adapter (`ctl usage --by model`)."""

from __future__ import annotations

import json

import httpx
import psycopg
import pytest

from tests.helpers import wait_until
from tests.test_tenants import auth, chat, create_key, create_tenant

pytestmark = pytest.mark.integration

CATALOG = {"models": [{
    "name": "base", "scaling": {"min": 1, "max": 1},
    "profiles": [{"engine": "sim", "max_loras": 2, "args": ["--tokens-per-second", "0", "--lora-load-s", "0.3"]}],
    "adapters": [{"name": "sql", "source": "/adapters/sql", "tenants": ["acme"]},
                 {"name": "law", "source": "/adapters/law", "version": "2"},
                 {"name": "med", "source": "/adapters/med"}]}]}


def held(db: str) -> set[str]:
    with psycopg.connect(db) as conn:
        return {r[0] for r in conn.execute("SELECT adapter FROM replica_adapters").fetchall()}


def test_two_adapters_answer_by_name_a_third_evicts_the_lru_a_tenant_is_refused_and_usage_is_per_adapter(
        control_plane, database_url):
    cp = control_plane
    cp.env["LLMGW_ROUTE_REFRESH_S"] = "0.5"
    cp.env["LLMGW_USAGE_SYNC_S"] = "0.2"
    cp.start()
    create_tenant(cp, "acme")
    create_tenant(cp, "other")
    acme, other = create_key(cp, "acme-1", "acme"), create_key(cp, "other-1", "other")
    r = cp.apply(CATALOG)
    assert r.status_code == 200, r.text
    cp.agent("node-a")
    (replica,) = cp.wait_replicas("base", "ready", 1, timeout_s=60)

    last: list[httpx.Response] = []

    def ask(model: str, key: str = acme) -> tuple[int, dict]:
        def once():
            last[:] = [httpx.post(cp.gateway + "/v1/chat/completions", json=chat(model, max_tokens=3),
                                  headers=auth(key), timeout=30)]
            # (a 503 while the route table has no replica yet; an adapter's load failing is the answer)
            loading = last[0].status_code == 503 and last[0].json()["error"]["code"] != "adapter_load_failed"
            return None if loading else last[0]
        resp = wait_until(once, timeout_s=20, what=f"an answer for {model}", why=lambda: last[0].text)
        return resp.status_code, resp.json()

    status, out = ask("sql")
    assert status == 200, out
    assert out["model"] == "sql" and out["system_fingerprint"] == "lora:sql"  # the sim's marker
    status, out = ask("law")
    assert status == 200 and out["model"] == "law" and out["system_fingerprint"] == "lora:law", out
    status, out = ask("base")
    assert status == 200 and out["model"] == "base" and "system_fingerprint" not in out, out
    assert held(database_url) == {"sql", "law"}
    assert ask("sql")[0] == 200  # sql used last: law is the least recently used
    status, out = ask("med")  # a third past max_loras 2: law is unloaded, med loaded
    assert status == 200 and out["system_fingerprint"] == "lora:med", out
    assert held(database_url) == {"sql", "med"}
    # Back again, streamed: sql is now the least recently used; the stream comes from law.
    with httpx.stream("POST", cp.gateway + "/v1/chat/completions", json=chat("law", max_tokens=3, stream=True),
                      headers=auth(acme), timeout=30) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events and all(e["model"] == "law" and e["system_fingerprint"] == "lora:law" for e in events), events

    # The engine loses an adapter behind the gateway's back (as a restarted engine would): its 404 makes the
    # gateway load it again and send the request once more.
    (spec,) = [json.loads(p.read_text()) for p in (cp.state / "shards" / "node-a").glob("*.json")]
    r = httpx.post(spec["endpoint"] + "/v1/unload_lora_adapter", json={"lora_name": "law"},
                   headers={"Authorization": f"Bearer {spec['api_key']}"}, timeout=10)
    assert r.status_code == 200, r.text
    status, out = ask("law")
    assert status == 200 and out["system_fingerprint"] == "lora:law", out
    server = next(p for p in cp.procs if p.name == "server").log()
    assert "answered 404 for adapter law; loading it again" in server, server[-3000:]
    assert held(database_url) == {"med", "law"}

    # Which replica holds which adapter: `ctl models` and `ctl explain` (an adapter's name explains its base).
    out = cp.ctl("models", "-o", "json")
    assert out.returncode == 0, out.stderr
    view = next(m for m in json.loads(out.stdout) if m["name"] == "base")
    assert view["adapters"] == {"sql": [], "law": [replica["id"]], "med": [replica["id"]]}
    out = cp.ctl("explain", "sql")
    assert out.returncode == 0, out.stderr
    assert f"law@2: loaded in {replica['id'][:8]}" in out.stdout, out.stdout
    assert "sql [tenants acme]: loaded in no replica" in out.stdout, out.stdout

    # A tenant the adapter does not allow gets 403 naming it; an adapter without a list serves it.
    resp = httpx.post(cp.gateway + "/v1/chat/completions", json=chat("sql"), headers=auth(other), timeout=30)
    assert resp.status_code == 403, resp.text
    err = resp.json()["error"]
    assert err["code"] == "adapter_not_allowed" and "`sql`" in err["message"] and err["param"] == "model"
    assert ask("law", other)[0] == 200

    # /v1/models lists adapters with their base, each tenant the ones it may use.
    listed = {m["id"]: m.get("parent") for m in httpx.get(cp.gateway + "/v1/models", headers=auth(other)).json()["data"]}
    assert listed == {"base": None, "law": "base", "med": "base"}
    one = httpx.get(cp.gateway + "/v1/models/sql", headers=auth(acme)).json()
    assert one["id"] == "sql" and one["parent"] == "base"

    def by_model() -> dict[str, int]:
        out = cp.ctl("usage", "--tenant", "acme", "--by", "model", "-o", "json")
        assert out.returncode == 0, out.stderr
        return {r["model"]: r["requests"] for r in json.loads(out.stdout)["rows"]}
    wait_until(lambda: by_model() == {"sql": 2, "law": 3, "base": 1, "med": 1}, timeout_s=10,
               what="usage per adapter", why=by_model)
