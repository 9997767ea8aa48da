"""`ReplicaStartWorkflow` on its own (issue 13, `issue13-one-node-step`): the real workflow on a worker in
this process, with stand-in control and node activities of the same names, on the session's Temporal dev
server.

- A single-shard start is one node step, `start_shard`; a node whose worker predates it (no such activity)
  fails it at once with `NotFoundError`, and the start falls back to asking "still wanted?", fetching and
  launching in steps, and still becomes Ready.
- A `start_shard` that finds the replica no longer wanted (`NotWanted`) ends the start: nothing else is
  launched, the shard is stopped (fenced) and the workflow fails saying why.
"""

from __future__ import annotations

import uuid

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import (
    NOT_WANTED, CheckReplicaInput, CheckReplicaResult, FetchWeightsInput, FetchWeightsResult, LaunchShardInput,
    LaunchShardResult, MarkReplicaInput, MarkReplicaResult, ReplicaStartInput, ResetModelFailuresInput, ShardPlacement,
    StartShardInput, StopShardInput, StopShardResult, WaitShardReadyInput, WaitShardReadyResult,
)
from llmgw.control.worker import workflow_runner
from llmgw.workflows.queues import CONTROL_QUEUE, node_queue
from llmgw.workflows.replica import ReplicaStartWorkflow

pytestmark = pytest.mark.integration


class Control:
    """Stand-ins for the control activities a start calls."""

    def __init__(self) -> None:
        self.marks: list[str] = []

    @activity.defn(name="check_replica")
    async def check_replica(self, inp: CheckReplicaInput) -> CheckReplicaResult:
        return CheckReplicaResult(wanted=True, status="starting", generation=1)

    @activity.defn(name="mark_replica")
    async def mark_replica(self, inp: MarkReplicaInput) -> MarkReplicaResult:
        self.marks.append(inp.status)
        return MarkReplicaResult(applied=True, status=inp.status, generation=2)

    @activity.defn(name="reset_model_failures")
    async def reset_model_failures(self, inp: ResetModelFailuresInput) -> None:
        return None

    def all(self) -> list:
        return [self.check_replica, self.mark_replica, self.reset_model_failures]


class OldNode:
    """A node worker from before `start_shard`: fetch, launch and wait, as separate activities."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @activity.defn(name="fetch_weights")
    async def fetch_weights(self, inp: FetchWeightsInput) -> FetchWeightsResult:
        self.calls.append("fetch_weights")
        return FetchWeightsResult(path="/weights")

    @activity.defn(name="launch_shard")
    async def launch_shard(self, inp: LaunchShardInput) -> LaunchShardResult:
        self.calls.append(f"launch_shard:{inp.weights_path}:{inp.generation}")
        return LaunchShardResult(shard_id=inp.shard_id, pid=4242, endpoint="http://127.0.0.1:1")

    @activity.defn(name="wait_shard_ready")
    async def wait_shard_ready(self, inp: WaitShardReadyInput) -> WaitShardReadyResult:
        self.calls.append("wait_shard_ready")
        return WaitShardReadyResult(shard_id=inp.shard_id, endpoint="http://127.0.0.1:1")

    @activity.defn(name="stop_shard")
    async def stop_shard(self, inp: StopShardInput) -> StopShardResult:
        self.calls.append(f"stop_shard:{inp.generation}")
        return StopShardResult(shard_id=inp.shard_id, was_running=False)

    def all(self) -> list:
        return [self.fetch_weights, self.launch_shard, self.wait_shard_ready, self.stop_shard]


class NodeThatFindsItStopped(OldNode):
    @activity.defn(name="start_shard")
    async def start_shard(self, inp: StartShardInput) -> LaunchShardResult:
        self.calls.append("start_shard")
        raise ApplicationError("replica became stopped before launching", "stopped", "launching", type=NOT_WANTED,
                               non_retryable=True)

    def all(self) -> list:
        return super().all() + [self.start_shard]


def start_input(replica_id: str) -> ReplicaStartInput:
    return ReplicaStartInput(replica_id=replica_id, model="m", profile=Profile(engine="sim"),
                             shards=[ShardPlacement(node_id="n1", rank=0)], ready_timeout_s=30)


async def run_start(temporal, namespace: str, node: OldNode, control: Control, replica_id: str):
    client = await Client.connect(temporal.address, namespace=namespace, data_converter=pydantic_data_converter)
    async with Worker(client, task_queue=CONTROL_QUEUE, workflows=[ReplicaStartWorkflow], activities=control.all(),
                      workflow_runner=workflow_runner()), \
            Worker(client, task_queue=node_queue("n1"), activities=node.all()):
        handle = await client.start_workflow(ReplicaStartWorkflow.run, start_input(replica_id),
                                             id=f"replica/{replica_id}/start", task_queue=CONTROL_QUEUE)
        try:
            return await handle.result(), await handle.fetch_history()
        except WorkflowFailureError as exc:
            return exc, await handle.fetch_history()


def scheduled(history) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


async def test_a_node_without_start_shard_gets_the_steps_and_the_replica_becomes_ready(temporal, namespace):
    node, control = OldNode(), Control()
    rid = str(uuid.uuid4())
    result, history = await run_start(temporal, namespace, node, control, rid)
    assert result.replica_id == rid and control.marks == ["ready"]
    assert scheduled(history) == ["start_shard", "fetch_weights", "launch_shard", "wait_shard_ready", "mark_replica",
                                  "reset_model_failures"]
    failed = [e.activity_task_failed_event_attributes.failure for e in history.events
              if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED]
    assert len(failed) == 1 and failed[0].application_failure_info.type == "NotFoundError"
    attempts = [e.activity_task_started_event_attributes.attempt for e in history.events
                if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED]
    assert attempts[0] == 1  # start_shard was tried once, not retried for half a minute
    # The steps asked "still wanted?" (a local activity: a marker) and carried its generation into the launch.
    assert node.calls == ["fetch_weights", "launch_shard:/weights:1", "wait_shard_ready"]
    assert any(e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
               and e.marker_recorded_event_attributes.marker_name == "core_local_activity" for e in history.events)


async def test_a_start_shard_that_finds_the_replica_unwanted_ends_the_start_and_launches_nothing(temporal, namespace):
    node, control = NodeThatFindsItStopped(), Control()
    rid = str(uuid.uuid4())
    result, history = await run_start(temporal, namespace, node, control, rid)
    assert isinstance(result, WorkflowFailureError)
    assert f"replica {rid} became stopped before launching; nothing more was launched" in str(result.cause)
    assert node.calls == ["start_shard", "stop_shard:0"]  # stopped and fenced (every launch of it); no wait
    assert control.marks == []


class ControlWhereAStopCameFirst(Control):
    """The node pushed "ready" (the replica is Ready before its start's mark), then a stop marked it draining."""

    @activity.defn(name="mark_replica")
    async def mark_replica(self, inp: MarkReplicaInput) -> MarkReplicaResult:
        self.marks.append(inp.status)
        return MarkReplicaResult(applied=False, status="draining", generation=3)


async def test_a_start_that_finds_its_replica_draining_leaves_the_engine_to_the_drain(temporal, namespace):
    """Stopping the shards here would cut the requests the stop is draining (drain_timeout_s ignored)."""
    node, control = OldNode(), ControlWhereAStopCameFirst()
    rid = str(uuid.uuid4())
    result, history = await run_start(temporal, namespace, node, control, rid)
    assert isinstance(result, WorkflowFailureError)
    assert f"replica {rid} became draining while starting; its stop drains and stops it" in str(result.cause)
    assert control.marks == ["ready"] and not [c for c in node.calls if c.startswith("stop_shard")], node.calls
    assert "stop_shard" not in scheduled(history)
