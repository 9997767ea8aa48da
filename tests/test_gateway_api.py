"""The gateway through real HTTP: a real `llmgw server` process in front of small engines that misbehave
on purpose (tests/fake_engine.py). One gateway and one catalog for the module; no Temporal, no nodes:
every model here is routed to static endpoints, or has no replica at all.

Covers the issue's "small inputs that must behave" that need no control plane, and the API's contract:
errors in the envelope, pass-through of unknown fields, aliases, fallbacks, retries, the breaker,
limits, guard policy, metrics, the official openai client.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import psycopg
import pytest
from openai import AsyncOpenAI

from llmgw.dev.procs import free_port
from tests.fake_engine import UTF8_TEXT, FakeEngines, RawEngine
from tests.helpers import ControlPlane

pytestmark = pytest.mark.integration

UPSTREAM_TIMEOUT_S = 3.0
BREAKER_FAILURES = 3
MAX_PROMPT_CHARS = 200_000  # the gateway's setting, for models that declare no context
PROMPT_LIMIT = 100  # `short-prompts`' limits.max_prompt_chars
SMALL_CONTEXT = 64  # `small-context`'s --max-model-len: prompts up to 64 × 32 characters


@pytest.fixture(scope="module")
async def engines():
    fe = await FakeEngines().start()
    try:
        yield fe
    finally:
        await fe.close()


@pytest.fixture(scope="module")
async def raw():
    engine = await RawEngine().start()
    try:
        yield engine
    finally:
        await engine.close()


def catalog(e: FakeEngines, frozen: str, dead: str, dead2: str = "http://127.0.0.1:9", raw: RawEngine | None = None) -> dict:
    sim_off = {"scaling": {"min": 0, "max": 0}, "profiles": [{"engine": "sim"}]}
    return {"models": [
        {"name": "echo", "aliases": ["echo-alias"], "endpoints": [e.url("echo")]},
        {"name": "org/echo-2", "endpoints": [e.url("echo") + "/v1"]},
        {"name": "nodone", "endpoints": [e.url("nodone")]},
        {"name": "utf8", "endpoints": [e.url("utf8")]},
        {"name": "lockstep", "endpoints": [e.url("lockstep")]},
        {"name": "midevent", "endpoints": [e.url("midevent")]},
        {"name": "messy", "endpoints": [e.url("messy")]},
        {"name": "shortbody", "endpoints": [e.url("shortbody")]},
        {"name": "streams-anyway", "endpoints": [e.url("streams_anyway")]},
        {"name": "garbage", "endpoints": [e.url("garbage")]},
        {"name": "cancel", "endpoints": [e.url("cancel")]},
        {"name": "breaks", "endpoints": [e.url("breaks")]},
        {"name": "stalls", "endpoints": [e.url("stalls")]},
        {"name": "limited", "endpoints": [e.url("delay")], "limits": {"max_concurrency": 4, "max_queue": 8}},
        {"name": "frozen", "endpoints": [frozen]},
        {"name": "flaky", "endpoints": [dead, e.url("echo")]},
        {"name": "busy", "endpoints": [e.url("busy503"), e.url("echo")]},
        {"name": "fail500", "endpoints": [e.url("fail500")]},
        {"name": "refuse400", "endpoints": [e.url("refuse400")]},
        {"name": "unsupported501", "endpoints": [e.url("unsupported501")]},
        {"name": "traceback501", "endpoints": [e.url("traceback501")]},
        *([{"name": f"raw-{b}", "endpoints": [raw.url(b)]} for b in ("extra", "late", "informational", "bighead", "ctltype", "obstype")]
          if raw else []),
        {"name": "held", "endpoints": [e.url("hold")], "limits": {"max_concurrency": 1, "max_queue": 4,
                                                                  "queue_timeout_s": 0.5}},
        {"name": "all-dead", "endpoints": [dead, dead2]},
        {"name": "judge", "role": "guard", "endpoints": [e.url("judge")]},
        {"name": "dead-judge", "role": "guard", "endpoints": [dead2]},
        {"name": "judged-by-the-dead", "endpoints": [e.url("echo")], "guard": {"model": "dead-judge"}},
        {"name": "guarded", "endpoints": [e.url("trigger")], "guard": {"model": "judge", "check": ["request", "response"]}},
        {"name": "answer-judged", "endpoints": [e.url("trigger")], "guard": {"model": "judge", "check": ["response"]}},
        {"name": "small-judge", "role": "guard", "endpoints": [e.url("judge")], "limits": {"max_prompt_chars": 50}},
        {"name": "judged-small", "endpoints": [e.url("echo")], "guard": {"model": "small-judge"}},
        {"name": "huge-judged", "endpoints": [e.url("huge")], "guard": {"model": "judge", "check": ["response"]}},
        {"name": "after-done", "endpoints": [e.url("afterdone")]},
        {"name": "key-mismatch", "endpoints": [e.url("auth401"), e.url("echo")]},
        {"name": "only-401", "endpoints": [e.url("auth401")]},
        {"name": "engine-429", "endpoints": [e.url("busy429")]},
        {"name": "engine-429-wait", "endpoints": [e.url("busy429wait")]},
        {"name": "engine-429-odd", "endpoints": [e.url("busy429odd")]},
        {"name": "engine-503-wait", "endpoints": [e.url("busy503wait")]},
        {"name": "primary-to-short", "fallbacks": ["short-prompts"], **sim_off},
        {"name": "dead-to-limited", "endpoints": [dead], "fallbacks": ["limited"]},
        {"name": "gate-fb", "endpoints": [e.url("hold")], "limits": {"max_concurrency": 1}},
        {"name": "dead-to-gate", "endpoints": [dead], "fallbacks": ["gate-fb"]},
        {"name": "media-public", "endpoints": [e.url("echo")], "limits": {"media_urls": "public"}},
        {"name": "media-listed", "endpoints": [e.url("echo")], "limits": {"media_urls": ["*.example.com", "localhost"]}},
        {"name": "leaky", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim"}]},
        {"name": "primary", "fallbacks": ["echo"], **sim_off},
        {"name": "fleet-model", **sim_off},
        {"name": "sim-on-demand", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim"}]},
        {"name": "short-prompts", "endpoints": [e.url("echo")], "limits": {"max_prompt_chars": PROMPT_LIMIT}},
        {"name": "removable", "endpoints": [e.url("echo")]},
        {"name": "text-gguf", "scaling": {"min": 0, "max": 1},
         "profiles": [{"engine": "llamacpp", "source": "mirror:text.gguf"}]},
        {"name": "small-context", "scaling": {"min": 0, "max": 1},
         "profiles": [{"engine": "vllm", "source": "org/small", "args": ["--max-model-len", str(SMALL_CONTEXT)]}]},
    ]}


@pytest.fixture(scope="module")
async def gw(tmp_path_factory, module_database_url, engines, raw):
    """The gateway's base URL; also `.cp` (the ControlPlane) and `.db` (its database URL)."""
    frozen = await engines.frozen()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    dead2 = f"http://127.0.0.1:{free_port()}"
    cp = ControlPlane(tmp_path_factory.mktemp("gw"), module_database_url, f"127.0.0.1:{free_port()}",
                      LLMGW_UPSTREAM_TIMEOUT_S=str(UPSTREAM_TIMEOUT_S), LLMGW_BREAKER_FAILURES=str(BREAKER_FAILURES),
                      LLMGW_BREAKER_OPEN_S="60", LLMGW_LOAD_WAIT_S="1", LLMGW_ROUTE_REFRESH_S="0.5",
                      LLMGW_MAX_PROMPT_CHARS=str(MAX_PROMPT_CHARS))
    try:
        await asyncio.to_thread(cp.start, worker=False)
        async with aiohttp.ClientSession() as s:
            async with s.post(cp.admin + "/admin/v1/catalog", json={"catalog": catalog(engines, frozen, dead, dead2, raw)}, headers=cp.admin_headers) as r:
                assert r.status == 200, await r.text()
            deadline = time.monotonic() + 10
            while True:  # the gateway reloads its routes on the catalog's change notification
                async with s.get(cp.gateway + "/v1/models") as r:
                    if len((await r.json())["data"]) == len(catalog(engines, frozen, dead, dead2, raw)["models"]):
                        break
                assert time.monotonic() < deadline, "the gateway never loaded the catalog"
                await asyncio.sleep(0.05)
        yield cp
    finally:
        await asyncio.to_thread(cp.stop)


async def post(gw: ControlPlane, path: str, body: dict, **kw) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + path, json=body, **kw) as r:
            return r.status, dict(r.headers), await r.json(content_type=None)


def chat(model: str, text: str = "hi", **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **kw}


def assert_envelope(body: dict, status: int) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in json.dumps(body)
    assert status != 500
    return err


# ---- streaming -------------------------------------------------------------------------------------

async def test_stream_read_as_raw_bytes_ends_with_done_and_a_blank_line(gw):
    async with aiohttp.ClientSession() as s:
        for model in ("echo", "nodone"):  # `nodone`'s engine forgets [DONE]: the gateway adds it
            async with s.post(gw.gateway + "/v1/chat/completions", json=chat(model, "a b c", stream=True)) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                assert "Content-Length" not in r.headers
                raw = await r.content.read()
            assert raw.endswith(b"\n\ndata: [DONE]\n\n"), raw[-80:]
            assert raw.count(b"data: [DONE]") == 1


async def test_multibyte_characters_split_across_writes_arrive_whole(gw):
    client = AsyncOpenAI(base_url=gw.gateway + "/v1", api_key="unused")
    stream = await client.chat.completions.create(model="utf8", messages=[{"role": "user", "content": "x"}], stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == UTF8_TEXT


async def test_chunks_arrive_as_the_engine_sends_them(gw, engines):
    """Lockstep: the engine sends its next chunk only once the client has received the previous one
    through the gateway. Any chunk the gateway held back would stop the exchange (no wall-clock bound)."""
    acks = engines.state["lockstep"] = asyncio.Queue()
    received = 0
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + "/v1/chat/completions", json=chat("lockstep", stream=True)) as r:
            while True:
                line = await asyncio.wait_for(r.content.readline(), 20)
                if line.startswith(b"data: {"):
                    assert f'"t{received} "'.encode() in line, line
                    received += 1
                    acks.put_nowait(received)
                elif line.startswith(b"data: [DONE]") or not line:
                    break
    assert received == 20


async def test_client_disconnect_cancels_the_engine_request(gw, engines):
    """The `cancel` engine streams for a minute unless cancelled: seeing it cancelled at all shows the
    gateway dropped the engine's connection when the client left (uvicorn drops writes to a gone client
    silently, so without that the relay would read on to the end)."""
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.gateway + "/v1/chat/completions", json=chat("cancel", stream=True))
        first = await r.content.readline()
        assert first.startswith(b"data: {")
        r.close()  # drops the connection
    deadline = time.monotonic() + 20
    while engines.state["cancelled_at"] is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert engines.state["cancelled_at"] is not None, "the engine never saw the request cancelled"
    assert engines.state["cancelled_at"] - engines.state["cancel_started_at"] < 50  # not at its own end


async def test_a_client_that_goes_away_is_counted_as_499(gw, engines):
    series = 'llmgw_requests_total{model="cancel",status="499"}'
    before = sample(await scrape(gw), series)
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.gateway + "/v1/chat/completions", json=chat("cancel", stream=True))
        assert (await r.content.readline()).startswith(b"data: {")
        r.close()
    deadline = time.monotonic() + 20
    while sample(await scrape(gw), series) != before + 1:
        assert time.monotonic() < deadline, f"{series} stayed at {before}"
        await asyncio.sleep(0.1)


async def test_an_engine_failing_mid_stream_ends_the_stream_with_an_error_event(gw):
    """Broken off, silent, or ended in the middle of an event: the client gets the complete events, one
    error event (what the openai client raises as an APIError) and exactly one [DONE], nothing partial."""
    for model, code in (("breaks", "engine_error"), ("stalls", "engine_timeout"), ("midevent", "engine_error")):
        began = time.monotonic()
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.gateway + "/v1/chat/completions", json=chat(model, stream=True)) as r:
                assert r.status == 200  # already sent with the first chunk
                raw = await r.content.read()
        # The read timeout ends a stall even where the model's stream_resume.stall_s (30 s) is longer: a
        # stream that could move nowhere had waited stall_s.
        assert time.monotonic() - began < UPSTREAM_TIMEOUT_S + 10, (model, time.monotonic() - began)
        assert raw.endswith(b"\n\n") and raw.count(b"[DONE]") == 1 and raw.endswith(b"data: [DONE]\n\n"), raw
        events = raw.decode().split("\n\n")[:-1]
        assert all(e.startswith("data: ") and "\n" not in e for e in events), raw  # whole events only
        assert events[0].startswith("data: {") and "partial" in events[0]
        error = json.loads(events[-2].removeprefix("data: "))
        assert error["error"]["code"] == code, raw
        assert all(json.loads(e.removeprefix("data: ")) for e in events[:-1]), raw  # nothing cut in half


async def test_a_stream_keeps_the_contract_whatever_the_engine_writes(gw):
    """`messy` writes an `event:` field, an `id:` line, a comment, garbage, two [DONE]s and data after
    them: the client gets only data events and comments, and one [DONE], last."""
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + "/v1/chat/completions", json=chat("messy", stream=True)) as r:
            assert r.status == 200
            raw = await r.content.read()
    assert raw.count(b"[DONE]") == 1 and raw.endswith(b"data: [DONE]\n\n"), raw
    for event in raw.split(b"\n\n")[:-1]:
        for line in event.split(b"\n"):
            assert line.startswith((b"data:", b":")), raw
    assert b"after done" not in raw and b"garbage" not in raw and b"event:" not in raw
    assert b'"one"' in raw and b'"two"' in raw and b": keep-alive" in raw


async def test_a_non_streaming_answer_is_one_json_body_or_a_502(gw):
    """Cut mid-body (Content-Length not reached), an event stream where JSON was asked, or garbage with a
    200: the client gets 502 in the envelope, never a short or foreign 200."""
    for model in ("shortbody", "streams-anyway", "garbage"):
        status, _, out = await post(gw, "/v1/chat/completions", chat(model))
        assert status == 502, (model, out)
        assert assert_envelope(out, status)["code"] == "engine_error"
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + "/v1/chat/completions", json=chat("echo")) as r:
            assert r.status == 200 and json.loads(await r.read())["object"] == "chat.completion"


# ---- errors ----------------------------------------------------------------------------------------

async def test_bad_requests_get_400_naming_the_field(gw):
    cases = [
        ("/v1/chat/completions", {"model": "echo"}, "messages"),
        ("/v1/chat/completions", {"model": "echo", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "echo", "messages": ["hi"]}, "messages[0]"),
        ("/v1/chat/completions", chat("echo", stream="yes"), "stream"),
        ("/v1/chat/completions", chat("echo", max_tokens=0), "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "model"),
        ("/v1/embeddings", {"model": "echo"}, "input"),
        ("/v1/completions", {"model": "echo"}, "prompt"),
        ("/v1/embeddings", {"model": "echo", "input": ["x"] * 2049}, "input"),  # OpenAI's ceiling: 2048
        ("/v1/completions", {"model": "echo", "prompt": [[1, 2]] * 2049}, "prompt"),
    ]
    for path, body, param in cases:
        status, _, out = await post(gw, path, body)
        assert status == 400, (path, body, out)
        assert assert_envelope(out, status)["param"] == param
    status, _, out = await post(gw, "/v1/embeddings", {"model": "echo", "input": ["x"] * 5000})
    assert "`input` holds 5,000 items; at most 2048 go in one request: send them in batches" == out["error"]["message"]
    for path, body in (("/v1/embeddings", {"model": "echo", "input": ["x"] * 2048}),
                       ("/v1/completions", {"model": "echo", "prompt": list(range(5000))})):  # one prompt of ids
        status, _, out = await post(gw, path, body)
        assert status == 200, (path, out)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + "/v1/chat/completions", data=b"{not json") as r:
            assert r.status == 400
            assert_envelope(await r.json(), r.status)


async def test_unknown_model_route_and_method_in_the_envelope(gw):
    status, _, out = await post(gw, "/v1/chat/completions", chat("no-such-model"))
    err = assert_envelope(out, status)
    assert status == 404 and err["code"] == "model_not_found" and "GET /v1/models lists" in err["message"]
    assert "Did you mean" not in err["message"]
    # Another case, an underscore for a dash, or a typo: the 404 names the model meant.
    for asked, meant in (("ECHO", "echo"), ("Org/Echo_2", "org/echo-2"), ("echo-alais", "echo-alias")):
        status, _, out = await post(gw, "/v1/chat/completions", chat(asked))
        assert status == 404 and f"Did you mean `{meant}`?" in assert_envelope(out, status)["message"], (asked, out)
    status, _, out = await post(gw, "/v1/chat/completions", chat("e" * 256))
    assert status == 404 and "Did you mean" not in assert_envelope(out, status)["message"]
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.gateway + "/v1/chat/completions") as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"
            assert_envelope(await r.json(), r.status)
        async with s.get(gw.gateway + "/v1/nothing-here") as r:
            assert r.status == 404
            assert_envelope(await r.json(), r.status)
        async with s.get(gw.gateway + "/v1/models/no/such/model") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        async with s.get(gw.gateway + "/v1/models/Echo") as r:
            assert r.status == 404 and "Did you mean `echo`?" in (await r.json())["error"]["message"]


async def test_engine_failures_become_envelopes_with_the_right_status(gw):
    status, _, out = await post(gw, "/v1/chat/completions", chat("fail500"))
    assert status == 502  # the engine's own text (a traceback here) stays in the gateway's log
    assert assert_envelope(out, status)["code"] == "engine_error"
    status, _, out = await post(gw, "/v1/chat/completions", chat("refuse400"))
    assert status == 400
    err = assert_envelope(out, status)
    assert err["message"] == "max_tokens is too large" and err["param"] == "max_tokens"
    status, _, out = await post(gw, "/v1/chat/completions", chat("unsupported501"))
    assert status == 400  # not a 5xx: OpenAI clients would retry it three times
    err = assert_envelope(out, status)
    assert err["code"] == "engine_unsupported" and "Start it with `--embeddings`" in err["message"]
    assert "in llmgw: add that flag to the model's profile `args`" in err["message"], err
    status, _, out = await post(gw, "/v1/chat/completions", chat("traceback501"))
    err = assert_envelope(out, status)  # a 501 that is not JSON: its text stays in the log
    assert status == 400 and err["code"] == "engine_unsupported", out
    assert "Traceback" not in err["message"] and "secret" not in err["message"]


async def test_an_engine_s_500s_never_open_the_breaker_for_everyone(gw):
    """A 500 may be the engine's answer to a malformed request (llama-server's to `tools: "x"`): counting it
    against the endpoint would let one client switch a model off for every other with a handful of bad
    requests. Each is the client's 502; none is a 503 "every replica failed recently"."""
    for _ in range(BREAKER_FAILURES + 2):
        status, _, out = await post(gw, "/v1/chat/completions", chat("fail500"))
        assert status == 502 and assert_envelope(out, status)["code"] == "engine_error", out
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.gateway + "/metrics") as r:
            assert 'llmgw_open_breakers{model="fail500"} 1.0' not in await r.text()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"model": "echo", "input": "x", "stream": True}, "stream"),
    ("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "x"}], "tools": "x"}, "tools"),
    ("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
    ("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": {"text": "x"}}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "echo", "messages": [{"role": "assistant", "tool_calls": "x"}]},
     "messages[0].tool_calls"),
])
async def test_shapes_engines_answer_500_to_are_400_naming_the_field(gw, path, body, param):
    status, _, out = await post(gw, path, body)
    err = assert_envelope(out, status)
    assert status == 400 and err["param"] == param, out


@pytest.mark.parametrize("path, model, says", [
    ("/v1/chat/completions", None, "`model` is required"),
    ("/v1/chat/completions", 5, "`model` must be a string, the name of a model from /v1/models, not a number"),
    ("/v1/chat/completions", ["echo"], "not an array"),
    ("/v1/chat/completions", "m" * 300, "longer than 256 characters"),
    ("/v1/messages", 5, "`model` must be a string"),
    ("/v1/responses", {"name": "echo"}, "not an object"),
])
async def test_a_model_that_is_not_a_name_is_refused_saying_what_was_sent(gw, path, model, says):
    """A `model` sent as a number (or an array, an object) is not "missing": the 400 says what it must be."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "input": "x"}
    if model is not None:
        body["model"] = model
    status, _, out = await post(gw, path, body)
    assert status == 400 and says in json.dumps(out), out


async def test_engine_text_reaches_the_log_escaped_and_without_url_secrets(gw):
    """An engine's 500 body (logged, never sent to the client) cannot forge log lines or leak a signed
    URL's token: newlines and escape sequences are written as escapes, the query string is redacted."""
    await post(gw, "/v1/chat/completions", chat("fail500"))
    log = next(p for p in gw.procs if p.name == "server").log()
    assert "FORGED 2099-01-01" in log and "https://bucket.example/w.gguf?<redacted>" in log
    assert not any(line.startswith("FORGED") for line in log.splitlines())
    assert "SECRET-SIG" not in log and "\x1b" not in log


async def test_frozen_engine_gets_504_within_the_timeout_and_spares_the_others(gw):
    async def frozen():
        t0 = time.monotonic()
        status, _, out = await post(gw, "/v1/chat/completions", chat("frozen"))
        return status, out, time.monotonic() - t0

    stuck = [asyncio.create_task(frozen()) for _ in range(BREAKER_FAILURES - 1)]
    for _ in range(3):  # while the frozen ones hang, the healthy model answers
        status, _, _ = await post(gw, "/v1/chat/completions", chat("echo"))
        assert status == 200
        assert not any(t.done() for t in stuck), "a healthy request waited for a frozen engine's timeout"
    for status, out, took in await asyncio.gather(*stuck):
        assert status == 504, out
        assert assert_envelope(out, status)["code"] == "engine_timeout"
        assert UPSTREAM_TIMEOUT_S - 0.2 < took < UPSTREAM_TIMEOUT_S + 30  # the timeout ended it, not a hang


async def test_a_request_that_waited_its_queue_timeout_gets_model_busy(gw, engines):
    """`held` allows one request at a time and waits 0.5 s for a slot: the second one gets 503
    `model_busy` with Retry-After while the first is held by its engine."""
    engines.state["release"].clear()
    first = asyncio.create_task(post(gw, "/v1/chat/completions", chat("held")))
    try:
        deadline = time.monotonic() + 20
        while engines.state["hits"]["hold"] < 1:  # the first one has its slot and is at the engine
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        status, headers, out = await post(gw, "/v1/chat/completions", chat("held"))
        assert status == 503 and int(headers["Retry-After"]) >= 1, out
        assert assert_envelope(out, status)["code"] == "model_busy"
        assert not first.done()
    finally:
        engines.state["release"].set()
    assert (await first)[0] == 200


async def test_every_breaker_open_gets_engine_unavailable(gw):
    """Both endpoints of `all-dead` refuse connections: 502 until their breakers open, then 503
    `engine_unavailable` with the seconds until the next trial, without trying them."""
    codes = []
    for _ in range(BREAKER_FAILURES + 2):
        status, headers, out = await post(gw, "/v1/chat/completions", chat("all-dead"))
        codes.append((status, assert_envelope(out, status)["code"]))
        if status == 503:
            break
    assert codes[0] == (502, "engine_error"), codes
    assert codes[-1] == (503, "engine_unavailable"), codes
    assert int(headers["Retry-After"]) >= 1
    assert "127.0.0.1" not in json.dumps(out)


async def test_a_guard_that_cannot_judge_gets_guard_unavailable(gw):
    status, headers, out = await post(gw, "/v1/chat/completions", chat("judged-by-the-dead"))
    assert status == 503 and int(headers["Retry-After"]) >= 1, out
    err = assert_envelope(out, status)
    assert err["code"] == "guard_unavailable" and "dead-judge" in err["message"]


async def test_error_bodies_never_name_an_engine_address(gw, engines):
    """A refused connection, a frozen engine, a broken answer: the client learns what failed, not where."""
    for model in ("all-dead", "breaks", "shortbody", "fail500"):
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.gateway + "/v1/chat/completions", json=chat(model)) as r:
                text = await r.text()
        assert "127.0.0.1" not in text and str(engines.port) not in text, (model, text)


async def test_abusive_json_gets_400_naming_the_field(gw):
    """Deep nesting, a 5,000-digit integer, NaN, an overflowing float, `n: 10000`, a huge `max_tokens`:
    400 `invalid_request_error` naming the field, never a 500."""
    cases = [
        (b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "max_tokens": ' + b"9" * 5000 + b"}",
         "max_tokens"),
        (b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
        (b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', "top_p"),
        (b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e30}', "max_tokens"),
        (b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "temperature": 1e999}', "temperature"),
        (b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "n": 10000}', "n"),
        (b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4294967296}', "max_tokens"),
        (b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "seed": 99999999999999999999}', "seed"),
        (b'{"model": "echo", "messages": [{"role": "user", "content": ' + b"[" * 5000 + b"]" * 5000 + b"}]}",
         "messages"),
        (b'{"model": "echo", "messages": [{"role": "user", "content": [1, 2, NaN]}]}', "messages[0].content[2]"),
    ]
    async with aiohttp.ClientSession() as s:
        for body, param in cases:
            async with s.post(gw.gateway + "/v1/chat/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                out = await r.json()
                assert r.status == 400, (body[:80], out)
                err = assert_envelope(out, r.status)
                assert err["type"] == "invalid_request_error" and err["param"] == param, (body[:80], err)
        deep = b"[" * 100_000 + b"]" * 100_000  # not an object, however deep: said so, not its depth
        async with s.post(gw.gateway + "/v1/chat/completions", data=deep, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and "must be a JSON object" in (await r.json())["error"]["message"]
        wide = b'{"model": "echo", "input": [' + b",".join([b"{}"] * 200_000) + b"]}"  # 1.2 MB of objects
        async with s.post(gw.gateway + "/v1/embeddings", data=wide, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and "objects and arrays" in (await r.json())["error"]["message"]


async def test_a_prompt_longer_than_the_model_takes_gets_400_and_never_reaches_an_engine(gw, engines):
    """The prompt bound (catalog/context.py): text is counted (images are not), a chat's messages together,
    each of a list of prompts on its own; longer than the model takes is 400 `context_length_exceeded`
    naming the field, and the engine never sees it."""
    parts = [{"type": "text", "text": "x" * 60}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                                     + "A" * 20_000}},
             {"type": "text", "text": "y" * (PROMPT_LIMIT - 60)}]
    fits = {"model": "short-prompts", "messages": [{"role": "user", "content": parts}]}
    status, _, out = await post(gw, "/v1/chat/completions", fits)
    assert status == 200, out  # exactly the limit, and 20,000 characters of image that are not text

    hits = engines.state["hits"]["echo"]
    over = [("/v1/chat/completions", {**fits, "messages": [*fits["messages"], {"role": "user", "content": "z"}]},
             "messages", PROMPT_LIMIT + 1),
            ("/v1/completions", {"model": "short-prompts", "prompt": ["short", "p" * (PROMPT_LIMIT + 5)]}, "prompt",
             PROMPT_LIMIT + 5),
            ("/v1/embeddings", {"model": "short-prompts", "input": "e" * (PROMPT_LIMIT * 10)}, "input", PROMPT_LIMIT * 10),
            ("/v1/chat/completions", chat("echo", "g" * (MAX_PROMPT_CHARS + 1)), "messages", MAX_PROMPT_CHARS + 1)]
    said = []
    for path, body, param, chars in over:
        status, _, out = await post(gw, path, body)
        err = assert_envelope(out, status)
        assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == param, (path, err)
        assert f"holds {chars:,} characters" in err["message"] and "Shorten the prompt" in err["message"], err
        said.append(err["message"])
    assert f"at most {PROMPT_LIMIT:,} (its `limits.max_prompt_chars`)" in said[0], said[0]
    assert f"at most {MAX_PROMPT_CHARS:,} (the gateway's `max_prompt_chars`)" in said[-1], said[-1]
    status, _, out = await post(gw, "/v1/completions", {"model": "short-prompts", "prompt": ["a" * PROMPT_LIMIT] * 3})
    assert status == 200, out  # each prompt of a list is its own
    assert engines.state["hits"]["echo"] == hits + 1  # only that one reached the engine


async def test_an_image_for_a_model_only_llamacpp_serves_gets_400_before_a_load(gw):
    """llama-server runs without `--mmproj` here (the policy refuses it), so it cannot read an image and
    answers 500, which a client retries: the gateway says 400 naming the part, before any load."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"model": "text-gguf", "messages": [{"role": "user", "content": "look"},
                                               {"role": "user", "content": [{"type": "text", "text": "this"}, image]}]}
    status, _, out = await post(gw, "/v1/chat/completions", body)
    err = assert_envelope(out, status)
    assert status == 400 and err["code"] == "unsupported_content" and err["param"] == "messages[1].content[1]", err
    assert "reads only text" in err["message"]
    text = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "this"}]}]}
    status, _, out = await post(gw, "/v1/chat/completions", text)
    assert status == 503 and out["error"]["code"] == "model_pending", out  # text goes on to be served
    status, _, out = await post(gw, "/v1/chat/completions", {**body, "model": "echo"})
    assert status == 200, out  # an engine elsewhere may read images: its own to judge


async def test_a_prompt_longer_than_the_declared_context_never_loads_the_model(gw, module_database_url):
    """`small-context` declares `--max-model-len 64` and has no replica: a prompt longer than 64 × 32
    characters is refused at once and records no demand (no load starts for it); a shorter one does."""
    def demand_at():
        with psycopg.connect(module_database_url, autocommit=True) as conn:
            row = conn.execute("SELECT demand_at FROM model_state WHERE name = 'small-context'").fetchone()
        return row[0] if row else None

    status, _, out = await post(gw, "/v1/chat/completions", chat("small-context", "c" * (SMALL_CONTEXT * 32 + 1)))
    err = assert_envelope(out, status)
    assert status == 400 and err["code"] == "context_length_exceeded", err
    assert f"at most {SMALL_CONTEXT * 32:,} (its context is {SMALL_CONTEXT} tokens a request)" in err["message"], err
    await asyncio.sleep(0.5)
    assert demand_at() is None
    status, _, out = await post(gw, "/v1/chat/completions", chat("small-context", "c" * (SMALL_CONTEXT * 32)))
    assert status == 503 and assert_envelope(out, status)["code"] == "model_pending", out
    deadline = time.monotonic() + 5
    while demand_at() is None:  # the one that fits asked for a load
        assert time.monotonic() < deadline, "a prompt that fits recorded no demand"
        await asyncio.sleep(0.05)


# ---- the upstream client ---------------------------------------------------------------------------

async def test_an_answer_nobody_asked_for_never_becomes_the_next_requests(gw):
    """`raw-extra` sends a second answer right after the first; `raw-late` sends one on the idle
    kept-alive connection. Neither ever reaches a client: each request gets its own answer."""
    for model in ("raw-extra", "raw-late"):
        texts = []
        for _ in range(3):
            status, _, out = await post(gw, "/v1/chat/completions", chat(model))
            assert status == 200, out
            texts.append(out["choices"][0]["message"]["content"])
            await asyncio.sleep(0.4)  # (`late`: the unasked answer arrives while the connection is pooled)
        assert not any("smuggled" in t for t in texts), (model, texts)


async def test_informational_answers_are_skipped(gw):
    """100 Continue and 103 Early Hints before the answer: the client gets the 200 that follows."""
    status, _, out = await post(gw, "/v1/chat/completions", chat("raw-informational"))
    assert status == 200, out
    assert out["choices"][0]["message"]["content"].startswith("answer ")


async def test_an_answer_with_oversized_headers_is_a_502(gw):
    status, _, out = await post(gw, "/v1/chat/completions", chat("raw-bighead"))
    assert status == 502 and assert_envelope(out, status)["code"] == "engine_error", out


# ---- routing ---------------------------------------------------------------------------------------

async def test_unknown_fields_pass_through_and_aliases_resolve(gw, engines):
    body = chat("echo-alias", extra_body_field={"nested": [1, "two"]}, seed=7)
    status, _, out = await post(gw, "/v1/chat/completions", body)
    assert status == 200, out
    received = out["received"]
    assert received["model"] == "echo"  # the alias is rewritten to the model's name ...
    assert received["extra_body_field"] == {"nested": [1, "two"]} and received["seed"] == 7  # ... nothing dropped
    async with aiohttp.ClientSession() as s:  # /v1/models names the alias, and when the model was applied
        async with s.get(gw.gateway + "/v1/models") as r:
            listed = {m["id"]: m for m in (await r.json())["data"]}
        async with s.get(gw.gateway + "/v1/models/echo-alias") as r:
            one = await r.json()
    assert listed["echo"]["llmgw"]["aliases"] == ["echo-alias"] and one["id"] == "echo" and one == listed["echo"]
    assert 0 < time.time() - listed["echo"]["created"] < 3600, listed["echo"]  # Unix seconds of its first apply


async def test_fallback_serves_while_the_model_has_no_replica(gw):
    status, _, out = await post(gw, "/v1/chat/completions", chat("primary", "hello"))
    assert status == 200, out
    assert out["received"]["model"] == "echo"
    assert out["choices"][0]["message"]["content"] == "echo: hello"


async def test_loading_is_said_only_while_a_replica_is_starting(gw, module_database_url):
    """Here no control worker runs, so nothing starts the on-demand model: the answer says so (pending),
    not "loading", which a client would retry for ever. With a replica starting, it is loading."""
    status, headers, out = await post(gw, "/v1/chat/completions", chat("sim-on-demand"))
    assert status == 503 and int(headers["Retry-After"]) > 0
    err = assert_envelope(out, status)
    assert err["code"] == "model_pending" and "no replica starting" in err["message"], err
    assert "loading" not in err["message"]
    with psycopg.connect(module_database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO replicas (id, model, profile, status) VALUES ('starting-1', 'sim-on-demand', "
                     "'default', 'starting')")
    try:
        status, headers, out = await post(gw, "/v1/chat/completions", chat("sim-on-demand"))
        err = assert_envelope(out, status)
        assert status == 503 and err["code"] == "model_loading" and "loading" in err["message"], err
        assert int(headers["Retry-After"]) > 0
    finally:
        with psycopg.connect(module_database_url, autocommit=True) as conn:
            conn.execute("DELETE FROM replicas WHERE id = 'starting-1'")


async def test_dead_and_busy_endpoints_are_retried_then_taken_out_by_the_breaker(gw):
    for model in ("flaky", "busy"):
        for _ in range(BREAKER_FAILURES + 3):
            status, _, out = await post(gw, "/v1/chat/completions", chat(model))
            assert status == 200, (model, out)
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.gateway + "/metrics") as r:
            text = await r.text()
    assert 'llmgw_open_breakers{model="flaky"} 1.0' in text
    assert 'llmgw_open_breakers{model="busy"} 1.0' in text
    assert 'llmgw_upstream_retries_total{model="flaky"}' in text


async def test_route_table_follows_replica_status_and_node_heartbeats(gw, engines):
    """Replicas come from Postgres: a Ready one is routed; Draining, or on a silent node, is not."""
    from sqlalchemy import func, update

    from llmgw.db import fleet_repo
    from llmgw.db.engine import async_engine
    from llmgw.db.tables import nodes, observers
    from llmgw.schemas.inventory import Inventory
    from llmgw.schemas.payloads import ShardPlacement

    engine = async_engine(gw.env["LLMGW_DATABASE_URL"])

    async def ready(conn, rid: str) -> None:  # as a replica becomes Ready: its node reports the endpoint, then its start
        from llmgw.schemas.inventory import ShardReport

        await fleet_repo.update_shard(conn, "n1", ShardReport(shard_id=f"{rid}-r0", replica_id=rid, model="fleet-model",
                                                              profile="default", state="ready", endpoint=engines.url("echo")))
        await fleet_repo.transition_replica(conn, rid, "ready", endpoint=engines.url("echo"))

    async def routed() -> bool:
        status, _, _ = await post(gw, "/v1/chat/completions", chat("fleet-model"))
        assert status in (200, 503)
        return status == 200

    async def eventually(want: bool) -> None:
        deadline = time.monotonic() + 3
        while await routed() != want:
            assert time.monotonic() < deadline, f"fleet-model routed={not want} for 3s"
            await asyncio.sleep(0.05)

    try:
        async with engine.begin() as conn:
            await fleet_repo.upsert_node(conn, "n1", "boot-1", Inventory())
            for rid in ("r1", "r2"):
                await fleet_repo.create_replica(conn, rid, "fleet-model", "default", [ShardPlacement(node_id="n1")])
                await ready(conn, rid)
        await eventually(True)
        async with engine.begin() as conn:
            await fleet_repo.transition_replica(conn, "r1", "draining")
        await eventually(True)  # r2 still serves
        async with engine.begin() as conn:
            await fleet_repo.transition_replica(conn, "r2", "draining")
        await eventually(False)  # both draining: no new requests
        async with engine.begin() as conn:
            await fleet_repo.create_replica(conn, "r3", "fleet-model", "default", [ShardPlacement(node_id="n1")])
            await ready(conn, "r3")
        await eventually(True)
        async with engine.begin() as conn:  # the node goes silent: Unreachable
            ten_minutes_ago = func.now() - func.make_interval(0, 0, 0, 0, 0, 10)
            await conn.execute(update(nodes).where(nodes.c.id == "n1").values(last_heartbeat=ten_minutes_ago))
            # ... while the node API has been there to hear it all along (its run of ticks began before), and
            # its worker was never seen polling while the control worker was reading the pollers (this
            # module runs no control worker: the test ticks for it): both witnesses silent.
            await conn.execute(update(observers).values(started_at=ten_minutes_ago))
            await fleet_repo.observer_tick(conn, fleet_repo.POLLERS, 15)
            await conn.execute(update(observers).where(observers.c.id == fleet_repo.POLLERS)
                               .values(started_at=ten_minutes_ago))
        await eventually(False)
    finally:
        await engine.dispose()


# ---- limits ----------------------------------------------------------------------------------------

async def test_fifty_concurrent_requests_against_limit_four_queue_eight(gw, engines):
    engines.state["max_active"] = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one():
            async with s.post(gw.gateway + "/v1/chat/completions", json=chat("limited")) as r:
                return r.status, dict(r.headers), await r.json(content_type=None)
        results = await asyncio.gather(*(one() for _ in range(50)))
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429, 503}, statuses
    for status, headers, body in results:
        if status != 200:
            assert int(headers["Retry-After"]) >= 1
            assert_envelope(body, status)
    assert statuses.count(200) >= 12 and statuses.count(429) >= 1, statuses
    assert engines.state["max_active"] <= 4  # the engine never saw more than the limit


# ---- guard policy -----------------------------------------------------------------------------------

async def test_guard_model_judges_requests_and_responses(gw, engines):
    before = engines.state["hits"]["judge"]
    status, _, out = await post(gw, "/v1/chat/completions", chat("guarded", "a harmless question"))
    assert status == 200, out
    assert engines.state["hits"]["judge"] == before + 2  # the request, then the response

    status, _, out = await post(gw, "/v1/chat/completions", chat("guarded", "something forbidden"))
    assert status == 400
    err = assert_envelope(out, status)
    assert err["code"] == "content_filter" and err["param"] == "messages" and "request" in err["message"]
    assert "S1" in err["message"]

    trigger_hits = engines.state["hits"]["trigger"]
    status, _, out = await post(gw, "/v1/chat/completions", chat("guarded", "please trigger it", stream=True))
    assert status == 400  # the engine answered something the judge refuses: nothing of it reached us
    assert assert_envelope(out, status)["code"] == "content_filter" and "response" in out["error"]["message"]
    assert engines.state["hits"]["trigger"] == trigger_hits + 1

    async with aiohttp.ClientSession() as s:  # a judged stream is held, then relayed whole
        async with s.post(gw.gateway + "/v1/chat/completions", json=chat("guarded", "fine", stream=True)) as r:
            assert r.status == 200
            assert (await r.content.read()).endswith(b"data: [DONE]\n\n")


# ---- the rest of the API ------------------------------------------------------------------------------

async def test_official_openai_client_models_and_every_endpoint(gw):
    client = AsyncOpenAI(base_url=gw.gateway + "/v1", api_key="unused")
    models = {m.id: m.owned_by for m in (await client.models.list()).data}
    assert models["echo"] == "llmgw" and models["primary"] == "llmgw-sim"
    assert (await client.models.retrieve("org/echo-2")).id == "org/echo-2"
    r = await client.chat.completions.create(model="org/echo-2", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == "echo: x"
    r = await client.completions.create(model="echo", prompt="p")
    assert r.choices[0].text == "echo: p"
    e = await client.embeddings.create(model="echo", input="x")
    assert e.data[0].embedding == [0.1, 0.2]


def sample(text: str, series: str) -> float:
    """The value of one Prometheus sample (`name{labels}`) in a scrape, 0 when it is absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


async def scrape(gw) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.gateway + "/metrics") as r:
            return await r.text()


async def test_metrics_count_requests_latency_ttft_and_bound_the_labels(gw):
    await post(gw, "/v1/chat/completions", chat("echo"))
    await post(gw, "/v1/chat/completions", chat("a-model-name-a-client-made-up"))
    before = await scrape(gw)
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + "/v1/chat/completions", json=chat("echo", stream=True)) as r:
            await r.read()
    text = await scrape(gw)
    assert sample(text, 'llmgw_requests_total{model="echo",status="200"}') >= 2
    assert sample(text, 'llmgw_requests_total{model="unknown",status="404"}') >= 1
    assert "a-model-name-a-client-made-up" not in text
    # the streamed request is observed once in each histogram (a series with no sample would not count)
    assert sample(text, 'llmgw_request_seconds_count{model="echo"}') == sample(before, 'llmgw_request_seconds_count{model="echo"}') + 1
    assert sample(text, 'llmgw_ttft_seconds_count{model="echo"}') == sample(before, 'llmgw_ttft_seconds_count{model="echo"}') + 1
    assert sample(text, 'llmgw_in_flight{model="echo"}') == 0.0 and 'llmgw_in_flight{model="echo"} 0.0' in text
    assert sample(text, 'llmgw_ready_replicas{model="echo"}') == 1.0


async def test_a_removed_models_series_leave_the_metrics(gw):
    """`llmgw_ready_replicas{model="removable"} 1` would go on saying a model is served after it is gone."""
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.admin + "/admin/v1/catalog", headers=gw.admin_headers) as r:
            whole = await r.json()
        assert (await post(gw, "/v1/chat/completions", chat("removable")))[0] == 200
        text = await scrape(gw)
        assert sample(text, 'llmgw_ready_replicas{model="removable"}') == 1.0
        assert sample(text, 'llmgw_requests_total{model="removable",status="200"}') == 1.0
        less = {**whole, "models": [m for m in whole["models"] if m["name"] != "removable"]}
        try:
            async with s.post(gw.admin + "/admin/v1/catalog", json={"catalog": less}, headers=gw.admin_headers) as r:
                assert r.status == 200 and (await r.json())["removed"] == ["removable"], await r.text()
            deadline = time.monotonic() + 5
            while 'model="removable"' in (text := await scrape(gw)):
                assert time.monotonic() < deadline, [ln for ln in text.splitlines() if "removable" in ln]
                await asyncio.sleep(0.1)
            assert sample(text, 'llmgw_ready_replicas{model="echo"}') == 1.0  # the others' stay
            assert sample(text, 'llmgw_requests_total{model="echo",status="200"}') >= 1
        finally:
            async with s.post(gw.admin + "/admin/v1/catalog", json={"catalog": whole}, headers=gw.admin_headers) as r:
                assert r.status == 200, await r.text()
        deadline = time.monotonic() + 5
        while (await post(gw, "/v1/chat/completions", chat("removable")))[0] != 200:  # back, and counted anew
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert sample(await scrape(gw), 'llmgw_requests_total{model="removable",status="200"}') == 1.0


async def test_chat_page_never_preselects_a_model(gw):
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.gateway + "/") as r:
            page = await r.text()
    assert '<option value="" selected disabled>' in page  # a placeholder, not a model
    assert page.count(" selected") == 1 and ".selected =" not in page and "selected = true" not in page


async def test_a_whole_answer_has_its_length_and_an_http_1_0_client_can_read_it(gw):
    """A non-streamed answer is held whole, so it goes with `content-length`, not chunked: an HTTP/1.0
    client (load balancers' health checks, `ab`) reads it; one over HTTP/1.1 gets the same length."""
    body = json.dumps(chat("echo", "one-oh")).encode()
    host, port = gw.gateway.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)  # HTTP/1.0: the server closes after the answer
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0].startswith(b"http/1.1 200"), head
    assert b"transfer-encoding: chunked" not in lines
    assert f"content-length: {len(payload)}".encode() in lines
    assert json.loads(payload)["choices"][0]["message"]["content"] == "echo: one-oh"
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + "/v1/chat/completions", json=chat("echo", "one-one")) as r:
            data = await r.read()
            assert r.status == 200 and r.headers["Content-Length"] == str(len(data))
            assert "Transfer-Encoding" not in r.headers


async def test_a_stream_to_an_http_1_0_client_is_not_chunked_and_ends_with_the_connection(gw):
    """A streamed answer has no length to send ahead; to an HTTP/1.0 client (which cannot read chunked
    bodies) it goes without `transfer-encoding`, with `connection: close`, and ends where the connection
    does: the client reads the events as they are, through `[DONE]`."""
    body = json.dumps({**chat("echo", "one-oh stream"), "stream": True}).encode()
    host, port = gw.gateway.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)  # returns only once the server has closed
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0].startswith(b"http/1.1 200") and b"content-type: text/event-stream" in lines[1:], head
    assert not [h for h in lines if h.startswith((b"transfer-encoding", b"content-length"))], head
    assert b"connection: close" in lines, head
    events = [e for e in payload.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and all(e.startswith(b"data: ") for e in events), payload[:300]
    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-1]
                   if json.loads(e[6:])["choices"])
    assert "one-oh stream" in text, text


async def test_an_engine_header_with_a_control_character_is_a_502_and_never_relayed(gw):
    """What the gateway relays from an engine's head (its content-type) is checked on the way in and again
    when the response head is written (response_head.HeadCycle): a control character is a 502 in the
    envelope, not a dropped connection or a 500, and nothing of it reaches the client; bytes above 0x7f,
    which HTTP allows in a value, are relayed as they are."""
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.gateway + "/v1/chat/completions", json=chat("raw-ctltype")) as r:
            body = await r.json(content_type=None)
            assert r.status == 502 and assert_envelope(body, r.status)["code"] == "engine_error", body
            assert "X-Injected" not in r.headers
    host, port = gw.gateway.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    req = json.dumps(chat("raw-obstype")).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(req), req))
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head = raw.partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200") and b"\r\ncontent-type: application/json; x=\x80\xff\r\n" in head, head


async def test_requests_queued_under_a_per_gateway_cap_are_not_load_for_the_planner(gw, module_database_url):
    """`limited` takes 4 requests at once on this gateway; 12 clients keep 8 more queued for a slot. Those
    are not load the planner should add replicas for (the cap is this gateway's, so no replica added
    would drain them): the gateway's load row says 4 in flight and none queued, where it had said 12."""
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            await post(gw, "/v1/chat/completions", chat("limited"))

    clients = [asyncio.create_task(client()) for _ in range(12)]
    try:
        rows = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(rows) < 3:
            await asyncio.sleep(1.1)  # the load is flushed every second
            async with await psycopg.AsyncConnection.connect(module_database_url) as conn:
                row = await (await conn.execute(
                    "SELECT in_flight, queued, peak FROM gateway_load WHERE model = 'limited'")).fetchone()
            if row is not None and row[0] > 0:
                rows.append(row)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert len(rows) == 3, rows
    assert all(in_flight <= 4 and queued == 0 and peak <= 4 for in_flight, queued, peak in rows), rows



# ---- checks a fallback, a judge or an engine's answer had skipped (review of the request path) ----------

async def test_a_guarded_prompt_of_token_ids_is_refused_before_any_engine_sees_it(gw, engines):
    """The judge read token ids as an empty message and allowed them; the engine decoded and served them."""
    before = engines.state["hits"]["trigger"]
    for model in ("guarded", "answer-judged"):
        for prompt in ([5519, 656, 12], [[5519, 656]], ["text", 12]):
            status, _, out = await post(gw, "/v1/completions", {"model": model, "prompt": prompt})
            err = assert_envelope(out, status)
            assert status == 400 and err["code"] == "invalid_prompt" and err["param"] == "prompt", out
    assert engines.state["hits"]["trigger"] == before
    status, _, out = await post(gw, "/v1/completions", {"model": "guarded", "prompt": ["a harmless", "question"]})
    assert status == 200, out


async def test_a_prompt_too_long_for_the_judge_is_400_not_a_retry_forever_503(gw, engines):
    before = engines.state["hits"]["judge"]
    status, headers, out = await post(gw, "/v1/chat/completions", chat("judged-small", "y" * 500))
    err = assert_envelope(out, status)
    assert status == 400 and err["code"] == "context_length_exceeded" and "Retry-After" not in headers, out
    assert engines.state["hits"]["judge"] == before  # never sent to the judge
    status, _, out = await post(gw, "/v1/chat/completions", chat("judged-small", "short"))
    assert status == 200, out


async def test_answers_too_long_to_hold_never_open_the_breaker_for_everyone(gw):
    """A client asking for an answer past what the gateway holds gets 502 `answer_too_large`, saying what to
    ask instead; more of them than the breaker's threshold leave the replica routed for everyone else."""
    for _ in range(BREAKER_FAILURES + 2):
        status, _, out = await post(gw, "/v1/chat/completions", chat("huge-judged", "make it huge"))
        err = assert_envelope(out, status)
        assert status == 502 and err["code"] == "answer_too_large" and "ask for less" in err["message"], out
    status, _, out = await post(gw, "/v1/chat/completions", chat("huge-judged", "small please"))
    assert status == 200, out


async def test_a_stream_ends_at_its_done_even_when_the_engine_keeps_the_connection_open(gw, engines):
    async with aiohttp.ClientSession() as s:
        started = time.monotonic()
        async with s.post(gw.gateway + "/v1/chat/completions", json=chat("after-done", stream=True)) as r:
            raw = await asyncio.wait_for(r.content.read(), 5)
        assert raw.endswith(b"data: [DONE]\n\n") and b"ping" not in raw, raw
        assert time.monotonic() - started < 3
    deadline = time.monotonic() + 5
    while engines.state.get("afterdone_open") and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert engines.state.get("afterdone_open") is False  # the engine's connection was dropped


async def test_an_engine_refusing_the_gateways_key_is_another_replicas_turn_and_never_the_clients_401(gw):
    for _ in range(3):
        status, _, out = await post(gw, "/v1/chat/completions", chat("key-mismatch", "through"))
        assert status == 200 and out["choices"][0]["message"]["content"] == "echo: through", out
    status, _, out = await post(gw, "/v1/chat/completions", chat("only-401"))
    err = assert_envelope(out, status)
    assert status == 502 and err["code"] == "engine_refused_gateway", out  # not the client's key: not a 401


async def test_a_busy_engines_429_carries_retry_after(gw):
    status, headers, out = await post(gw, "/v1/chat/completions", chat("engine-429"))
    err = assert_envelope(out, status)
    assert status == 429 and headers["Retry-After"] == "1" and err["code"] == "engine_busy", (headers, out)
    # The engine's own Retry-After (in seconds) reaches the client, within bounds; one the gateway cannot
    # read as seconds (an HTTP date, a negative number, a word) becomes 1, and a huge one 300.
    status, headers, out = await post(gw, "/v1/chat/completions", chat("engine-429-wait"))
    assert status == 429 and headers["Retry-After"] == "7", headers
    status, headers, out = await post(gw, "/v1/chat/completions", chat("engine-503-wait"))
    assert status == 503 and headers["Retry-After"] == "12" and assert_envelope(out, status)["code"] == "engine_unavailable"
    for _ in range(4):
        status, headers, out = await post(gw, "/v1/chat/completions", chat("engine-429-odd"))
        assert status == 429 and headers["Retry-After"] in ("1", "300"), headers


async def test_a_fallback_serves_only_what_it_would_take_when_asked_directly(gw, engines):
    """`primary-to-short` is off and falls back to `short-prompts` (100 characters): a longer prompt had been
    served by the fallback; asked directly, the fallback refuses it."""
    status, _, out = await post(gw, "/v1/chat/completions", chat("short-prompts", "z" * 500))
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    status, _, out = await post(gw, "/v1/chat/completions", chat("primary-to-short", "z" * 500))
    assert status == 503, out  # the model is off and no fallback takes the prompt
    status, _, out = await post(gw, "/v1/chat/completions", chat("primary-to-short", "short"))
    assert status == 200 and out["model"] == "short-prompts", out  # the fallback still serves what it takes


async def test_a_fallback_keeps_its_own_concurrency_limit(gw, engines):
    """`limited` takes 4 at once: as the fallback of `dead-to-limited` (whose engine refuses connections),
    12 at once had all reached it. The fallback's slot is taken without queueing (the request has queued once)."""
    engines.state["max_active"] = 0
    results = await asyncio.gather(*[post(gw, "/v1/chat/completions", chat("dead-to-limited")) for _ in range(12)])
    statuses = sorted(r[0] for r in results)
    assert engines.state["max_active"] <= 4, engines.state["max_active"]
    assert statuses.count(200) >= 4 and set(statuses) <= {200, 429}, statuses


async def test_a_fallbacks_slot_goes_back_to_the_gate_it_was_taken_from(gw, engines):
    """Issue 36: the slot `gate-fb` gave as `dead-to-gate`'s fallback was released on the gate looked up
    again at the end; a catalog change in between (a new gate) left that one's `active` at -1, so two
    requests reached an engine limited to one."""
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.admin + "/admin/v1/catalog", headers=gw.admin_headers) as r:
            whole = await r.json()
    changed = {**whole, "models": [{**m, "limits": {**m["limits"], "queue_timeout_s": 7}} if m["name"] == "gate-fb"
                                   else m for m in whole["models"]]}
    engines.state["release"].clear()
    hits = engines.state["hits"]["hold"]
    first = asyncio.create_task(post(gw, "/v1/chat/completions", chat("dead-to-gate")))
    try:
        deadline = time.monotonic() + 10
        while engines.state["hits"]["hold"] == hits:  # served by the fallback, holding its one slot
            assert time.monotonic() < deadline and not first.done(), first.done() and first.result()
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.admin + "/admin/v1/catalog", json={"catalog": changed}, headers=gw.admin_headers) as r:
                assert r.status == 200, await r.text()
        await asyncio.sleep(1.5)  # the gateway's routes (and gates) refresh on the change
        engines.state["release"].set()
        assert (await first)[0] == 200
        # The new gate takes one request at once; the second is refused (max_queue 0), never forwarded.
        engines.state["release"].clear()
        hits = engines.state["hits"]["hold"]
        one = asyncio.create_task(post(gw, "/v1/chat/completions", chat("gate-fb")))
        deadline = time.monotonic() + 10
        while engines.state["hits"]["hold"] == hits:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        status, _, out = await post(gw, "/v1/chat/completions", chat("gate-fb"))
        assert status == 429 and assert_envelope(out, status), (status, out)
        assert engines.state["hits"]["hold"] == hits + 1
        engines.state["release"].set()
        assert (await one)[0] == 200
    finally:
        engines.state["release"].set()
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.admin + "/admin/v1/catalog", json={"catalog": whole}, headers=gw.admin_headers) as r:
                assert r.status == 200, await r.text()


async def test_an_engines_output_never_reaches_a_client_only_the_operator(gw, module_database_url):
    """Issue 36: the cause of a failed start quotes a line of the engine's output, which may be a logged
    prompt of another tenant; `model_failing` answers and /v1/models said it to every client. They say how
    the engine ended (its signal or exit code); the admin API keeps the whole cause."""
    secret = "prompt: my card is 4111-1111-1111-1111"
    with psycopg.connect(module_database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO replicas (id, model, profile, status, failure, ended_at) VALUES "
                     "('leaky-r1', 'leaky', 'default', 'failed', %s, now())",
                     (f"exited with code 1: {secret}\nlast output:\n{secret}",))
        conn.execute("INSERT INTO model_state (name, failures, backoff_until, failed_at) VALUES "
                     "('leaky', 1, now() + interval '10 minutes', now()) ON CONFLICT (name) DO UPDATE SET "
                     "failures = 1, backoff_until = now() + interval '10 minutes', failed_at = now()")
    try:
        status, headers, out = await post(gw, "/v1/chat/completions", chat("leaky"))
        assert status == 503 and assert_envelope(out, status)["code"] == "model_failing", out
        assert "4111" not in json.dumps(out) and "exited with code 1" in out["error"]["message"], out
        assert "llmgw ctl models" in out["error"]["message"]
        async with aiohttp.ClientSession() as s:
            for url in (gw.gateway + "/v1/models", gw.gateway + "/v1/models/leaky"):
                async with s.get(url) as r:
                    text = await r.text()
                assert "4111" not in text and "exited with code 1" in text, text
            async with s.get(gw.admin + "/admin/v1/models", headers=gw.admin_headers) as r:
                [view] = [m for m in await r.json() if m["name"] == "leaky"]
        assert secret in view["reason"], view  # the operator sees the whole cause
    finally:
        with psycopg.connect(module_database_url, autocommit=True) as conn:
            conn.execute("DELETE FROM replicas WHERE id = 'leaky-r1'")
            conn.execute("DELETE FROM model_state WHERE name = 'leaky'")


# ---- issue 36: the prompt as the template renders it -------------------------------------------------

def tool(description: str = "d", parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": "lookup", "description": description,
                                             "parameters": parameters or {"type": "object", "properties": {}}}}


async def test_every_field_the_template_renders_counts_towards_the_prompt_bound(gw, engines):
    """A `tools` entry with a 50 MB description had counted as 0 characters (so had tool-call arguments,
    schemas, a completion's suffix, names): now each is refused like a long message, before any engine."""
    hits = dict(engines.state["hits"])
    status, _, out = await post(gw, "/v1/chat/completions", chat("echo", tools=[tool("d" * (50 << 20))]))
    assert status == 400, out
    err = assert_envelope(out, status)
    assert err["code"] == "context_length_exceeded" and err["param"] == "tools", err
    assert f"{MAX_PROMPT_CHARS:,}" in err["message"]
    over = PROMPT_LIMIT + 1  # `short-prompts` takes 100 characters
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "t", "type": "function", "function": {"name": "f", "arguments": "a" * over}}]}
    cases = [
        ("/v1/chat/completions", chat("short-prompts", "x", tools=[tool(parameters={"type": "object", "properties": {
            "p" * over: {"type": "string"}}})]), "tools"),  # a schema's property names are rendered too
        ("/v1/chat/completions", {"model": "short-prompts", "messages": [{"role": "user", "content": "q"}, call]},
         "messages"),
        ("/v1/chat/completions", {"model": "short-prompts", "messages": [
            {"role": "user", "content": "q", "name": "n" * over}]}, "messages"),
        ("/v1/chat/completions", {"model": "short-prompts", "messages": [
            {"role": "assistant", "content": "a", "reasoning_content": "r" * over}]}, "messages"),
        ("/v1/chat/completions", chat("short-prompts", "x", response_format={"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object", "description": "s" * over}}}), "response_format"),
        ("/v1/completions", {"model": "short-prompts", "prompt": "p", "suffix": "s" * over}, "suffix"),
    ]
    for path, body, param in cases:
        status, _, out = await post(gw, path, body)
        assert status == 400, (param, out)
        err = assert_envelope(out, status)
        assert err["code"] == "context_length_exceeded" and err["param"] == param, (param, err)
    assert engines.state["hits"] == hits  # refused before any engine
    # What fits still goes: a small tool, a short call, an image that is not text.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 5000}}
    status, _, out = await post(gw, "/v1/chat/completions", {"model": "short-prompts", "tools": [tool()], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]})
    assert status == 200, out


async def test_the_guard_judges_tools_tool_calls_and_reasoning(gw, engines):
    """The judge had read `messages` only, and only the `content` of answers: a forbidden `tools`
    description, or a forbidden tool call or reasoning in the answer, went through unjudged."""
    status, _, out = await post(gw, "/v1/chat/completions", chat("guarded", "a harmless question",
                                                                 tools=[tool("something forbidden")]))
    assert status == 400 and assert_envelope(out, status)["code"] == "content_filter", out
    assert "request" in out["error"]["message"]
    status, _, out = await post(gw, "/v1/chat/completions", {"model": "guarded", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t", "type": "function", "function": {"name": "f", "arguments": '{"x": "something forbidden"}'}}]},
        {"role": "user", "content": "go on"}]})
    assert status == 400 and out["error"]["code"] == "content_filter", out
    for text in ("please call a tool", "reason it out"):
        for stream in (False, True):
            status, _, out = await post(gw, "/v1/chat/completions", chat("answer-judged", text, stream=stream))
            assert status == 400, (text, stream, out)
            assert out["error"]["code"] == "content_filter" and "response" in out["error"]["message"], out
    status, _, out = await post(gw, "/v1/chat/completions", chat("answer-judged", "a plain question"))
    assert status == 200, out



# ---- issue 36: media URLs the engine would fetch -------------------------------------------------------

def with_part(model: str, part: dict) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]}


async def test_media_urls_are_refused_naming_the_part_unless_the_model_allows_them(gw, engines):
    """Engines fetch a media part's URL from the GPU network (cloud metadata, the node API, ...): a URL is
    400 naming the part and saying to send the media inline, unless `limits.media_urls` allows it; allowed,
    the mirror's address policy applies."""
    hits = engines.state["hits"]["echo"]
    metadata = "http://169.254.169.254/latest/meta-data/iam"
    refused = [
        ("echo", {"type": "image_url", "image_url": {"url": metadata}}, "messages[0].content[1].image_url.url"),
        ("echo", {"type": "image_url", "image_url": "https://images.example.com/a.png"}, "messages[0].content[1].image_url"),
        ("echo", {"type": "video_url", "video_url": {"url": "http://10.0.0.1/v.mp4"}}, "messages[0].content[1].video_url.url"),
        ("echo", {"type": "audio_url", "audio_url": {"url": "HTTP://127.0.0.1:8081/admin"}}, "messages[0].content[1].audio_url.url"),
        ("echo", {"type": "input_audio", "input_audio": {"data": "http://10.1.1.1/a.wav", "format": "wav"}},
         "messages[0].content[1].input_audio.data"),
        ("echo", {"type": "file", "file": {"file_data": "file:///etc/passwd", "filename": "a.pdf"}},
         "messages[0].content[1].file.file_data"),
        ("media-public", {"type": "image_url", "image_url": {"url": metadata}}, "messages[0].content[1].image_url.url"),
        ("media-public", {"type": "image_url", "image_url": {"url": "http://[::ffff:169.254.169.254]/x"}},
         "messages[0].content[1].image_url.url"),
        ("media-public", {"type": "image_url", "image_url": {"url": "http://localhost:8081/x"}},
         "messages[0].content[1].image_url.url"),  # a name, resolved, to loopback
        ("media-public", {"type": "image_url", "image_url": {"url": "http://[fec0::1]/x"}},
         "messages[0].content[1].image_url.url"),
        ("media-public", {"type": "image_url", "image_url": {"url": "ftp://93.184.216.34/x.png"}},
         "messages[0].content[1].image_url.url"),
        ("media-listed", {"type": "image_url", "image_url": {"url": "http://93.184.216.34/x.png"}},
         "messages[0].content[1].image_url.url"),  # public, but not a listed host
        ("media-listed", {"type": "image_url", "image_url": {"url": "http://localhost/x.png"}},
         "messages[0].content[1].image_url.url"),  # listed, and still held to the address policy
    ]
    for model, part, param in refused:
        status, _, out = await post(gw, "/v1/chat/completions", with_part(model, part))
        assert status == 400, (model, part, out)
        err = assert_envelope(out, status)
        assert err["code"] == "media_url_refused" and err["param"] == param, (model, part, err)
        assert "data:" in err["message"] and "limits.media_urls" in err["message"], err
    assert engines.state["hits"]["echo"] == hits  # none reached an engine
    # Inline media always goes; a public address goes where the model allows URLs.
    for model, part in [
        ("echo", {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}),
        ("echo", {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}}),
        ("echo", {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a:b.pdf"}}),
        ("media-public", {"type": "image_url", "image_url": {"url": "https://93.184.216.34/x.png"}}),
    ]:
        status, _, out = await post(gw, "/v1/chat/completions", with_part(model, part))
        assert status == 200, (model, part, out)
    # Many URLs: each one is judged (the first refused one is named).
    parts = [{"type": "image_url", "image_url": {"url": "https://93.184.216.34/%d.png" % n}} for n in range(5)]
    parts.append({"type": "image_url", "image_url": {"url": "http://192.168.0.1/x.png"}})
    status, _, out = await post(gw, "/v1/chat/completions", {"model": "media-public", "messages": [
        {"role": "user", "content": parts}]})
    assert status == 400 and out["error"]["param"] == "messages[0].content[5].image_url.url", out
