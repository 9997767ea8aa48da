"""Scaling through the real path: an on-demand model loads when asked for and stops when idle; a
higher-priority on-demand model asked for through the gateway evicts a lower-priority replica that holds
the GPUs it needs, after draining it (its request in flight finishes whole), and says so in the
decisions and in `llmgw ctl explain`."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import httpx
import pytest

from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

CATALOG = {"models": [
    {"name": "low", "priority": 0, "scaling": {"min": 1, "max": 1},
     "profiles": [{"engine": "sim", "tp": 4, "args": ["--tokens-per-second", "20"]}]},
    {"name": "high", "priority": 10, "scaling": {"min": 0, "max": 1, "idle_timeout": "10m"},
     "profiles": [{"engine": "sim", "tp": 4, "args": ["--tokens-per-second", "0"]}]},
]}
TOKENS = 60  # 3 s at 20 tokens/s: the request is still running when the eviction starts


def test_a_higher_priority_on_demand_model_preempts_a_lower_one_after_draining_it(control_plane):
    cp = control_plane.start()
    cp.agent("node-a", simulate=sim_spec(gpus=4))
    cp.wait_nodes("node-a")
    assert cp.apply(CATALOG).status_code == 200
    [low] = cp.wait_replicas("low", timeout_s=60)
    wait_until(lambda: httpx.post(cp.gateway + "/v1/chat/completions", timeout=10, json={
        "model": "low", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).status_code == 200,
        timeout_s=15, what="low serving")

    # A long streaming request to low is in flight when high is asked for.
    got: dict = {}
    first = threading.Event()

    def stream_low():
        with httpx.stream("POST", cp.gateway + "/v1/chat/completions", timeout=60, json={
                "model": "low", "messages": [{"role": "user", "content": "x"}], "max_tokens": TOKENS,
                "stream": True}) as r:
            chunks = []
            got["done"] = False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    got["done"] = True
                elif line.startswith("data: "):
                    chunks.append(line)
                    first.set()
            got.update(status=r.status_code, chunks=len(chunks), ended=datetime.now(timezone.utc))
    t = threading.Thread(target=stream_low, daemon=True)
    t.start()
    assert first.wait(15), "the request to low never started streaming"

    asked: dict = {}

    def ask_high():  # the gateway records the demand, waits briefly, then says the model is loading
        r = httpx.post(cp.gateway + "/v1/chat/completions", timeout=30, json={
            "model": "high", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        asked.update(status=r.status_code, retry_after=r.headers.get("retry-after"))
    asker = threading.Thread(target=ask_high, daemon=True)
    asker.start()
    wait_until(lambda: any(x["id"] == low["id"] and x["status"] == "draining" for x in cp.replicas()),
               timeout_s=10, what="low draining")
    assert not [x for x in cp.replicas() if x["model"] == "high"]  # not placed while low drains
    [high] = cp.wait_replicas("high", timeout_s=60)
    t.join(30)
    asker.join(30)
    assert asked["status"] == 200 or (asked["status"] == 503 and asked["retry_after"]), asked

    # The request in flight when the drain began finished whole, before high was placed; and the engine was
    # stopped only once the drain saw nothing in flight (its in-flight reads carry the engine key).
    assert got == {**got, "status": 200, "chunks": TOKENS, "done": True}, got
    engine_log = (cp.state / "logs" / "node-a" / f"{low['id']}-r0.log").read_text()
    assert "sim: stopping with 0 request(s) in flight" in engine_log, engine_log[-2000:]
    assert datetime.fromisoformat(high["created_at"]) >= got["ended"].replace(microsecond=0)
    ended = next(x for x in cp.replicas() if x["id"] == low["id"])
    assert ended["status"] == "stopped"
    assert ended["ended_reason"].startswith("evicted for high (priority 10 > 0)")
    assert high["shards"][0]["gpus"] == [0, 1, 2, 3]
    wait_until(lambda: httpx.post(cp.gateway + "/v1/chat/completions", timeout=10, json={
        "model": "high", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).status_code == 200,
        timeout_s=15, what="high serving")

    # low wants a replica but may not evict a higher-priority one: explain says what holds its GPUs.
    out = cp.ctl("explain", "low")
    assert out.returncode == 0, out.stderr
    assert "cannot place low" in out.stdout and "held: high on 0,1,2,3" in out.stdout
    assert "ended: evicted for high (priority 10 > 0)" in out.stdout


def test_an_on_demand_model_loads_when_asked_and_stops_when_idle(control_plane):
    cp = control_plane.start()
    cp.agent("node-a", simulate=sim_spec(gpus=1))
    cp.wait_nodes("node-a")
    od = {"models": [{"name": "od", "scaling": {"min": 0, "max": 1, "idle_timeout": "4s"},
                      "profiles": [{"engine": "sim", "gpus_per_node": 1, "args": ["--tokens-per-second", "0"]}]}]}
    assert cp.apply(od).status_code == 200
    wait_until(lambda: "on demand, not asked for" in "\n".join(cp.explain("od")["decisions"]), timeout_s=20,
               what="a pass that leaves od unloaded")
    assert not cp.replicas()

    def ask() -> int:
        return httpx.post(cp.gateway + "/v1/chat/completions", timeout=30, json={
            "model": "od", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).status_code
    assert ask() in (200, 503)  # the first request starts the load
    [rep] = cp.wait_replicas("od", timeout_s=30)
    wait_until(lambda: ask() == 200, timeout_s=15, what="od serving")
    # Nobody asks any more: after idle_timeout it drains and stops, and its GPU is free again.
    wait_until(lambda: any(r["id"] == rep["id"] and r["status"] == "stopped" for r in cp.replicas()), timeout_s=30,
               what="od stopped when idle")
    ended = next(r for r in cp.replicas() if r["id"] == rep["id"])
    assert ended["ended_reason"].startswith("1 running, 0 wanted (on demand, idle for")
    # A larger idle_timeout applied now does not start it again without a request (it had: "used 20s ago
    # (idle_timeout 300s)" with nothing asking); the next request does.
    od["models"][0]["scaling"]["idle_timeout"] = "300s"
    assert cp.apply(od).status_code == 200
    wait_until(lambda: "stopped" in "\n".join(cp.explain("od")["decisions"])
               and "for want of requests" in "\n".join(cp.explain("od")["decisions"]), timeout_s=20,
               what="a pass with the new idle_timeout that leaves od stopped")
    time.sleep(1.5)  # and a few passes more
    assert [r["id"] for r in cp.replicas() if r["model"] == "od" and r["status"] in ("starting", "ready")] == []
    assert ask() in (200, 503)
    cp.wait_replicas("od", timeout_s=30, exclude={rep["id"]})
