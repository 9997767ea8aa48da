"""The real path with the sim engine: catalog through the admin API, placement by the reconciler workflow,
a replica started through Temporal on the node worker's queue, traffic through the gateway."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from tests.helpers import wait_until

pytestmark = pytest.mark.integration

SIM = {"models": [{"name": "sim-a", "aliases": ["alpha"], "scaling": {"min": 1, "max": 1},
                   "profiles": [{"engine": "sim", "args": ["--tokens-per-second", "0"]}]}]}


def chat(cp, model: str, stream: bool = False, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": stream, **kw}
    return httpx.post(cp.gateway + "/v1/chat/completions", json=body, timeout=30)


def test_sim_replica_serves_through_gateway_and_is_replaced_when_killed(control_plane, namespace, temporal):
    cp = control_plane.start()
    node = "node-a"
    cp.agent(node)
    r = cp.apply(SIM)
    assert r.status_code == 200, r.text
    assert r.json()["added"] == ["sim-a"]
    [rep] = cp.wait_replicas("sim-a")
    assert rep["node_id"] == node

    # Non-streaming, streaming, by alias, and an unknown model.
    wait_until(lambda: chat(cp, "sim-a").status_code == 200, what="gateway route for sim-a")
    body = chat(cp, "alpha").json()
    assert body["choices"][0]["message"]["content"].startswith("α β")
    raw = chat(cp, "sim-a", stream=True).content
    assert raw.endswith(b"data: [DONE]\n\n")
    err = chat(cp, "no-such-model")
    assert err.status_code == 404
    assert err.json()["error"]["code"] == "model_not_found"

    # The start ran as a Temporal workflow whose node activities ran on the node's own queue.
    async def history():
        client = await Client.connect(temporal.address, namespace=namespace, data_converter=pydantic_data_converter)
        h = await client.get_workflow_handle(f"replica/{rep['id']}/start").fetch_history()
        return [e.activity_task_scheduled_event_attributes for e in h.events
                if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]
    scheduled = asyncio.run(history())
    by_name = {a.activity_type.name: a.task_queue.name for a in scheduled}
    # A single-shard replica is fetched and launched in one node step (issue 13).
    assert by_name["start_shard"] == by_name["wait_shard_ready"] == f"node/{node}"
    assert "fetch_weights" not in by_name and "launch_shard" not in by_name
    assert by_name["mark_replica"] == "llmgw-control"

    # Kill the engine: the replica leaves routing within seconds and the reconciler starts another.
    pid = json.loads((cp.state / "shards" / node / f"{rep['id']}-r0.json").read_text())["pid"]
    os.killpg(pid, signal.SIGKILL)
    wait_until(lambda: any(r["id"] == rep["id"] and r["status"] == "failed" for r in cp.replicas()),
               timeout_s=10, what="the killed replica marked failed")
    [new] = cp.wait_replicas("sim-a", exclude={rep["id"]}, timeout_s=30)
    assert new["id"] != rep["id"]
    wait_until(lambda: chat(cp, "sim-a").status_code == 200, timeout_s=15, what="traffic on the new replica")


def test_bad_catalog_is_refused_with_the_field_named(control_plane):
    cp = control_plane.start()
    bad = {"models": [{"name": "m", "scalling": {"min": 1}, "profiles": [{"engine": "sim"}]}]}
    r = cp.apply(bad)
    assert r.status_code == 400
    assert "models[0] (m).scalling" in r.json()["error"]["message"]
    r = cp.apply({"models": [{"name": "m", "scaling": {"min": 1, "max": 1},
                              "profiles": [{"engine": "sim", "env": {"LD_PRELOAD": "/tmp/x.so"}}]}]})
    assert r.status_code == 400
    assert "LD_PRELOAD" in r.json()["error"]["message"]
    # Engine flags are read as the engine's parser reads them: vLLM takes `_` for `-` (issue 11).
    r = cp.apply({"models": [{"name": "m", "profiles": [{"engine": "vllm", "source": "org/m",
                                                         "args": ["--trust_remote_code"]}]}]})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "args: --trust_remote_code is not an allowed vllm flag (vllm reads '--trust_remote_code' as " \
           "--trust-remote-code)" in msg and "Allowed vllm flags: " in msg and "--max-model-len" in msg
    # A source is the engine's own argument: one that begins with '-' would be read as a flag by vLLM.
    r = cp.apply({"models": [{"name": "m", "profiles": [{"engine": "vllm", "source": "--trust-remote-code",
                                                         "args": ["--enforce-eager", "evil/x"]}]}]})
    assert r.status_code == 400
    assert "source '--trust-remote-code' is not a model id" in r.json()["error"]["message"]
    # Nothing was applied half-way.
    assert httpx.get(cp.admin + "/admin/v1/catalog", headers=cp.admin_headers).json().get("models", []) == []
