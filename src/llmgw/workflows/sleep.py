"""Sleeping replicas' workflows (issue 39): put a Ready replica to sleep, and wake a sleeping one. Steps like a
drain, each on the node that runs the replica's rank 0 (the engine sleeps and wakes through its own HTTP
API, which reaches every rank of a multi-node engine).

`ReplicaSleepWorkflow` (`replica/<id>/sleep`): mark it sleeping (out of routing: gateways send it nothing
new), wait on the node until what it serves has finished, then put the engine to sleep. An engine still
serving after `drain_timeout_s` is not put to sleep (vLLM's sleep aborts what is in flight): the replica is
marked Ready again, it is in use. An engine that refuses to sleep (a vLLM started without sleep mode, an
engine that errs) is stopped: it was idle and would have been stopped at `idle_timeout` anyway.

`ReplicaWakeWorkflow` (`replica/<id>/wake`): wait for the sleep before it to close (uncancelled: its
engine ends asleep or awake, never half way), then, if the replica is still sleeping, wake the engine on
its node (fenced: a node told to stop the replica refuses) and mark it Ready (routed again, same process).
An engine that does not wake is stopped as failed, so the model's next request gets a fresh replica.

A stop while it sleeps is any stop: `ReplicaStopWorkflow` marks it (bumping the fencing generation), and
stops its shards with that generation; a wake that comes after is refused by the node, and one before is
undone by the stop.

A request waits on the wake, so its control steps (is the sleep closed, the replica's shards, marking it
Ready) run as local activities (`WAKE_LOCAL`): one read or write each on this worker, inside the workflow
task, with no round trip through Temporal's task queue (three of them had cost ~40 ms of a wake's ~180 ms
of orchestration, issue 39). Only a sleep still running is waited for as before, by an activity that
heartbeats. Runs recorded before that patch (tests/histories/v8) replay as they ran.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.payloads import (
        STILL_SERVING, AwaitStartClosedInput, MarkReplicaResult, MarkSleepInput, ReplicaShardsInput,
        ReplicaShardsResult, ReplicaSleepInput, ReplicaStopInput, ReplicaWakeInput, SleepShardInput, WakeShardInput,
    )
    from llmgw.schemas.status import ReplicaStatus
    from llmgw.workflows import activities, attributes, options
    from llmgw.workflows.ids import replica_stop_id, shard_id
    from llmgw.workflows.patches import WAKE_LOCAL
    from llmgw.workflows.queues import CONTROL_QUEUE, node_queue
    from llmgw.workflows.replica import ReplicaStopWorkflow, failure_text, wake_reconciler

SLEEP_CLOSE_WAIT_S = 120.0  # a wake waits this long for the sleep before it


async def _shards(rid: str, local: bool = False) -> ReplicaShardsResult:
    if local:
        return await workflow.execute_local_activity(activities.get_replica_shards,
                                                     ReplicaShardsInput(replica_id=rid), **options.CONTROL)
    return await workflow.execute_activity(activities.get_replica_shards, ReplicaShardsInput(replica_id=rid),
                                           task_queue=CONTROL_QUEUE, **options.CONTROL)


async def _mark_sleep(rid: str, asleep: bool, local: bool = False) -> MarkReplicaResult:
    if local:
        return await workflow.execute_local_activity(activities.mark_sleep,
                                                     MarkSleepInput(replica_id=rid, asleep=asleep), **options.CONTROL)
    return await workflow.execute_activity(activities.mark_sleep, MarkSleepInput(replica_id=rid, asleep=asleep),
                                           task_queue=CONTROL_QUEUE, **options.CONTROL)


async def _await_sleep_closed(rid: str, local: bool) -> None:
    """Wait until the replica's sleep workflow has closed (a wake never meets an engine half asleep). With
    `local`, first asked once as a local activity; only a sleep still running is waited for by the activity."""
    wait = AwaitStartClosedInput(replica_id=rid, timeout_s=SLEEP_CLOSE_WAIT_S, cancel=False, workflow="sleep")
    if local:
        first = await workflow.execute_local_activity(activities.await_start_closed,
                                                      wait.model_copy(update={"timeout_s": 0}), **options.CONTROL)
        if first.closed:
            return
    await workflow.execute_activity(activities.await_start_closed, wait, task_queue=CONTROL_QUEUE,
                                    **options.await_close(SLEEP_CLOSE_WAIT_S))


async def _stop(rid: str, model: str, final: ReplicaStatus, reason: str) -> None:
    """Stop the replica through its stop workflow (no drain: nothing is in flight), abandoned to run on."""
    try:
        await workflow.start_child_workflow(
            ReplicaStopWorkflow.run, ReplicaStopInput(replica_id=rid, reason=reason, drain_timeout_s=0,
                                                      final_status=final),
            id=replica_stop_id(rid), task_queue=CONTROL_QUEUE, parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            memo=attributes.memo(model) if model else None,
        )
    except WorkflowAlreadyStartedError:
        pass  # already stopping


@workflow.defn(name="ReplicaSleepWorkflow")
class ReplicaSleepWorkflow:
    """Put one Ready replica to sleep. Id: `replica/<replica_id>/sleep`."""

    @workflow.run
    async def run(self, inp: ReplicaSleepInput) -> str:
        rid = inp.replica_id
        info = await _shards(rid)
        rank0 = next((s for s in info.shards if s.rank == 0), None)
        if info.status != ReplicaStatus.READY or rank0 is None:
            return f"not put to sleep: it is {info.status or 'gone'}"
        marked = await _mark_sleep(rid, True)
        if not marked.applied:
            return f"not put to sleep: it is {marked.status}"
        try:
            await workflow.execute_activity(
                activities.sleep_shard, SleepShardInput(shard_id=shard_id(rid, 0), replica_id=rid, level=inp.level,
                                                        timeout_s=inp.drain_timeout_s),
                task_queue=node_queue(rank0.node_id), **options.drain(inp.drain_timeout_s),
            )
        except ActivityError as exc:
            why = failure_text(exc)
            if isinstance(exc.cause, ApplicationError) and exc.cause.type == STILL_SERVING:
                back = await _mark_sleep(rid, False)  # in use: routed again, awake
                return f"kept awake ({why}); it is {back.status}"
            workflow.logger.warning("replica %s did not go to sleep (%s); stopping it", rid, why)
            await _stop(rid, inp.model, ReplicaStatus.STOPPED, f"could not sleep: {why}")
            return f"stopped: could not sleep: {why}"
        return "sleeping"


@workflow.defn(name="ReplicaWakeWorkflow")
class ReplicaWakeWorkflow:
    """Wake one sleeping replica and route it again. Id: `replica/<replica_id>/wake`."""

    @workflow.run
    async def run(self, inp: ReplicaWakeInput) -> str:
        rid = inp.replica_id
        local = workflow.patched(WAKE_LOCAL)
        await _await_sleep_closed(rid, local)
        info = await _shards(rid, local)
        rank0 = next((s for s in info.shards if s.rank == 0), None)
        if info.status != ReplicaStatus.SLEEPING or rank0 is None:
            return f"not woken: it is {info.status or 'gone'}"
        try:
            await workflow.execute_activity(
                activities.wake_shard, WakeShardInput(shard_id=shard_id(rid, 0), replica_id=rid,
                                                      generation=info.generation),
                task_queue=node_queue(rank0.node_id), **options.WAKE,
            )
        except ActivityError as exc:
            why = failure_text(exc)
            workflow.logger.warning("replica %s did not wake (%s); stopping it", rid, why)
            await _stop(rid, inp.model, ReplicaStatus.FAILED, f"could not wake: {why}")
            await wake_reconciler(f"replica {rid} did not wake")
            return f"failed: could not wake: {why}"
        res = await _mark_sleep(rid, False, local)
        return "ready" if res.applied else f"woken, but it is {res.status}: its stop stops it"
