"""Replica lifecycle workflows: start (fetch → launch → ready) and stop (drain → stop).

Placement is decided before `ReplicaStartWorkflow` runs. Per shard, on the node's own task queue:
fetch weights, launch (workers before rank 0: SGLang ranks rendezvous and vLLM under Ray needs its
workers attached before the head serves), then rank 0's readiness. One shard failing fails the replica:
every shard is stopped, the failure recorded, and the model backs off (seeds 003).
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.payloads import (
        FetchWeightsInput, FetchWeightsResult, LaunchShardInput, LaunchShardResult, MarkReplicaInput,
        MarkReplicaResult, ReplicaShardsInput, ReplicaShardsResult, ReplicaStartInput, ReplicaStartResult,
        ReplicaStopInput, ShardPlacement, StopShardInput, StopShardResult, WaitShardReadyInput,
        WaitShardReadyResult,
    )
    from llmgw.workflows import options
    from llmgw.workflows.queues import CONTROL_QUEUE, RECONCILER_ID, node_queue


def shard_id(replica_id: str, rank: int) -> str:
    return f"{replica_id}-r{rank}"


def failure_text(exc: BaseException) -> str:
    """The innermost message of an activity/child failure: what actually went wrong on the node."""
    parts = []
    e: BaseException | None = exc
    while e is not None:
        msg = getattr(e, "message", None) or str(e)
        if msg and msg not in parts and not isinstance(e, (ActivityError, ChildWorkflowError)):
            parts.append(msg)
        e = e.__cause__
    return "; ".join(parts) or type(exc).__name__


async def wake_reconciler(reason: str) -> None:
    try:
        await workflow.get_external_workflow_handle(RECONCILER_ID).signal("wake", reason)
    except Exception:  # noqa: BLE001 - the reconciler also runs on a timer; a lost wake-up only delays it
        workflow.logger.warning("could not signal the reconciler")


async def mark(replica_id: str, status: str, endpoint: str | None = None, failure: str | None = None) -> MarkReplicaResult:
    return await workflow.execute_activity(
        "mark_replica", MarkReplicaInput(replica_id=replica_id, status=status, endpoint=endpoint, failure=failure),
        result_type=MarkReplicaResult, task_queue=CONTROL_QUEUE, **options.CONTROL,
    )


async def stop_shards(replica_id: str, shards: list[ShardPlacement]) -> None:
    """Stop rank 0 first (no new work reaches the workers), then the workers; best effort per node."""
    for s in sorted(shards, key=lambda s: s.rank):
        try:
            await workflow.execute_activity(
                "stop_shard", StopShardInput(shard_id=shard_id(replica_id, s.rank)),
                result_type=StopShardResult, task_queue=node_queue(s.node_id), **options.STOP,
            )
        except ActivityError as exc:
            workflow.logger.warning("stop of shard %s on %s failed: %s", shard_id(replica_id, s.rank), s.node_id, failure_text(exc))


@workflow.defn(name="ReplicaStartWorkflow")
class ReplicaStartWorkflow:
    """Bring one placed replica to Ready. Id: `replica/<replica_id>/start`."""

    def __init__(self) -> None:
        self._phase = "starting"

    @workflow.query
    def phase(self) -> str:
        return self._phase

    @workflow.run
    async def run(self, inp: ReplicaStartInput) -> ReplicaStartResult:
        rid = inp.replica_id
        try:
            self._phase = "fetching weights"
            fetched: list[FetchWeightsResult] = await asyncio.gather(*[
                workflow.execute_activity(
                    "fetch_weights", FetchWeightsInput(replica_id=rid, source=inp.profile.source),
                    result_type=FetchWeightsResult, task_queue=node_queue(s.node_id), **options.FETCH,
                )
                for s in inp.shards
            ])
            paths = {s.rank: f.path for s, f in zip(inp.shards, fetched)}
            self._phase = "launching"
            launched: dict[int, LaunchShardResult] = {}
            for s in sorted(inp.shards, key=lambda s: (s.rank == 0, s.rank)):
                launched[s.rank] = await workflow.execute_activity(
                    "launch_shard",
                    LaunchShardInput(shard_id=shard_id(rid, s.rank), replica_id=rid, model=inp.model, profile=inp.profile,
                                     rank=s.rank, gpus=s.gpus, weights_path=paths[s.rank]),
                    result_type=LaunchShardResult, task_queue=node_queue(s.node_id), **options.LAUNCH,
                )
            self._phase = "waiting for readiness"
            rank0 = next(s for s in inp.shards if s.rank == 0)
            ready = await workflow.execute_activity(
                "wait_shard_ready", WaitShardReadyInput(shard_id=shard_id(rid, 0), timeout_s=inp.ready_timeout_s),
                result_type=WaitShardReadyResult, task_queue=node_queue(rank0.node_id), **options.ready(inp.ready_timeout_s),
            )
        except (ActivityError, asyncio.CancelledError) as exc:
            reason = failure_text(exc) if isinstance(exc, ActivityError) else "start was cancelled"
            await self._fail(inp, reason)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise ApplicationError(f"replica {rid} failed to start: {reason}", non_retryable=True) from None

        res = await mark(rid, "ready", endpoint=ready.endpoint)
        if not res.applied:
            # Stopped, failed or lost while it was starting (a node re-registered without it, a stop came):
            # do not leave an engine running that nothing routes to.
            self._phase = f"abandoned ({res.status})"
            await stop_shards(rid, inp.shards)
            raise ApplicationError(f"replica {rid} became {res.status} while starting; its shards were stopped",
                                   non_retryable=True)
        await workflow.execute_activity("reset_model_failures", inp.model, task_queue=CONTROL_QUEUE, **options.CONTROL)
        self._phase = "ready"
        return ReplicaStartResult(replica_id=rid, endpoint=ready.endpoint)

    async def _fail(self, inp: ReplicaStartInput, reason: str) -> None:
        self._phase = "failed: " + reason
        await asyncio.shield(self._cleanup(inp, reason))

    async def _cleanup(self, inp: ReplicaStartInput, reason: str) -> None:
        await stop_shards(inp.replica_id, inp.shards)
        await mark(inp.replica_id, "failed", failure=reason[-2000:])
        await workflow.execute_activity(
            "record_replica_failure", inp.model, task_queue=CONTROL_QUEUE, **options.CONTROL,
        )
        await wake_reconciler(f"replica {inp.replica_id} failed")


@workflow.defn(name="ReplicaStopWorkflow")
class ReplicaStopWorkflow:
    """Drain then stop one replica. Id: `replica/<replica_id>/stop`.

    Draining: the replica is marked Draining so gateways send it nothing new; the node waits for the
    engine's in-flight requests to finish (or `drain_timeout_s`), then every shard is stopped.
    """

    @workflow.run
    async def run(self, inp: ReplicaStopInput) -> str:
        rid = inp.replica_id
        info: ReplicaShardsResult = await workflow.execute_activity(
            "get_replica_shards", ReplicaShardsInput(replica_id=rid), result_type=ReplicaShardsResult,
            task_queue=CONTROL_QUEUE, **options.CONTROL,
        )
        final = inp.final_status
        if final == "stopped" and inp.drain_timeout_s > 0:
            res = await mark(rid, "draining")
            rank0 = next((s for s in info.shards if s.rank == 0), None)
            if res.applied and rank0 is not None:
                try:
                    await workflow.execute_activity(
                        "drain_shard", WaitShardReadyInput(shard_id=shard_id(rid, 0), timeout_s=inp.drain_timeout_s),
                        task_queue=node_queue(rank0.node_id), **options.drain(inp.drain_timeout_s),
                    )
                except ActivityError as exc:
                    workflow.logger.warning("drain of %s did not finish: %s", rid, failure_text(exc))
        else:
            await mark(rid, final, failure=inp.reason or None)
        await stop_shards(rid, info.shards)
        await mark(rid, final, failure=(inp.reason or None) if final != "stopped" else None)
        await wake_reconciler(f"replica {rid} {final}")
        return final
