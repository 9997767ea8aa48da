"""Streams that survive their replica (issue 38, gateway/resume.py), through the real path: a control plane,
an agent running sim engines (deterministic: the alphabet, a continuation going on from its prefix), and the
engine serving a stream SIGKILLed or SIGSTOPped mid-answer.

Asserted: with another replica, the client gets one continuous stream (one id and `created`, one role, the
alphabet whole with no piece missing or repeated, `[DONE]` last, no error event, usage summed: the
original prompt's tokens and every token generated), the gateway logs the replica that broke off and
counts the resumption; with no other replica, exactly one error event and then `[DONE]`.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from llmgw.engines.sim_server import GREEK
from tests.fleet import sim_spec
from tests.helpers import ControlPlane, wait_until

pytestmark = pytest.mark.integration

RATE = 20  # tokens a second: a 40-token answer takes 2 s
TOKENS = 40
CUT_AFTER = 8  # events the client reads before the engine is killed or stopped


def _model(name: str, replicas: int, **routing) -> dict:
    m = {"name": name, "scaling": {"min": replicas, "max": replicas},
         "profiles": [{"engine": "sim", "args": ["--tokens-per-second", str(RATE)]}]}
    if routing:
        m["routing"] = {"stream_resume": routing}
    return m


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, module_database_url, temporal):
    ns = temporal.free_namespaces.pop(0)
    cp = ControlPlane(tmp_path_factory.mktemp("resume"), module_database_url, temporal.address,
                      LLMGW_TEMPORAL_NAMESPACE=ns, LLMGW_ROUTE_REFRESH_S="0.5")
    try:
        cp.start()
        cp.agent("node-a", simulate=sim_spec(gpus=0, memory_gb=64))
        cp.wait_nodes("node-a")
        # `duo`: the default setting (on, one attempt); `pair`: a 1 s stall; `solo`: nowhere to continue.
        # `lora`: two replicas that load LoRA adapters (issue 40): a continuation asks for the same adapter.
        lora = _model("lora", 2)
        lora["profiles"][0]["max_loras"] = 1
        lora["adapters"] = [{"name": "lora-sql", "source": "/adapters/sql"}]
        r = cp.apply({"models": [_model("duo", 2), _model("pair", 2, stall_s="1s"), _model("solo", 1), lora]})
        assert r.status_code == 200, r.text
        for name, count in (("duo", 2), ("pair", 2), ("solo", 1), ("lora", 2)):
            cp.wait_replicas(name, count=count, timeout_s=90)
        yield cp
    finally:
        cp.stop()


def _serving(cp: ControlPlane, model: str) -> int:
    """The pid of the engine of `model` with a request in flight (its `/health`, with its engine key)."""
    def find():
        for spec in (cp.state / "shards" / "node-a").glob("*.json"):
            d = json.loads(spec.read_text())
            if d["model"] != model:
                continue
            try:
                h = httpx.get(d["endpoint"] + "/health", timeout=2,
                              headers={"authorization": f"Bearer {d['api_key']}"} if d.get("api_key") else {})
            except httpx.HTTPError:
                continue
            if h.status_code == 200 and h.json().get("in_flight"):
                return d["pid"]
        return None
    return wait_until(find, timeout_s=5, interval_s=0.05, what=f"the engine serving {model}")


def _stream(cp: ControlPlane, path: str, body: dict, at_cut) -> tuple[int, list[str]]:
    """POST a streaming request; call `at_cut()` once `CUT_AFTER` events arrived. Returns the status and each
    `data:` payload in order."""
    events: list[str] = []
    with httpx.stream("POST", cp.gateway + path, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == CUT_AFTER:
                    at_cut()
        return r.status_code, events


def _alphabet(n: int) -> str:
    return "".join(GREEK[i % len(GREEK)] + " " for i in range(n))


def _chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}


def _resumed(cp: ControlPlane, model: str) -> float:
    for line in httpx.get(cp.gateway + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'llmgw_stream_resumes_total{{model="{model}",outcome="resumed"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_stream_whose_engine_is_killed_mid_answer_is_continued_on_another_replica(fleet):
    cp = fleet
    killed: list[int] = []

    def kill():
        pid = _serving(cp, "duo")
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    t0 = time.monotonic()
    status, events = _stream(cp, "/v1/chat/completions", _chat("duo"), kill)
    assert status == 200 and killed
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
    assert {ch["index"] for c in chunks for ch in c["choices"]} == {0}
    assert sum(1 for d in deltas if "role" in d) == 1
    assert "".join(d.get("content") or "" for d in deltas) == _alphabet(TOKENS)  # no piece missing or repeated
    usage = chunks[-1]["usage"]
    assert usage == {"prompt_tokens": 1, "completion_tokens": TOKENS, "total_tokens": TOKENS + 1}, usage
    assert time.monotonic() - t0 < 15
    server = next(p for p in cp.procs if p.name == "server").log()
    assert "broke off a stream mid-answer" in server and "continuing it on another replica" in server, server[-3000:]
    assert _resumed(cp, "duo") == 1


def test_a_stream_of_a_lora_adapter_is_continued_by_the_same_adapter_on_another_replica(fleet):
    """The continuation asks the other replica for the adapter (loading it there first), never the base."""
    cp = fleet
    killed: list[int] = []

    def kill():
        pid = _serving(cp, "lora")
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    # Twice the tokens of the others: the engine is found by polling every engine's /health, which a loaded
    # machine (this test follows adapter loads) had not finished within the others' 1.6 s left.
    status, events = _stream(cp, "/v1/chat/completions", {**_chat("lora-sql"), "max_tokens": 2 * TOKENS}, kill)
    assert status == 200 and killed
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks
    deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == _alphabet(2 * TOKENS)
    assert {c.get("system_fingerprint") for c in chunks} == {"lora:lora-sql"}, chunks  # both legs: the adapter
    assert _resumed(cp, "lora-sql") == 1


def test_a_stalled_engine_is_left_after_stall_s_and_a_completion_continued(fleet):
    cp = fleet
    stopped: list[int] = []  # (the prompt ends in a space: the sim's words are its tokens, "goα" would be one)

    def stop():
        pid = _serving(cp, "pair")
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    try:
        t0 = time.monotonic()
        status, events = _stream(cp, "/v1/completions", {"model": "pair", "prompt": "go ", "max_tokens": TOKENS,
                                                          "stream": True, "stream_options": {"include_usage": True}},
                                 stop)
        took = time.monotonic() - t0
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert status == 200 and stopped and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c] and len({c["id"] for c in chunks}) == 1
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == _alphabet(TOKENS)
    assert chunks[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": TOKENS, "total_tokens": TOKENS + 1}
    assert 1.0 < took < 10, took  # the stall (1 s) was waited out, not the upstream timeout
    assert "stalled a stream mid-answer" in next(p for p in cp.procs if p.name == "server").log()
    assert _resumed(cp, "pair") == 1


def test_with_no_other_replica_the_client_gets_one_error_event_then_done(fleet):
    cp = fleet
    status, events = _stream(cp, "/v1/chat/completions", _chat("solo"),
                             lambda: os.kill(_serving(cp, "solo"), signal.SIGKILL))
    assert status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    errors = [json.loads(e)["error"] for e in events[:-1] if e.startswith('{"error"')]
    assert len(errors) == 1 and events[-2].startswith('{"error"'), events[-3:]
    assert errors[0]["code"] == "engine_error", errors
    text = "".join(ch["delta"].get("content") or "" for e in events[:-2] for ch in json.loads(e)["choices"])
    assert len(text.split()) >= CUT_AFTER - 1 and _alphabet(TOKENS).startswith(text)
    assert "not continued: no other replica can continue it" in next(p for p in cp.procs if p.name == "server").log()
