"""`ReplicaWakeWorkflow` on its own (issue 39, patch `wake-local-steps`): the real workflow on a worker in this
process, with stand-in control and node activities of the same names, on the session's Temporal dev server.

- Its sleep closed: the control steps run as local activities (markers, no activity task on the control
  queue): only the node's `wake_shard` is scheduled, and the replica is marked Ready.
- Its sleep still running: the local check says so, and the wake waits for it through the activity that
  heartbeats (`await_start_closed`, scheduled), then wakes.
"""

from __future__ import annotations

import uuid

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from llmgw.control.worker import workflow_runner
from llmgw.schemas.payloads import (
    AwaitStartClosedInput, AwaitStartClosedResult, MarkReplicaResult, MarkSleepInput, ReplicaShardsInput,
    ReplicaShardsResult, ReplicaWakeInput, ShardPlacement, WakeShardInput, WakeShardResult,
)
from llmgw.workflows.queues import CONTROL_QUEUE, node_queue
from llmgw.workflows.sleep import ReplicaWakeWorkflow

pytestmark = pytest.mark.integration


class Control:
    """Stand-ins for the control activities a wake calls; `sleep_running`: how many checks find the sleep
    workflow still running."""

    def __init__(self, sleep_running: int = 0) -> None:
        self.sleep_running = sleep_running
        self.calls: list[str] = []

    @activity.defn(name="await_start_closed")
    async def await_start_closed(self, inp: AwaitStartClosedInput) -> AwaitStartClosedResult:
        self.calls.append(f"await_start_closed:{inp.workflow}:{inp.timeout_s:g}")
        if self.sleep_running and inp.timeout_s == 0:
            self.sleep_running -= 1
            return AwaitStartClosedResult(closed=False, status="still running after 0s")
        return AwaitStartClosedResult(closed=True, status="completed")

    @activity.defn(name="get_replica_shards")
    async def get_replica_shards(self, inp: ReplicaShardsInput) -> ReplicaShardsResult:
        self.calls.append("get_replica_shards")
        return ReplicaShardsResult(shards=[ShardPlacement(node_id="n1", rank=0)], status="sleeping", generation=2)

    @activity.defn(name="mark_sleep")
    async def mark_sleep(self, inp: MarkSleepInput) -> MarkReplicaResult:
        self.calls.append(f"mark_sleep:{inp.asleep}")
        return MarkReplicaResult(applied=True, status="ready", generation=2)

    def all(self) -> list:
        return [self.await_start_closed, self.get_replica_shards, self.mark_sleep]


class Node:
    def __init__(self) -> None:
        self.calls: list[str] = []

    @activity.defn(name="wake_shard")
    async def wake_shard(self, inp: WakeShardInput) -> WakeShardResult:
        self.calls.append(f"wake_shard:{inp.generation}")
        return WakeShardResult(shard_id=inp.shard_id, took_s=0.01)


async def run_wake(temporal, namespace: str, control: Control, node: Node):
    client = await Client.connect(temporal.address, namespace=namespace, data_converter=pydantic_data_converter)
    rid = str(uuid.uuid4())
    async with Worker(client, task_queue=CONTROL_QUEUE, workflows=[ReplicaWakeWorkflow], activities=control.all(),
                      workflow_runner=workflow_runner()), \
            Worker(client, task_queue=node_queue("n1"), activities=[node.wake_shard]):
        handle = await client.start_workflow(ReplicaWakeWorkflow.run, ReplicaWakeInput(replica_id=rid, model="m"),
                                             id=f"replica/{rid}/wake", task_queue=CONTROL_QUEUE)
        return await handle.result(), await handle.fetch_history()


def scheduled(history) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


async def test_a_wake_whose_sleep_has_closed_schedules_only_the_nodes_step(temporal, namespace):
    control, node = Control(), Node()
    result, history = await run_wake(temporal, namespace, control, node)
    assert result == "ready"
    assert scheduled(history) == ["wake_shard"]  # the control steps were local activities
    assert control.calls == ["await_start_closed:sleep:0", "get_replica_shards", "mark_sleep:False"]
    assert node.calls == ["wake_shard:2"]


async def test_a_wake_whose_sleep_still_runs_waits_for_it_then_wakes(temporal, namespace):
    control, node = Control(sleep_running=1), Node()
    result, history = await run_wake(temporal, namespace, control, node)
    assert result == "ready"
    assert scheduled(history) == ["await_start_closed", "wake_shard"]  # the wait, by the activity that heartbeats
    assert control.calls == ["await_start_closed:sleep:0", "await_start_closed:sleep:120", "get_replica_shards",
                             "mark_sleep:False"]
    assert node.calls == ["wake_shard:2"]
