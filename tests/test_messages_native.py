"""Anthropic Messages passed through to engines that serve them, translated for the others (issue 41,
gateway/dialects.py), through the real path: a control plane with Temporal, an agent running sim engines
(which serve `/v1/messages` from llmgw 0.2.0; `--engine-version 0.1.0` makes one an older engine that does
not), a static sim endpoint (whose engine is not known: translated), and the unmodified `anthropic` client.

A passed-through answer is told from a translated one by its id: the sim's own Messages answer says
`msg_sim_…`, a translation says `msg_` + the chat id (`msg_chatcmpl-…`).
"""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import pytest

from llmgw.dev.procs import free_port, stop_process, wait_port
from tests.fleet import sim_spec
from tests.helpers import ControlPlane, wait_until
from tests.test_doors import sse_events
from tests.test_tenants import Sim, create_key, create_tenant, usage_rows

pytestmark = pytest.mark.integration

SIM = {"engine": "sim", "args": ["--tokens-per-second", "0"]}
NATIVE, TRANSLATED = "msg_sim_", "msg_chatcmpl-"
HI = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, module_database_url, temporal):
    ns = temporal.free_namespaces.pop(0)
    static = Sim("mixed")
    cp = ControlPlane(tmp_path_factory.mktemp("native"), module_database_url, temporal.address,
                      LLMGW_TEMPORAL_NAMESPACE=ns, LLMGW_ROUTE_REFRESH_S="0.5")
    try:
        wait_port(static.port, 30, static.proc, "sim engine")
        cp.start()
        cp.agent("node-a", simulate=sim_spec(gpus=0, memory_gb=64))
        cp.wait_nodes("node-a")
        one = {"min": 1, "max": 1}
        r = cp.apply({"models": [
            {"name": "new", "aliases": ["new-alias"], "scaling": one, "profiles": [SIM]},
            {"name": "old", "scaling": one, "profiles": [{**SIM, "args": SIM["args"] + ["--engine-version", "0.1.0"]}]},
            {"name": "mixed", "scaling": one, "profiles": [SIM], "endpoints": [static.url]},
            {"name": "dead-to-new", "endpoints": [f"http://127.0.0.1:{free_port()}"], "fallbacks": ["new"]},
            {"name": "cold", "scaling": {"min": 0, "max": 1, "idle_timeout": 600}, "profiles": [SIM]},
        ]})
        assert r.status_code == 200, r.text
        for name in ("new", "old", "mixed"):
            cp.wait_replicas(name, timeout_s=60)
        create_tenant(cp, "nat")
        create_tenant(cp, "nat-tight", tokens_per_day=30)
        cp.key = create_key(cp, "nat-1", "nat")  # type: ignore[attr-defined]
        cp.tight = create_key(cp, "nat-tight-1", "nat-tight")  # type: ignore[attr-defined]
        cp.db = module_database_url  # type: ignore[attr-defined]
        for key in (cp.key, cp.tight):  # type: ignore[attr-defined]
            wait_until(lambda key=key: httpx.get(cp.gateway + "/v1/models", headers={"x-api-key": key},
                                                 timeout=10).status_code == 200, timeout_s=20, what="the new keys")
        wait_until(lambda: "mixed" in httpx.get(cp.gateway + "/v1/models", headers={"x-api-key": cp.key},  # type: ignore[attr-defined]
                                                timeout=10).text, timeout_s=20, what="the catalog")
        yield cp
    finally:
        cp.stop()
        stop_process(static.proc)


def client(cp: ControlPlane, key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cp.gateway, api_key=key or cp.key, max_retries=0)  # type: ignore[attr-defined]


def _create_and_stream(cp: ControlPlane, model: str, n: int = 3) -> tuple:
    c = client(cp)
    msg = c.messages.create(model=model, max_tokens=n, system="be brief", messages=HI)
    with c.messages.stream(model=model, max_tokens=n, messages=HI) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    return msg, text, final


async def test_an_engine_that_speaks_messages_gets_them_as_they_came_and_an_older_one_a_translation(fleet):
    cp = fleet
    for model, marker in (("new", NATIVE), ("old", TRANSLATED)):
        msg, text, final = await asyncio.to_thread(_create_and_stream, cp, model)
        assert msg.id.startswith(marker) and final.id.startswith(marker), (model, msg.id, final.id)
        assert msg.content[0].text.split() == ["α", "β", "γ"] and text.split() == ["α", "β", "γ"]
        assert msg.stop_reason == final.stop_reason == "max_tokens" and msg.model == model
        assert msg.usage.output_tokens == final.usage.output_tokens == 3 and msg.usage.input_tokens > 0
    # The wire: Anthropic's sequence, with the event type no client knows (the sim sends `sim_note`) dropped.
    async with httpx.AsyncClient(timeout=20) as h:
        r = await h.post(cp.gateway + "/v1/messages", headers={"authorization": f"Bearer {cp.key}"}, json={
            "model": "new-alias", "max_tokens": 2, "stream": True, "messages": HI})
    assert r.status_code == 200, r.text
    events = sse_events(r.content)
    assert [k for k, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["id"].startswith(NATIVE) and start["model"] == "new"  # the alias sent as the serving name
    # Usage from the engine's Anthropic `usage`, counted once per request: 3 requests of `new` (the alias's
    # under its model), 3 + 3 + 2 tokens out; 2 of `old` from its translation, 3 + 3.
    def counted():
        return {row[1]: (row[2], row[4]) for row in usage_rows(cp, "nat")}
    wait_until(lambda: {m: c for m, c in counted().items() if m in ("new", "old")} == {"new": (3, 8), "old": (2, 6)},
               timeout_s=10, what="usage of the Messages requests", why=counted)


async def test_replicas_of_one_model_each_get_what_they_speak(fleet):
    ids = []
    for _ in range(6):  # least outstanding, ties taken in turn: both replicas answer
        msg = await asyncio.to_thread(client(fleet).messages.create, model="mixed", max_tokens=2, messages=HI)
        assert msg.content[0].text.split() == ["α", "β"] and msg.usage.output_tokens == 2
        ids.append(msg.id)
    assert any(i.startswith(NATIVE) for i in ids) and any(i.startswith(TRANSLATED) for i in ids), ids


async def test_fallbacks_budgets_refusals_and_a_cold_start_apply_to_a_passed_through_request(fleet):
    cp = fleet
    served = await asyncio.to_thread(client(cp).messages.create, model="dead-to-new", max_tokens=2, messages=HI)
    assert served.id.startswith(NATIVE) and served.content[0].text.split() == ["α", "β"]
    # 30 tokens a day: max_tokens 1000 is cut to what the budget leaves before the engine sees it.
    tight = await asyncio.to_thread(client(cp, cp.tight).messages.create, model="new", max_tokens=1000, messages=HI)
    assert tight.id.startswith(NATIVE) and 0 < tight.usage.output_tokens < 30
    # The gateway's own checks, in Anthropic's envelope, before any engine.
    with pytest.raises(anthropic.BadRequestError) as bad:
        await asyncio.to_thread(client(cp).messages.create, model="new", max_tokens=0, messages=HI)
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        await asyncio.to_thread(client(cp, "sk-wrong").messages.create, model="new", max_tokens=2, messages=HI)
    # No replica yet: the stream is held through the load, then passed through.
    def cold() -> tuple[str, str]:
        with client(cp).messages.stream(model="cold", max_tokens=2, messages=HI) as stream:
            return "".join(stream.text_stream), stream.get_final_message().id
    text, mid = await asyncio.to_thread(cold)
    assert text.split() == ["α", "β"] and mid.startswith(NATIVE)
