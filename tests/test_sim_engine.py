"""The sim engine over real HTTP: OpenAI shapes, Greek letters, streaming that ends in [DONE]."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from llmgw.dev.procs import free_port, stop_process, wait_port
from llmgw.engines.sim_server import GREEK


@pytest.fixture(scope="module")
def sim():
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "llmgw.engines.sim_server", "--port", str(port), "--model", "s",
                          "--tokens-per-second", "0"], start_new_session=True)
    wait_port(port, 15, p, "sim engine")
    yield f"http://127.0.0.1:{port}"
    stop_process(p)


def test_health_and_models(sim):
    assert httpx.get(sim + "/health").json()["status"] == "ok"
    assert httpx.get(sim + "/v1/models").json()["data"][0]["owned_by"] == "llmgw-sim"


def test_chat_counts_tokens_from_the_greek_alphabet(sim):
    r = httpx.post(sim + "/v1/chat/completions", json={"model": "s", "messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 30}).json()
    words = r["choices"][0]["message"]["content"].split()
    assert len(words) == 30 and words[:3] == GREEK[:3] and words[24] == GREEK[0]
    assert r["usage"]["completion_tokens"] == 30


def test_stream_ends_with_done_and_blank_line(sim):
    with httpx.stream("POST", sim + "/v1/chat/completions", json={
            "model": "s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}) as r:
        raw = b"".join(r.iter_raw())
    events = raw.split(b"\n\n")
    assert raw.endswith(b"data: [DONE]\n\n") and len([e for e in events if e]) == 4


def test_bad_requests_get_openai_errors(sim):
    r = httpx.post(sim + "/v1/chat/completions", json={"model": "s"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(sim + "/v1/embeddings", json={"model": "s"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_usage_counts_the_prompt_and_streams_when_asked(sim):
    body = {"model": "s", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 2}
    assert httpx.post(sim + "/v1/chat/completions", json=body).json()["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    with httpx.stream("POST", sim + "/v1/chat/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [e for e in b"".join(r.iter_raw()).split(b"\n\n") if e]
    assert b'"usage": {"prompt_tokens": 3' in events[-2] and events[-1] == b"data: [DONE]"


def test_the_usage_chunk_is_openais_and_the_counters_count_what_was_generated(sim):
    """As OpenAI and vLLM send it: one last chunk before [DONE], `choices: []` and `usage`, nothing else
    carrying usage; without `include_usage`, no usage at all. `/metrics` counts as vLLM's counters do."""
    import json

    def counters() -> dict[str, int]:
        text = httpx.get(sim + "/metrics").text
        return {ln.split()[0]: int(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}

    before = counters()
    body = {"model": "s", "messages": [{"role": "user", "content": "a b c d"}], "max_tokens": 5, "stream": True}
    for opts, asked in (({"include_usage": True}, True), ({"include_usage": False}, False), (None, False)):
        with httpx.stream("POST", sim + "/v1/chat/completions",
                          json={**body, **({"stream_options": opts} if opts is not None else {})}) as r:
            events = [e for e in b"".join(r.iter_raw()).split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
        with_usage = [c for c in chunks if "usage" in c]
        if asked:
            assert len(chunks) == 6 and with_usage == [chunks[-1]]
            assert chunks[-1]["choices"] == [] and chunks[-1]["object"] == "chat.completion.chunk"
            assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
        else:
            assert len(chunks) == 5 and not with_usage
    r = httpx.post(sim + "/v1/chat/completions", json={**body, "stream_options": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    after = counters()
    assert after["sim:prompt_tokens_total"] - before["sim:prompt_tokens_total"] == 12
    assert after["sim:generation_tokens_total"] - before["sim:generation_tokens_total"] == 15
    assert after["sim:requests_total"] - before["sim:requests_total"] == 3


def test_a_client_leaving_mid_stream_is_one_quiet_line_not_a_traceback(tmp_path):
    # Seen in `ctl logs`: an aiohttp traceback every time a client left a stream.
    port = free_port()
    out = tmp_path / "sim.log"
    with open(out, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "llmgw.engines.sim_server", "--port", str(port), "--model", "s",
                              "--tokens-per-second", "50"], start_new_session=True, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_port(port, 15, p, "sim engine")
        url = f"http://127.0.0.1:{port}"
        body = {"model": "s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # and close: the engine is at token 1 of 200
        time.sleep(1.0)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        stop_process(p)
    assert "Traceback" not in out.read_text(), out.read_text()
