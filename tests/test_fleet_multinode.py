"""A TP8 replica over two simulated 4-GPU nodes, through the real path: catalog via the admin API,
placement by the reconciler workflow, a start workflow with a rendezvous on the node workers' queues,
one sim process per shard, traffic through the gateway. Then a shard dies and the replica with it."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from llmgw.control.worker import WORKFLOWS
from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

BIG = {"models": [{"name": "big", "scaling": {"min": 1, "max": 1}, "profiles": [
    {"engine": "sim", "tp": 8, "nodes": 2, "gpu_memory_gb": 40, "args": ["--tokens-per-second", "0"]}]}]}


def chat(cp, model: str) -> httpx.Response:
    return httpx.post(cp.gateway + "/v1/chat/completions", timeout=30,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


async def _histories(address: str, namespace: str, ids: list[str]):
    client = await Client.connect(address, namespace=namespace, data_converter=pydantic_data_converter)
    return [await client.get_workflow_handle(i).fetch_history() for i in ids]


def scheduled(history) -> list[tuple[str, str]]:
    """(activity name, task queue) in the order the workflow scheduled them."""
    return [(e.activity_task_scheduled_event_attributes.activity_type.name,
             e.activity_task_scheduled_event_attributes.task_queue.name)
            for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


def test_tp8_over_two_nodes_is_placed_within_one_fabric_and_a_failed_shard_fails_the_replica(
        control_plane, temporal, namespace):
    cp = control_plane.start()
    cp.agent("node-a", simulate=sim_spec(gpus=4, fabric="ib-a"))
    cp.agent("node-b", simulate=sim_spec(gpus=4, fabric="ib-b"))
    cp.agent("node-d", simulate=sim_spec(gpus=4, fabric="ib-a", port_state="INIT"))  # cabled, no subnet manager
    cp.wait_nodes("node-a", "node-b", "node-d")
    assert cp.apply(BIG).status_code == 200

    # Three 4-GPU nodes, but no fabric with two usable ones: refused, and `ctl explain` says why.
    def refused():
        lines = "\n".join(cp.explain("big")["decisions"])
        return "fabric ib-a: 1 node(s) can take a shard (node-a), 2 needed" in lines and \
            "fabric ib-b: 1 node(s) can take a shard (node-b), 2 needed" in lines and lines
    wait_until(refused, timeout_s=30, what="big refused for want of a fabric with two nodes")
    out = cp.ctl("explain", "big")
    assert out.returncode == 0, out.stderr
    assert "cannot place big" in out.stdout
    assert "default on node-d: is on no InfiniBand fabric with an active adapter" in out.stdout
    assert "fabric ib-b: 1 node(s) can take a shard (node-b), 2 needed" in out.stdout
    assert not [r for r in cp.replicas() if r["model"] == "big"]

    # A second node on ib-a arrives: the replica goes there, rank 0 on node-a (first by id), rank 1 on node-c.
    cp.agent("node-c", simulate=sim_spec(gpus=4, fabric="ib-a"))
    [rep] = cp.wait_replicas("big", timeout_s=60)
    assert [(s["node_id"], s["rank"], s["gpus"], s["status"]) for s in rep["shards"]] == [
        ("node-a", 0, [0, 1, 2, 3], "ready"), ("node-c", 1, [0, 1, 2, 3], "ready")]
    wait_until(lambda: chat(cp, "big").status_code == 200, timeout_s=15, what="big serving through the gateway")
    assert chat(cp, "big").json()["choices"][0]["message"]["content"] == "α β γ δ "
    assert "ready" in cp.ctl("replicas").stdout and "node-c[rank 1, GPUs 0,1,2,3]" in cp.ctl("replicas").stdout

    # The start: rendezvous opened on rank 0's node, the worker launched before rank 0, joined on its node.
    rid = rep["id"]
    [start] = asyncio.run(_histories(temporal.address, namespace, [f"replica/{rid}/start"]))
    acts = scheduled(start)
    node_acts = [a for a in acts if a[1].startswith("node/")]
    assert [a for a in node_acts if a[0] != "fetch_weights"] == [
        ("open_rendezvous", "node/node-a"), ("launch_shard", "node/node-c"), ("launch_shard", "node/node-a"),
        ("wait_shard_joined", "node/node-c"), ("wait_shard_ready", "node/node-a")]

    # The worker dies: the whole replica fails, every shard is stopped, the failure counts against the model,
    # and the replica is rebuilt on the one fabric that can hold it.
    os.kill(cp.shard_pid("node-c", f"{rid}-r1"), signal.SIGKILL)
    wait_until(lambda: any(r["id"] == rid and r["status"] == "failed" for r in cp.replicas()), timeout_s=15,
               what="the replica failed with its worker")
    [new] = cp.wait_replicas("big", exclude={rid}, timeout_s=60)
    assert {s["node_id"] for s in new["shards"]} == {"node-a", "node-c"}
    [stop] = asyncio.run(_histories(temporal.address, namespace, [f"replica/{rid}/stop"]))
    acts = scheduled(stop)
    assert {a for a in acts if a[0] == "stop_shard"} == {("stop_shard", "node/node-a"), ("stop_shard", "node/node-c")}
    # Its failure is counted as it is settled, in one activity (patch settle-counts-failure).
    assert acts[-1] == ("settle_replica", "llmgw-control") and ("record_replica_failure", "llmgw-control") not in acts
    wait_until(lambda: chat(cp, "big").status_code == 200, timeout_s=15, what="the rebuilt replica serving")

    # The workflows replay deterministically from their histories.
    async def replay():
        hs = await _histories(temporal.address, namespace, ["reconciler", f"replica/{rid}/start", f"replica/{rid}/stop"])
        replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter)
        for h in hs:
            await replayer.replay_workflow(h)
    asyncio.run(replay())
