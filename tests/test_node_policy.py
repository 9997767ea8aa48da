"""The node checks engine policy again before launching, whatever sent the profile (seeds 003): a start
workflow carrying LD_PRELOAD, an argparse prefix of --host (`--hos`) or CUDA_VISIBLE_DEVICES, which the
catalog would have refused, fails on the node with the reason, and no engine process is started. (The
replica is recorded as placed first, as a replica of a model the catalog wants and no node can take, so the
reconciler keeps it rather than stopping it: a start for a replica the database does not have as `starting`
launches nothing at all.)"""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter

from llmgw.db import fleet_repo
from llmgw.db.engine import async_engine
from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import ReplicaStartInput, ShardPlacement
from llmgw.workflows.queues import CONTROL_QUEUE
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("profile, says", [
    (Profile(engine="sim", env={"LD_PRELOAD": "/tmp/evil.so"}), "refused on node n1"),
    (Profile(engine="sim", args=["--hos", "0.0.0.0"]), "refused on node n1"),  # argparse would read it as --host
    (Profile(engine="sim", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}), "refused on node n1"),
    # vLLM's positional model: `vllm serve --trust-remote-code --enforce-eager evil/x` turns the flag on.
    (Profile(engine="vllm", source="--trust-remote-code", args=["--enforce-eager", "evil/x"]),
     "source '--trust-remote-code' is not a model id"),
], ids=["LD_PRELOAD", "--hos", "CUDA_VISIBLE_DEVICES", "source-as-flag"])
def test_node_refuses_a_profile_the_catalog_would_have_refused(control_plane, temporal, namespace, profile, says):
    cp = control_plane.start()
    agent = cp.agent("n1")  # no GPUs: the catalog's own profile for m needs one, so nothing else is placed
    wait_until(lambda: "registered node n1" in agent.log(), timeout_s=30, what="agent registered")
    wanted = {"name": "m", "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "sim", "gpus_per_node": 1}]}
    assert cp.apply({"models": [wanted]}).status_code == 200

    async def start():
        engine = async_engine(cp.env["LLMGW_DATABASE_URL"])
        try:
            async with engine.begin() as conn:
                await fleet_repo.create_replica(conn, "evil", "m", "default", [ShardPlacement(node_id="n1")])
        finally:
            await engine.dispose()
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
    assert any(says in m for m in messages), messages
    assert not list((cp.state / "shards" / "n1").glob("*.json"))  # nothing was launched
    assert "launched shard" not in agent.log()
