"""A request for an on-demand model that no node can take is told so (503 `model_unplaceable` with the
reconciler's reason), not "loading": a client told "loading" would retry forever."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def test_unplaceable_on_demand_model_says_why(control_plane):
    cp = control_plane
    cp.env["LLMGW_LOAD_WAIT_S"] = "3"
    cp.start()
    agent = cp.agent("n1")
    wait_until(lambda: "registered node n1" in agent.log(), timeout_s=30, what="agent registered")
    assert cp.apply({"models": [{"name": "huge", "scaling": {"min": 0, "max": 1},
                                 "profiles": [{"engine": "sim", "memory_gb": 100000}]}]}).status_code == 200
    # The first request, streaming, is held while the reconciler looks (200, `: loading` comments); when
    # the answer is that nothing can take it, its stream ends with the error event and `[DONE]`, as every
    # stream does.
    # A Messages stream (Anthropic's API, served as a chat) held beside it ends with Anthropic's `error` event.
    with ThreadPoolExecutor(2) as pool:
        anthropic = pool.submit(httpx.post, cp.gateway + "/v1/messages", timeout=30, json={
            "model": "huge", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stream": True})
        streamed = httpx.post(cp.gateway + "/v1/chat/completions", timeout=30,
                              json={"model": "huge", "messages": [{"role": "user", "content": "x"}], "stream": True})
        held = anthropic.result()
    assert held.status_code == 200 and ": loading huge" in held.text, held.text
    last = held.text.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: error" and "[DONE]" not in held.text, held.text
    assert json.loads(last[1][6:])["error"]["code"] == "model_unplaceable", held.text
    assert streamed.status_code == 200 and ": loading huge" in streamed.text, streamed.text
    events = [ln for ln in streamed.text.splitlines() if ln.startswith("data:")]
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1, streamed.text
    assert '"code":"model_unplaceable"' in events[-2].replace(" ", ""), streamed.text
    r = httpx.post(cp.gateway + "/v1/chat/completions", timeout=30,
                   json={"model": "huge", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.headers["Retry-After"]
    err = r.json()["error"]
    assert err["code"] == "model_unplaceable", err
    assert "no node can take it" in err["message"] and "llmgw ctl explain huge" in err["message"]
    assert "needs 100000 GB of host memory" in err["message"], err  # why, not only that no node can take it
    r = httpx.post(cp.gateway + "/v1/messages", timeout=30,
                   json={"model": "huge", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.headers["Retry-After"] and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "overloaded_error" and r.json()["error"]["code"] == "model_unplaceable"
