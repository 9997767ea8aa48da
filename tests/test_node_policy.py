"""The node checks engine policy again before launching, whatever sent the profile (seeds 003): a start
workflow carrying LD_PRELOAD, an argparse prefix of --host (`--hos`) or CUDA_VISIBLE_DEVICES, which the
catalog would have refused, fails on the node with the reason, and no engine process is started."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter

from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import ReplicaStartInput, ShardPlacement
from llmgw.workflows.queues import CONTROL_QUEUE
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("profile", [
    Profile(engine="sim", env={"LD_PRELOAD": "/tmp/evil.so"}),
    Profile(engine="sim", args=["--hos", "0.0.0.0"]),  # argparse would read it as --host
    Profile(engine="sim", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}),
], ids=["LD_PRELOAD", "--hos", "CUDA_VISIBLE_DEVICES"])
def test_node_refuses_a_profile_the_catalog_would_have_refused(control_plane, temporal, namespace, profile):
    cp = control_plane.start()
    agent = cp.agent("n1")
    wait_until(lambda: "registered node n1" in agent.log(), timeout_s=30, what="agent registered")

    async def start():
        client = await Client.connect(temporal.address, namespace=namespace, data_converter=pydantic_data_converter)
        return await client.execute_workflow(
            "ReplicaStartWorkflow",
            ReplicaStartInput(replica_id="evil", model="m", profile=profile, shards=[ShardPlacement(node_id="n1")]),
            id="replica/evil/start", task_queue=CONTROL_QUEUE,
        )

    with pytest.raises(WorkflowFailureError) as e:
        asyncio.run(start())
    cause = e.value.cause
    messages = []
    while cause is not None:
        messages.append(str(cause))
        cause = cause.__cause__
    assert any("refused on node n1" in m for m in messages), messages
    assert not list((cp.state / "shards" / "n1").glob("*.json"))  # nothing was launched
    assert "launched shard" not in agent.log()
