"""The gateway's pure rules, one by one (the same rules go through real HTTP in test_gateway_api.py):
guard verdicts, engine errors in the envelope, endpoint URLs, the concurrency gate, the breaker."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmgw.catalog.loader import CatalogError, parse_catalog
from llmgw.gateway.admission import Gate
from llmgw.gateway.balancer import Balancer
from llmgw.http.errors import APIError
from llmgw.gateway.guard import answer_text, conversation, verdict
from llmgw.gateway.openai_api import engine_error
from llmgw.gateway.routes import Endpoint
from llmgw.gateway.upstream import parse_target
from llmgw.schemas.catalog import Limits


@pytest.mark.parametrize("text,allowed", [
    ("safe", True), ("  Safe.", True), ("No", True), ("unsafe\nS1", False), ("Yes, it is harmful", False),
    ("", None), ("I cannot judge this", None),
])
def test_guard_verdicts(text, allowed):
    assert verdict(text)[0] is allowed


def test_guard_reads_the_answer_streamed_or_not_and_the_prompt_as_a_conversation():
    sse = b'data: {"choices":[{"delta":{"content":"un"}}]}\n\ndata: {"choices":[{"delta":{"content":"safe"}}]}\n\ndata: [DONE]\n\n'
    assert answer_text(sse, sse=True) == "unsafe"
    assert answer_text(json.dumps({"choices": [{"message": {"content": "hi"}}]}).encode(), sse=False) == "hi"
    assert answer_text(json.dumps({"choices": [{"text": "yo"}]}).encode(), sse=False) == "yo"
    assert conversation("/v1/completions", {"prompt": ["a", "b"]}) == [{"role": "user", "content": "a\nb"}]


def test_the_judge_reads_what_the_template_renders_and_all_the_answer_says():
    """Issue 36 (the real path: tests/test_gateway_api.py `test_the_guard_judges_tools_tool_calls_and_reasoning`)."""
    req = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "name": "bob", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}],
        "tools": [{"type": "function", "function": {"name": "x", "description": "desc"}}],
        "response_format": {"type": "json_object"}}
    convo = conversation("/v1/chat/completions", req)
    assert [m["role"] for m in convo] == ["system", "user", "assistant"]
    assert convo[1]["content"].startswith("[what the request offers the model: ") and '"desc"' in convo[1]["content"]
    assert '"json_object"' in convo[1]["content"] and convo[1]["content"].endswith("[bob]\nhi")
    assert convo[2]["content"] == '[tool call f: {"a": 1}]'
    assert conversation("/v1/completions", {"prompt": "a", "suffix": "z"}) == [{"role": "user", "content": "a\n[suffix: z]"}]
    whole = {"choices": [{"message": {"content": None, "reasoning_content": "hmm",
                                      "tool_calls": [{"function": {"name": "rm", "arguments": "-rf"}}]}}]}
    assert answer_text(json.dumps(whole).encode(), sse=False) == "[reasoning: hmm]\n[tool call rm: -rf]"
    events = [{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "rm", "arguments": "-r"}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "f /"}}]}}]}]
    sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    assert answer_text(sse, sse=True) == "[tool call rm: -rf /]"  # a streamed call's pieces put together


def test_engine_errors_keep_a_4xx_message_and_hide_a_5xx_body():
    vllm = json.dumps({"object": "error", "message": "too long", "type": "BadRequestError", "param": "max_tokens",
                       "code": 400}).encode()
    err = engine_error(400, vllm)
    assert (err.status, err.message, err.param) == (400, "too long", "max_tokens")
    err = engine_error(500, b"Traceback (most recent call last): secret path")
    assert err.status == 502 and "Traceback" not in err.message and "secret" not in err.message
    err = engine_error(503, b"")
    assert err.status == 503 and err.headers["Retry-After"]
    assert set(json.loads(engine_error(404, b"<html>nope</html>").body())["error"]) == {"message", "type", "param", "code"}
    llama = json.dumps({"error": {"code": 501, "message": "This server does not support embeddings. Start it with "
                                  "`--embeddings`", "type": "not_supported_error"}}).encode()
    err = engine_error(501, llama)
    assert (err.status, err.code) == (400, "engine_unsupported") and "--embeddings" in err.message
    assert engine_error(501, b"").status == 400


def test_endpoint_urls():
    t = parse_target("http://10.0.0.5:8000/v1/")
    assert (t.host, t.port, t.prefix) == ("10.0.0.5", 8000, "")
    assert parse_target("https://api.example.com/openai/v1").port == 443
    assert parse_target("https://api.example.com/openai/v1").prefix == "/openai"
    with pytest.raises(ValueError):
        parse_target("ftp://x")


async def test_gate_admits_the_limit_queues_in_order_and_refuses_beyond_the_queue():
    gate = Gate("m", Limits(max_concurrency=2, max_queue=2, queue_timeout_s=60))
    await gate.acquire()
    await gate.acquire()
    order: list[int] = []

    async def queued(i: int) -> None:
        await gate.acquire()
        order.append(i)

    waiting = [asyncio.create_task(queued(i)) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(APIError) as refused:
        await gate.acquire()
    assert refused.value.status == 429 and refused.value.headers["Retry-After"]
    gate.release()
    await asyncio.sleep(0)
    assert order == [0]
    gate.release()
    await asyncio.gather(*waiting)
    assert order == [0, 1] and gate.active == 2


async def test_gate_slot_of_a_cancelled_waiter_is_not_lost():
    gate = Gate("m", Limits(max_concurrency=1, max_queue=5, queue_timeout_s=60))
    await gate.acquire()
    gone = asyncio.create_task(gate.acquire())
    stays = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    gone.cancel()
    gate.release()
    await stays  # the cancelled waiter's turn passed on
    gate.release()
    assert gate.active == 0 and not gate.waiters


def test_breaker_opens_after_consecutive_failures_and_lets_one_trial_through():
    b = Balancer(failures=2, open_s=10)
    ep = Endpoint("r1", "http://x", "n", parse_target("http://x"))
    b.failed(ep, now=0)
    assert b.usable(ep, now=0)  # one failure: still closed
    b.failed(ep, now=0)
    assert not b.usable(ep, now=5)  # open
    assert b.pick([ep], set(), now=5) is None
    assert b.pick([ep], set(), now=11) is ep  # half-open: one trial ...
    assert b.pick([ep], set(), now=11) is None  # ... at a time
    b.succeeded(ep)
    assert b.usable(ep, now=11) and ep.failures == 0


def test_breaker_prefers_the_least_outstanding_endpoint():
    b = Balancer()
    a, c = (Endpoint(i, "http://x", "n", parse_target("http://x")) for i in ("a", "c"))
    a.outstanding = 3
    assert b.pick([a, c], set(), now=0) is c
    assert b.pick([a, c], {"c"}, now=0) is a


def test_catalog_guard_policy_must_name_a_guard_model():
    judge = {"name": "judge", "role": "guard", "endpoints": ["http://j"]}
    ok = parse_catalog({"models": [judge, {"name": "m", "endpoints": ["http://m"], "guard": {"model": "judge"}}]})
    assert ok.get("m").guard.check == ["request"]
    with pytest.raises(CatalogError, match="guard.model"):
        parse_catalog({"models": [{"name": "m", "endpoints": ["http://m"], "guard": {"model": "nope"}}]})
    with pytest.raises(CatalogError, match="role: guard"):
        parse_catalog({"models": [{"name": "x", "endpoints": ["http://x"]},
                                  {"name": "m", "endpoints": ["http://m"], "guard": {"model": "x"}}]})
    with pytest.raises(CatalogError, match="limits.max_concurrency"):
        parse_catalog({"models": [{"name": "m", "endpoints": ["http://m"], "limits": {"max_concurrency": 0}}]})


@pytest.mark.parametrize("text,said", [
    ("http://127.0.0.1:18082/files/nope.gguf: HTTP 404 (no such file)", "…/nope.gguf: HTTP 404 (no such file)"),
    ("https://user:token@hub.example/org/m/x.gguf?X-Amz-Signature=abc: HTTP 403", "…/x.gguf: HTTP 403"),
    ("killed by SIGILL (illegal instruction): /var/lib/llmgw/cache/ab12-m.gguf (rank 0 on n1)",
     "killed by SIGILL (illegal instruction): …/ab12-m.gguf (rank 0 on n1)"),
    ("could not reach 10.0.0.5:8000, nor [fe80::1]:80", "could not reach <an address>, nor <an address>"),
    ("see http://10.0.0.1:9/.", "see <an address>."),
    ("needs 2 GPUs; node-a has 1/2 free (tp/pp 2/1)", "needs 2 GPUs; node-a has 1/2 free (tp/pp 2/1)"),
])
def test_the_fleets_addresses_and_paths_never_reach_a_client(text, said):
    from llmgw.security.logtext import for_client

    assert for_client(text) == said


def test_a_removed_models_series_wait_for_its_last_request():
    """Forgotten while a request still holds it, its in-flight gauge would come back at -1 when the request
    ends; so its series stay until it holds none (the next route refresh forgets them)."""
    from llmgw.telemetry import GatewayMetrics

    m = GatewayMetrics()
    for name in ("kept", "gone"):
        m.begin(name)
        m.route_gauges(name, 1, 0, 0)
    m.end("kept")
    m.observe("kept", 200, 0.1)
    m.forget({"kept"})
    assert 'model="gone"' in m.render().decode()  # one request still in flight
    m.end("gone")
    m.observe("gone", 200, 0.1)
    m.forget({"kept"})
    text = m.render().decode()
    assert 'model="gone"' not in text and 'llmgw_in_flight{model="kept"} 0.0' in text
    assert 'llmgw_requests_total{model="kept",status="200"} 1.0' in text


@pytest.mark.parametrize("body", [
    {"error": {"code": 400, "type": "exceed_context_size_error",
               "message": "request (26031 tokens) exceeds the available context size (2048 tokens), try increasing it"}},
    {"object": "error", "type": "BadRequestError", "param": None, "code": 400,
     "message": "This model's maximum context length is 2048 tokens. However, you requested 3000 tokens."},
    {"object": "error", "type": "BadRequestError", "param": None, "code": 400,
     "message": "The input (3000 tokens) is longer than the model's context length (2048 tokens)."},
])
def test_each_engines_context_refusal_gets_openais_code(body):
    err = engine_error(400, json.dumps(body).encode())
    assert err.status == 400 and err.code == "context_length_exceeded", err.body()
    assert "try increasing it" not in err.message and "2048 tokens" in err.message
    assert engine_error(400, json.dumps({"error": {"message": "bad temperature"}}).encode()).code == "engine_refused"
