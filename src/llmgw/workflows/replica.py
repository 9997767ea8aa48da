"""Replica lifecycle workflows: start (fetch → rendezvous → launch → joined/ready) and stop (drain → stop).

Placement is decided before `ReplicaStartWorkflow` runs. Per shard, on the node's own task queue:

1. fetch the weights (all shards at once; one download per node);
2. multi-node only: open the rendezvous on rank 0's node (`open_rendezvous`), an address every shard is
   given at launch, so workers started first know where rank 0 will be;
3. launch the workers (ranks > 0), then rank 0: SGLang's ranks meet at rank 0's dist-init address and
   vLLM under Ray needs its workers attached before the head serves (seeds 003);
4. wait, together, for every worker to have joined rank 0 (`wait_shard_joined`, on the worker's node)
   and for rank 0 to answer its readiness check (`wait_shard_ready`); only rank 0 serves HTTP.

One shard failing fails the replica: every shard is stopped, the failure recorded, and the model backs
off (jittered, exponential; seeds 003). A replica is *settled* when that is done, exactly once, so the
failure is counted once whichever workflow gets there first.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.payloads import (
        FetchWeightsInput, FetchWeightsResult, LaunchShardInput, LaunchShardResult, MarkReplicaInput,
        MarkReplicaResult, OpenRendezvousInput, Rendezvous, ReplicaShardsInput, ReplicaShardsResult,
        ReplicaStartInput, ReplicaStartResult, ReplicaStopInput, SettleReplicaInput, SettleReplicaResult,
        ShardPlacement, StopShardInput, StopShardResult, WaitShardJoinedInput, WaitShardJoinedResult,
        WaitShardReadyInput, WaitShardReadyResult,
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


async def mark(replica_id: str, status: str, endpoint: str | None = None, failure: str | None = None,
               reason: str | None = None) -> MarkReplicaResult:
    return await workflow.execute_activity(
        "mark_replica", MarkReplicaInput(replica_id=replica_id, status=status, endpoint=endpoint, failure=failure,
                                         reason=reason),
        result_type=MarkReplicaResult, task_queue=CONTROL_QUEUE, **options.CONTROL,
    )


async def settle(replica_id: str, reason: str) -> SettleReplicaResult:
    """Mark the ended replica settled; when this call is the one that settles a failed replica, count the
    failure against its model (backoff kept on the model, seeds 003)."""
    res: SettleReplicaResult = await workflow.execute_activity(
        "settle_replica", SettleReplicaInput(replica_id=replica_id, reason=reason[-2000:]),
        result_type=SettleReplicaResult, task_queue=CONTROL_QUEUE, **options.CONTROL,
    )
    if res.applied and res.status == "failed" and res.model:
        await workflow.execute_activity("record_replica_failure", res.model, task_queue=CONTROL_QUEUE, **options.CONTROL)
    return res


async def stop_shards(replica_id: str, shards: list[ShardPlacement]) -> None:
    """Stop every shard at once, best effort per node. The replica is already out of routing (draining,
    failed or lost), and one unreachable node must not keep the others' GPUs held while it times out."""
    async def one(s: ShardPlacement) -> None:
        try:
            await workflow.execute_activity(
                "stop_shard", StopShardInput(shard_id=shard_id(replica_id, s.rank)),
                result_type=StopShardResult, task_queue=node_queue(s.node_id), **options.STOP,
            )
        except ActivityError as exc:
            workflow.logger.warning("stop of shard %s on %s failed: %s", shard_id(replica_id, s.rank), s.node_id, failure_text(exc))

    await asyncio.gather(*[one(s) for s in shards])


@workflow.defn(name="ReplicaStartWorkflow")
class ReplicaStartWorkflow:
    """Bring one placed replica to Ready. Id: `replica/<replica_id>/start`."""

    def __init__(self) -> None:
        self._phase = "starting"

    @workflow.query
    def phase(self) -> str:
        return self._phase

    async def _launch(self, inp: ReplicaStartInput, s: ShardPlacement, path: str | None,
                      rdv: Rendezvous | None) -> LaunchShardResult:
        return await workflow.execute_activity(
            "launch_shard",
            LaunchShardInput(shard_id=shard_id(inp.replica_id, s.rank), replica_id=inp.replica_id, model=inp.model,
                             profile=inp.profile, rank=s.rank, gpus=s.gpus, weights_path=path, rendezvous=rdv),
            result_type=LaunchShardResult, task_queue=node_queue(s.node_id), **options.LAUNCH,
        )

    @workflow.run
    async def run(self, inp: ReplicaStartInput) -> ReplicaStartResult:
        rid = inp.replica_id
        rank0 = next(s for s in inp.shards if s.rank == 0)
        workers = sorted((s for s in inp.shards if s.rank != 0), key=lambda s: s.rank)
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
            rdv: Rendezvous | None = None
            if workers:
                self._phase = "opening the rendezvous on rank 0's node"
                rdv = await workflow.execute_activity(
                    "open_rendezvous",
                    OpenRendezvousInput(replica_id=rid, engine=inp.profile.engine, world_size=len(inp.shards)),
                    result_type=Rendezvous, task_queue=node_queue(rank0.node_id), **options.NODE_QUICK,
                )
                self._phase = f"launching {len(workers)} worker(s)"
                await asyncio.gather(*[self._launch(inp, s, paths[s.rank], rdv) for s in workers])
            self._phase = "launching rank 0"
            await self._launch(inp, rank0, paths[0], rdv)
            self._phase = "waiting for the workers to join rank 0 and for rank 0 to be ready" if workers \
                else "waiting for readiness"
            waits = [
                workflow.execute_activity(
                    "wait_shard_joined", WaitShardJoinedInput(shard_id=shard_id(rid, s.rank), timeout_s=inp.ready_timeout_s),
                    result_type=WaitShardJoinedResult, task_queue=node_queue(s.node_id), **options.ready(inp.ready_timeout_s),
                )
                for s in workers
            ]
            ready_task = workflow.execute_activity(
                "wait_shard_ready", WaitShardReadyInput(shard_id=shard_id(rid, 0), timeout_s=inp.ready_timeout_s),
                result_type=WaitShardReadyResult, task_queue=node_queue(rank0.node_id), **options.ready(inp.ready_timeout_s),
            )
            results = await asyncio.gather(*waits, ready_task)
            ready: WaitShardReadyResult = results[-1]
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
        # Failed first: out of routing, and the exits the stop causes are not news to anyone.
        await mark(inp.replica_id, "failed", failure=reason[-2000:], reason="failed to start")
        await stop_shards(inp.replica_id, inp.shards)
        await settle(inp.replica_id, "failed to start")
        await wake_reconciler(f"replica {inp.replica_id} failed")


@workflow.defn(name="ReplicaStopWorkflow")
class ReplicaStopWorkflow:
    """Drain then stop one replica, or stop what is left of one that failed or was lost.
    Id: `replica/<replica_id>/stop`.

    Draining: the replica is marked Draining so gateways send it nothing new; the node waits for the
    engine's in-flight requests to finish (or `drain_timeout_s`). Then it is marked with its final status
    and every shard is stopped; marking first means a shard that exits because its peer was stopped is not
    taken for a failure. Until settled, placement still counts its GPUs as held. For `final_status`
    `failed`/`lost` there is no drain. Either way it ends settled, and a failure is counted once.
    """

    @workflow.run
    async def run(self, inp: ReplicaStopInput) -> str:
        rid = inp.replica_id
        info: ReplicaShardsResult = await workflow.execute_activity(
            "get_replica_shards", ReplicaShardsInput(replica_id=rid), result_type=ReplicaShardsResult,
            task_queue=CONTROL_QUEUE, **options.CONTROL,
        )
        final = inp.final_status
        failure = (inp.reason or None) if final != "stopped" else None
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
        await mark(rid, final, failure=failure, reason=inp.reason or None)
        await stop_shards(rid, info.shards)
        res = await settle(rid, inp.reason)
        await wake_reconciler(f"replica {rid} {res.status}")
        return res.status
