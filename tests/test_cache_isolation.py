"""Cache isolation and prefix-aware balancing through the real path (issue 37): a real `llmgw server`, tenants' keys made through the
admin API, and real sim engine processes with a prefix cache and a prefill time (`--prefix-cache-blocks`,
`--prefill-tokens-per-second`) as static endpoints. A prompt sent again by the same tenant hits the cache
(`usage.prompt_tokens_details.cached_tokens`, and a shorter time to first token); the same prompt from
another tenant, or from a key of no tenant, finds nothing; a model with `cache_isolation: shared` shares.
A model with `balancing: prefix` sends a system prompt's requests to one replica, and the gateway's trace
(`LLMGW_TRACING=file:...`) says why.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import httpx
import pytest

from llmgw.dev.procs import free_port, stop_process, wait_port
from tests.helpers import ControlPlane, wait_until
from tests.test_tenants import auth, create_key, create_tenant

pytestmark = pytest.mark.integration

PREFILL_TOKENS_PER_S = 4000  # 800 words uncached: 0.2 s before the first token
WORDS = 800


def sim(model: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmgw.engines.sim_server", "--port", str(port), "--model", model,
                             "--tokens-per-second", "0", "--prefix-cache-blocks", "4096",
                             "--prefill-tokens-per-second", str(PREFILL_TOKENS_PER_S)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


@pytest.fixture(scope="module")
def plane(tmp_path_factory, module_database_url):
    sims = {m: sim(m) for m in ("iso", "iso-shared", "px-0", "px-1", "px-2", "iso-judge", "iso-guarded")}
    tmp = tmp_path_factory.mktemp("isolation")
    cp = ControlPlane(tmp, module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_ROUTE_REFRESH_S="0.5", LLMGW_TRACING=f"file:{tmp / 'traces'}")
    cp.traces = tmp / "traces"  # type: ignore[attr-defined]
    try:
        for m, (proc, port) in sims.items():
            wait_port(port, 30, proc, f"sim engine {m}")
        cp.start(worker=False)
        r = cp.apply({"models": [
            {"name": "iso", "endpoints": [f"http://127.0.0.1:{sims['iso'][1]}"]},
            {"name": "iso-shared", "endpoints": [f"http://127.0.0.1:{sims['iso-shared'][1]}"],
             "cache_isolation": "shared"},
            {"name": "iso-judge", "role": "guard", "endpoints": [f"http://127.0.0.1:{sims['iso-judge'][1]}"]},
            {"name": "iso-guarded", "endpoints": [f"http://127.0.0.1:{sims['iso-guarded'][1]}"],
             "guard": {"model": "iso-judge"}},
            {"name": "px", "balancing": "prefix", "endpoints": [f"http://127.0.0.1:{sims[f'px-{i}'][1]}" for i in range(3)]},
        ]})
        assert r.status_code == 200, r.text
        for t in ("red", "blue"):
            create_tenant(cp, t)
        cp.keys = {t: create_key(cp, t + "-1", t) for t in ("red", "blue")}  # type: ignore[attr-defined]
        cp.keys["plain"] = create_key(cp, "plain")  # type: ignore[attr-defined]
        for k in cp.keys.values():  # type: ignore[attr-defined]
            wait_until(lambda: httpx.get(cp.gateway + "/v1/models", headers=auth(k), timeout=10).status_code == 200,
                       timeout_s=10, what="the gateway knowing the key")
        cp.sims = {m: f"http://127.0.0.1:{port}" for m, (_, port) in sims.items()}  # type: ignore[attr-defined]
        yield cp
    finally:
        cp.stop()
        for proc, _ in sims.values():
            stop_process(proc)


def prompt() -> str:
    """A prompt no other test sends (the cache outlives each test)."""
    return " ".join(f"w{random.randrange(10**9)}" for _ in range(WORDS))


async def ask(c: httpx.AsyncClient, cp: ControlPlane, who: str, model: str, text, **kw) -> tuple[int, float]:
    """Stream one chat; (cached tokens the engine reported, seconds to the first event)."""
    body = {"model": model, "messages": [{"role": "system", "content": text}, {"role": "user", "content": kw.pop("user", "hi")}],
            "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 2, **kw}
    t = time.perf_counter()
    ttft, usage = None, None
    async with c.stream("POST", cp.gateway + "/v1/chat/completions", json=body,
                        headers=auth(cp.keys[who])) as r:  # type: ignore[attr-defined]
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ttft = ttft or time.perf_counter() - t
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
    assert usage is not None, "the stream carried no usage"
    return usage["prompt_tokens_details"]["cached_tokens"], ttft


async def test_a_prefix_hits_within_a_tenant_and_never_across_tenants(plane):
    cp = plane
    p = prompt()
    async with httpx.AsyncClient(timeout=30) as c:
        cached, miss = await ask(c, cp, "red", "iso", p)
        assert cached == 0
        cached, hit = await ask(c, cp, "red", "iso", p)
        assert cached >= WORDS - 16, cached  # every whole block of the system prompt
        assert miss >= 0.15 and hit < miss / 2, (miss, hit)  # the prefill skipped: time to first token
        assert (await ask(c, cp, "blue", "iso", p))[0] == 0  # another tenant: nothing found
        assert (await ask(c, cp, "plain", "iso", p))[0] == 0  # a key of no tenant: nothing either
        assert (await ask(c, cp, "blue", "iso", p))[0] >= WORDS - 16  # blue's own copy now
        # A client's own salt splits its tenant's cache; naming what it cannot know reaches no one's.
        assert (await ask(c, cp, "red", "iso", p, cache_salt="user-1"))[0] == 0
        assert (await ask(c, cp, "red", "iso", p, cache_salt="user-1"))[0] >= WORDS - 16
        assert (await ask(c, cp, "blue", "iso", p, cache_salt="user-1"))[0] == 0


async def test_a_shared_model_shares_its_cache_between_tenants(plane):
    cp = plane
    p = prompt()
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await ask(c, cp, "red", "iso-shared", p))[0] == 0
        assert (await ask(c, cp, "blue", "iso-shared", p))[0] >= WORDS - 16


async def test_content_parts_are_cached_and_isolated_like_text(plane):
    cp = plane
    parts = [{"type": "text", "text": prompt()}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await ask(c, cp, "red", "iso", parts))[0] == 0
        assert (await ask(c, cp, "red", "iso", parts))[0] >= WORDS - 16
        assert (await ask(c, cp, "blue", "iso", parts))[0] == 0


@pytest.mark.parametrize("salt", [123, "", ["a"], {"a": "b"}, True, "x" * 5000])
def test_a_tenants_cache_salt_of_the_wrong_kind_is_a_400_naming_it(plane, salt):
    cp = plane
    r = httpx.post(cp.gateway + "/v1/chat/completions", headers=auth(cp.keys["red"]), timeout=10,  # type: ignore[attr-defined]
                   json={"model": "iso", "messages": [{"role": "user", "content": "hi"}], "cache_salt": salt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"


def test_embeddings_are_not_salted(plane):
    """vLLM warns of an unknown field on each: embeddings reach no prefix cache worth a salt."""
    cp = plane
    r = httpx.post(cp.gateway + "/v1/embeddings", headers=auth(cp.keys["red"]), timeout=10,  # type: ignore[attr-defined]
                   json={"model": "iso", "input": "hi", "cache_salt": 5})
    assert r.status_code == 200, r.text  # the sim's embeddings ignore the field; the gateway did not read it


def test_the_sims_counters_show_the_hits(plane):
    """`sim:prefix_cache_hits_total`, in tokens as vLLM's `prefix_cache_hits`, after the tests above."""
    text = httpx.get(plane.sims["iso"] + "/metrics", timeout=10).text
    counts = {ln.split()[0]: int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("sim:prefix")}
    assert 0 < counts["sim:prefix_cache_hits_total"] < counts["sim:prefix_cache_queries_total"], counts


def prefix_counts(base: str) -> dict[str, int]:
    text = httpx.get(base + "/metrics", timeout=10).text
    return {ln.split()[0]: int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("sim:prefix")}


def test_a_guard_reads_a_tenants_prompt_under_the_tenants_salt(plane):
    """The judge is an engine with a prefix cache too: the prompt it reads for a tenant is salted as the
    tenant's own request is, so another tenant's same prompt finds nothing there (it had been sent unsalted:
    one cache across tenants). The sim's answer is no verdict, so the guard says it cannot judge (503); the
    judge was asked all the same."""
    cp, judge = plane, plane.sims["iso-judge"]  # type: ignore[attr-defined]
    text = prompt()

    def guarded(who: str) -> None:
        r = httpx.post(cp.gateway + "/v1/chat/completions", headers=auth(cp.keys[who]), timeout=30,  # type: ignore[attr-defined]
                       json={"model": "iso-guarded", "messages": [{"role": "user", "content": text}], "max_tokens": 4})
        assert r.status_code in (200, 503), r.text

    before = prefix_counts(judge)
    guarded("red")
    first = prefix_counts(judge)
    assert first["sim:prefix_cache_queries_total"] > before["sim:prefix_cache_queries_total"], first  # it was asked
    guarded("blue")
    crossed = prefix_counts(judge)
    assert crossed["sim:prefix_cache_hits_total"] == first["sim:prefix_cache_hits_total"], (first, crossed)
    guarded("red")
    again = prefix_counts(judge)
    assert again["sim:prefix_cache_hits_total"] > crossed["sim:prefix_cache_hits_total"], (crossed, again)


def route_spans(cp: ControlPlane) -> list[dict]:
    out = []
    for f in cp.traces.glob("*.jsonl"):  # type: ignore[attr-defined]
        out += [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
    return [x for x in out if x["name"] == "gateway route"]


async def test_prefix_balancing_keeps_a_prompts_requests_on_one_replica_and_traces_why(plane):
    """Six chats with one system prompt and different user messages, on three replicas: every one after the
    first finds the system prompt cached (least outstanding would have spread them over the three, and
    found it on one in three), and each routing choice is a span saying which replica and why."""
    cp = plane
    p = prompt()
    async with httpx.AsyncClient(timeout=30) as c:
        got = [(await ask(c, cp, "red", "px", p, user=f"question {i}"))[0] for i in range(6)]
        assert got[0] == 0 and all(n >= WORDS - 16 for n in got[1:]), got
        # Another tenant's copy of the prompt is a prefix of its own, homed on its own.
        assert (await ask(c, cp, "blue", "px", p))[0] == 0
    spans = wait_until(lambda: (lambda s: s if len(s) >= 7 else None)(
        [x for x in route_spans(cp) if x["attributes"]["llmgw.model"] == "px"]), timeout_s=10, what="7 route spans")
    reds = spans[:6] if len(spans) == 7 else spans[-7:-1]
    assert len({x["attributes"]["llmgw.replica"] for x in reds}) == 1, reds
    reasons = [x["attributes"]["llmgw.route.reason"] for x in reds]
    assert "a new prefix; homed on" in reasons[0] and all("its home" in r for r in reasons[1:]), reasons
    assert all(x["attributes"]["llmgw.balancing"] == "prefix" and x["service"] == "llmgw-server" for x in spans)
    others = [x for x in route_spans(cp) if x["attributes"]["llmgw.model"] == "iso"]
    assert others and all(x["attributes"]["llmgw.balancing"] == "least_outstanding"
                          and "least outstanding" in x["attributes"]["llmgw.route.reason"] for x in others)
