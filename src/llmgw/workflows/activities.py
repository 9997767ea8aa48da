"""The activities the workflows call, as typed stubs: one function per activity, its name in the defn and its
input and result types in the annotations, so a call reads `workflow.execute_activity(activities.stop_shard,
StopShardInput(...), task_queue=node_queue(node_id), **options.STOP)` and the result is decoded as the
annotation says (samples-python `hello/hello_activity_method.py`, here without the implementing class).

Workflow code cannot import what implements them (they hold a database engine, a node's supervisor, a
mirror's directory: `control/activities.py`, `control/decide.py`, `node/activities.py`,
`mirror/activities.py`), so the stubs stand in for them: they are never run. The names are the ones in
histories and must never change; `tests/test_activity_stubs.py` checks that each stub has exactly one
implementation, registered on the worker of its list below, with the same name and the same annotations.
"""

from __future__ import annotations

from temporalio import activity

from llmgw.schemas.batches import FinishBatchInput, FinishBatchResult, RunBatchInput, RunBatchResult
from llmgw.schemas.mirror import (
    DiscardInput, DiscardResult, ExploreInput, FetchMirrorFileInput, MirroredFile, MirrorPlan, PublishInput,
    PublishResult,
)
from llmgw.schemas.payloads import (
    AwaitStartClosedInput, AwaitStartClosedResult, CheckReplicaInput, CheckReplicaResult, DecideInput, DecideResult,
    MarkSleepInput, SleepShardInput, SleepShardResult, WakeShardInput, WakeShardResult,
    DrainShardInput, DrainShardResult, FetchWeightsInput, FetchWeightsResult, LaunchShardInput, LaunchShardResult,
    MarkReplicaInput, MarkReplicaResult, NodeReclaimInput, NodeReclaimResult, OpenRendezvousInput, ReadShardLogInput,
    ReadShardLogResult, ReclaimTargets, RecordDecisionsInput, RecordPlacementInput, RecordPlacementsInput,
    RecordReplicaFailureInput, Rendezvous, ReplicaShardsInput, ReplicaShardsResult, ResetModelFailuresInput,
    RolloutStep, RolloutStepInput, SettleReplicaInput, SettleReplicaResult, Snapshot, StartShardInput,
    StopShardInput, StopShardResult, WaitShardJoinedInput, WaitShardJoinedResult, WaitShardReadyInput,
    WaitShardReadyResult,
)


def _stub() -> NotImplementedError:
    return NotImplementedError("an activity stub for workflow code: the worker runs the implementation")


# ---- control worker (CONTROL_QUEUE): control/activities.py, control/decide.py -----------------------

@activity.defn(name="decide")
async def decide(inp: DecideInput) -> DecideResult:
    raise _stub()


@activity.defn(name="record_placements")
async def record_placements(inp: RecordPlacementsInput) -> None:
    raise _stub()


@activity.defn(name="read_snapshot")
async def read_snapshot() -> Snapshot:
    """The legacy reconciler pass only (histories from before `decide`)."""
    raise _stub()


@activity.defn(name="record_decisions")
async def record_decisions(inp: RecordDecisionsInput) -> None:
    raise _stub()


@activity.defn(name="record_placement")
async def record_placement(inp: RecordPlacementInput) -> None:
    raise _stub()


@activity.defn(name="mark_replica")
async def mark_replica(inp: MarkReplicaInput) -> MarkReplicaResult:
    raise _stub()


@activity.defn(name="settle_replica")
async def settle_replica(inp: SettleReplicaInput) -> SettleReplicaResult:
    raise _stub()


@activity.defn(name="record_replica_failure")
async def record_replica_failure(inp: RecordReplicaFailureInput) -> None:
    raise _stub()


@activity.defn(name="reset_model_failures")
async def reset_model_failures(inp: ResetModelFailuresInput) -> None:
    raise _stub()


@activity.defn(name="get_replica_shards")
async def get_replica_shards(inp: ReplicaShardsInput) -> ReplicaShardsResult:
    raise _stub()


@activity.defn(name="check_replica")
async def check_replica(inp: CheckReplicaInput) -> CheckReplicaResult:
    """Also called as a local activity (on the control worker, inside the workflow task)."""
    raise _stub()


@activity.defn(name="await_start_closed")
async def await_start_closed(inp: AwaitStartClosedInput) -> AwaitStartClosedResult:
    raise _stub()


@activity.defn(name="mark_sleep")
async def mark_sleep(inp: MarkSleepInput) -> MarkReplicaResult:
    """Ready -> sleeping, or sleeping -> Ready (issue 39)."""
    raise _stub()


@activity.defn(name="reclaim_targets")
async def reclaim_targets() -> ReclaimTargets:
    raise _stub()


@activity.defn(name="rollout_step")
async def rollout_step(inp: RolloutStepInput) -> RolloutStep:
    raise _stub()


# ---- node worker (node_queue(node_id)): node/activities.py ------------------------------------------

@activity.defn(name="fetch_weights")
async def fetch_weights(inp: FetchWeightsInput) -> FetchWeightsResult:
    raise _stub()


@activity.defn(name="open_rendezvous")
async def open_rendezvous(inp: OpenRendezvousInput) -> Rendezvous:
    raise _stub()


@activity.defn(name="launch_shard")
async def launch_shard(inp: LaunchShardInput) -> LaunchShardResult:
    raise _stub()


@activity.defn(name="start_shard")
async def start_shard(inp: StartShardInput) -> LaunchShardResult:
    raise _stub()


@activity.defn(name="wait_shard_joined")
async def wait_shard_joined(inp: WaitShardJoinedInput) -> WaitShardJoinedResult:
    raise _stub()


@activity.defn(name="wait_shard_ready")
async def wait_shard_ready(inp: WaitShardReadyInput) -> WaitShardReadyResult:
    raise _stub()


@activity.defn(name="drain_shard")
async def drain_shard(inp: DrainShardInput) -> DrainShardResult:
    raise _stub()


@activity.defn(name="stop_shard")
async def stop_shard(inp: StopShardInput) -> StopShardResult:
    raise _stub()


@activity.defn(name="sleep_shard")
async def sleep_shard(inp: SleepShardInput) -> SleepShardResult:
    raise _stub()


@activity.defn(name="wake_shard")
async def wake_shard(inp: WakeShardInput) -> WakeShardResult:
    raise _stub()


@activity.defn(name="reclaim_cache")
async def reclaim_cache(inp: NodeReclaimInput) -> NodeReclaimResult:
    raise _stub()


@activity.defn(name="read_shard_log")
async def read_shard_log(inp: ReadShardLogInput) -> ReadShardLogResult:
    raise _stub()


@activity.defn(name="run_batch_requests")
async def run_batch_requests(inp: RunBatchInput) -> RunBatchResult:
    raise _stub()


@activity.defn(name="finish_batch")
async def finish_batch(inp: FinishBatchInput) -> FinishBatchResult:
    raise _stub()


# ---- mirror worker (MIRROR_QUEUE): mirror/activities.py ---------------------------------------------

@activity.defn(name="explore_mirror_sources")
async def explore_mirror_sources(inp: ExploreInput) -> MirrorPlan:
    raise _stub()


@activity.defn(name="fetch_mirror_file")
async def fetch_mirror_file(inp: FetchMirrorFileInput) -> MirroredFile:
    raise _stub()


@activity.defn(name="publish_mirror_version")
async def publish_mirror_version(inp: PublishInput) -> PublishResult:
    raise _stub()


@activity.defn(name="discard_mirror_version")
async def discard_mirror_version(inp: DiscardInput) -> DiscardResult:
    raise _stub()


# Which worker registers each: the control worker (control/worker.py), every node's worker (node/agent.py),
# the mirror worker (mirror/worker.py).
CONTROL = [decide, record_placements, read_snapshot, record_decisions, record_placement, mark_replica,
           settle_replica, record_replica_failure, reset_model_failures, get_replica_shards, check_replica,
           await_start_closed, reclaim_targets, rollout_step, mark_sleep, run_batch_requests, finish_batch]
NODE = [fetch_weights, open_rendezvous, launch_shard, start_shard, wait_shard_joined, wait_shard_ready, drain_shard,
        stop_shard, reclaim_cache, read_shard_log, sleep_shard, wake_shard]
MIRROR = [explore_mirror_sources, fetch_mirror_file, publish_mirror_version, discard_mirror_version]
