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

A stopped replica never launches (issue 9; versioned with `workflow.patched`, so histories recorded
before keep their old path): the start asks whether the replica is still wanted before fetching and
before each launch, and carries the replica's fencing generation in every node command; a stop marks the
replica first (bumping the generation), then cancels the start and waits for it to close, then stops every
shard with the new generation, which each node records on disk and holds against later launches.

The cold-start path is kept short (issue 13): the "still wanted?" checks are local activities (no round
trip through the Temporal server each), and the node pushes readiness to the control plane itself, so a
replica is routed the moment its engine answers, before this workflow's `mark_replica(ready)` runs (which
then finds it Ready). Both versioned: `QUICK_CHECKS`; the push needs no versioning (activity code). A
single-shard replica (`ONE_NODE_STEP`) is fetched and launched by one node activity, `start_shard`, with no
workflow step before, between or after the two: the node itself asks the control plane "still wanted?"
(over the node API) before fetching and again after a fetch that took time, so both checks stay where
the fetch and the launch happen; a node whose worker predates it, or that cannot reach the node API to
ask, makes the start fall back to the steps (which ask through the control worker).
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.payloads import (
        NOT_WANTED, UNREACHABLE, AwaitStartClosedInput, CheckReplicaInput, DrainShardInput, FetchWeightsInput,
        FetchWeightsResult, LaunchShardInput, LaunchShardResult, MarkReplicaInput, MarkReplicaResult,
        OpenRendezvousInput, RecordReplicaFailureInput, Rendezvous, ReplicaShardsInput, ReplicaStartInput,
        ReplicaStartResult, ReplicaStopInput, ResetModelFailuresInput, SettleReplicaInput, SettleReplicaResult,
        ShardPlacement, StartShardInput, StopShardInput, WaitShardJoinedInput, WaitShardReadyInput,
        WaitShardReadyResult,
    )
    from llmgw.schemas.status import ReplicaStatus
    from llmgw.workflows import activities, options
    from llmgw.workflows.queues import CONTROL_QUEUE, node_queue
    from llmgw.workflows.ids import RECONCILER_ID, shard_id
    # workflow.patched ids, each registered with the version that added it and when it may go (patches.py)
    from llmgw.workflows.patches import (
        DRAIN_OWNS, FENCED_START, FETCH_BY_TIME, ONE_NODE_STEP, QUICK_CHECKS, SETTLE_COUNTS, STOP_FENCES_START,
    )

START_CLOSE_WAIT_S = 120.0  # a stop waits this long for the start it cancelled; node fences cover the rest


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


async def mark(replica_id: str, status: ReplicaStatus, endpoint: str | None = None, failure: str | None = None,
               reason: str | None = None) -> MarkReplicaResult:
    return await workflow.execute_activity(
        activities.mark_replica,
        MarkReplicaInput(replica_id=replica_id, status=status, endpoint=endpoint, failure=failure, reason=reason),
        task_queue=CONTROL_QUEUE, **options.CONTROL,
    )


async def settle(replica_id: str, reason: str) -> SettleReplicaResult:
    """Mark the ended replica settled; when this call is the one that settles a failed replica, count the
    failure against its model (backoff kept on the model, seeds 003). In one transaction (SETTLE_COUNTS):
    as two activities, a reconcile pass between them found the replica settled and no backoff yet, and
    started the model again at once."""
    counts = workflow.patched(SETTLE_COUNTS)
    res = await workflow.execute_activity(
        activities.settle_replica,
        SettleReplicaInput(replica_id=replica_id, reason=reason[-2000:], count_failure=counts),
        task_queue=CONTROL_QUEUE, **options.CONTROL,
    )
    if not counts and res.applied and res.status == ReplicaStatus.FAILED and res.model:
        await workflow.execute_activity(activities.record_replica_failure, RecordReplicaFailureInput(model=res.model),
                                        task_queue=CONTROL_QUEUE, **options.CONTROL)
    return res


async def stop_shards(replica_id: str, shards: list[ShardPlacement], generation: int = 0) -> None:
    """Stop every shard at once, best effort per node. The replica is already out of routing (draining,
    failed or lost), and one unreachable node must not keep the others' GPUs held while it times out.
    Each node fences the replica at `generation` first (0: every launch of it)."""
    async def one(s: ShardPlacement) -> None:
        try:
            await workflow.execute_activity(
                activities.stop_shard, StopShardInput(shard_id=shard_id(replica_id, s.rank), replica_id=replica_id,
                                                      generation=generation),
                task_queue=node_queue(s.node_id), **options.STOP,
            )
        except ActivityError as exc:
            workflow.logger.warning("stop of shard %s on %s failed: %s", shard_id(replica_id, s.rank), s.node_id, failure_text(exc))

    await asyncio.gather(*[one(s) for s in shards])


class NotWanted(Exception):
    """The replica stopped being `starting` (stopped, evicted, lost, failed) before a launch."""

    def __init__(self, status: str, before: str):
        super().__init__(f"{status} before {before}")
        self.status = status
        self.before = before


async def still_wanted(replica_id: str, before: str, local: bool = False) -> int:
    """The replica's fencing generation if it is still `starting`; else raise `NotWanted`. `local`: asked as
    a local activity (one read, on this worker, inside the workflow task: no round trip through the server)."""
    if local:
        res = await workflow.execute_local_activity(
            activities.check_replica, CheckReplicaInput(replica_id=replica_id), **options.CONTROL,
        )
    else:
        res = await workflow.execute_activity(
            activities.check_replica, CheckReplicaInput(replica_id=replica_id), task_queue=CONTROL_QUEUE,
            **options.CONTROL,
        )
    if not res.wanted:
        raise NotWanted(res.status, before)
    return res.generation


@workflow.defn(name="ReplicaStartWorkflow")
class ReplicaStartWorkflow:
    """Bring one placed replica to Ready. Id: `replica/<replica_id>/start`."""

    def __init__(self) -> None:
        self._phase = "starting"

    @workflow.query
    def phase(self) -> str:
        return self._phase

    @staticmethod
    def _launch_input(inp: ReplicaStartInput, s: ShardPlacement, path: str | None, rdv: Rendezvous | None,
                      generation: int) -> LaunchShardInput:
        # `sleep_mode` (issue 39) changes what the node launches, not which commands this workflow issues.
        return LaunchShardInput(shard_id=shard_id(inp.replica_id, s.rank), replica_id=inp.replica_id, model=inp.model,
                                profile=inp.profile, rank=s.rank, gpus=s.gpus, weights_path=path, rendezvous=rdv,
                                generation=generation, sleep_mode=inp.sleep_mode)

    async def _launch(self, inp: ReplicaStartInput, s: ShardPlacement, path: str | None,
                      rdv: Rendezvous | None, generation: int = 0) -> LaunchShardResult:
        return await workflow.execute_activity(
            activities.launch_shard, self._launch_input(inp, s, path, rdv, generation),
            task_queue=node_queue(s.node_id), **options.LAUNCH,
        )

    async def _start_in_one_step(self, inp: ReplicaStartInput, s: ShardPlacement) -> bool:
        """Fetch and launch a single-shard replica's shard in one node activity, which asks the control plane
        "still wanted?" itself, before its fetch and after a long one (and takes the fencing generation from
        the answer). False when its node's worker predates `start_shard` or could not reach the node API to
        ask (the caller takes the steps, which ask through the control worker); raises `NotWanted` when the
        node found the replica no longer wanted."""
        self._phase = "fetching weights and launching"
        try:
            await workflow.execute_activity(
                activities.start_shard, StartShardInput(launch=self._launch_input(inp, s, None, None, 0),
                                                        source=inp.profile.source),
                task_queue=node_queue(s.node_id),
                **(options.START_SHARD_TIMED if workflow.patched(FETCH_BY_TIME) else options.START_SHARD),
            )
        except ActivityError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type in ("NotFoundError", UNREACHABLE):
                workflow.logger.warning("node %s %s; fetching and launching in steps", s.node_id,
                                        "has no start_shard" if cause.type == "NotFoundError" else
                                        "could not reach the node API to ask whether the replica is wanted")
                return False
            if isinstance(cause, ApplicationError) and cause.type == NOT_WANTED:
                details = [str(d) for d in cause.details]
                raise NotWanted(details[0] if details else "not starting",
                                details[1] if len(details) > 1 else "launching") from None
            raise
        return True

    async def _fetch_and_launch(self, inp: ReplicaStartInput, rank0: ShardPlacement, workers: list[ShardPlacement],
                                fenced: bool, quick: bool, gen: int) -> None:
        """Fetch on every shard's node, open the rendezvous (multi-node), launch the workers, then rank 0,
        asking "still wanted?" before each launch: a workflow step per node command."""
        rid = inp.replica_id
        self._phase = "fetching weights"
        fetch = options.FETCH_TIMED if workflow.patched(FETCH_BY_TIME) else options.FETCH
        fetched: list[FetchWeightsResult] = await asyncio.gather(*[
            workflow.execute_activity(
                activities.fetch_weights, FetchWeightsInput(replica_id=rid, source=inp.profile.source, generation=gen),
                task_queue=node_queue(s.node_id), **fetch,
            )
            for s in inp.shards
        ])
        paths = {s.rank: f.path for s, f in zip(inp.shards, fetched)}
        rdv: Rendezvous | None = None
        if workers:
            self._phase = "opening the rendezvous on rank 0's node"
            rdv = await workflow.execute_activity(
                activities.open_rendezvous,
                OpenRendezvousInput(replica_id=rid, engine=inp.profile.engine, world_size=len(inp.shards),
                                    generation=gen),
                task_queue=node_queue(rank0.node_id), **options.NODE_QUICK,
            )
            if fenced:
                gen = await still_wanted(rid, "launching the workers", quick)
            self._phase = f"launching {len(workers)} worker(s)"
            await asyncio.gather(*[self._launch(inp, s, paths[s.rank], rdv, gen) for s in workers])
        if fenced:
            gen = await still_wanted(rid, "launching rank 0", quick)
        self._phase = "launching rank 0"
        await self._launch(inp, rank0, paths[0], rdv, gen)

    @workflow.run
    async def run(self, inp: ReplicaStartInput) -> ReplicaStartResult:
        rid = inp.replica_id
        rank0 = next(s for s in inp.shards if s.rank == 0)
        workers = sorted((s for s in inp.shards if s.rank != 0), key=lambda s: s.rank)
        fenced = workflow.patched(FENCED_START)
        quick = fenced and workflow.patched(QUICK_CHECKS)
        one_step = quick and not workers and workflow.patched(ONE_NODE_STEP)
        gen = 0
        try:
            # One node step asks "still wanted?" on the node itself; the steps ask here before each.
            if not (one_step and await self._start_in_one_step(inp, rank0)):
                if fenced:
                    gen = await still_wanted(rid, "fetching weights", quick)
                await self._fetch_and_launch(inp, rank0, workers, fenced, quick, gen)
            self._phase = "waiting for the workers to join rank 0 and for rank 0 to be ready" if workers \
                else "waiting for readiness"
            waits = [
                workflow.execute_activity(
                    activities.wait_shard_joined,
                    WaitShardJoinedInput(shard_id=shard_id(rid, s.rank), timeout_s=inp.ready_timeout_s),
                    task_queue=node_queue(s.node_id), **options.ready(inp.ready_timeout_s, inp.wait_heartbeat_timeout_s),
                )
                for s in workers
            ]
            ready_task = workflow.execute_activity(
                activities.wait_shard_ready,
                WaitShardReadyInput(shard_id=shard_id(rid, 0), timeout_s=inp.ready_timeout_s),
                task_queue=node_queue(rank0.node_id), **options.ready(inp.ready_timeout_s, inp.wait_heartbeat_timeout_s),
            )
            results = await asyncio.gather(*waits, ready_task)
            ready: WaitShardReadyResult = results[-1]
        except NotWanted as exc:
            # Stopped while starting: launch nothing more; whatever did launch is stopped (the stop that
            # ended it does the same and settles it).
            self._phase = f"abandoned ({exc.status}) before {exc.before}"
            await stop_shards(rid, inp.shards)
            raise ApplicationError(f"replica {rid} became {exc.status} before {exc.before}; nothing more was launched",
                                   non_retryable=True) from None
        except (ActivityError, asyncio.CancelledError) as exc:
            # Cancelled (a stop cancels the start): its activities may report the cancellation as theirs.
            cancelled = isinstance(exc, asyncio.CancelledError) or (fenced and is_cancelled_exception(exc))
            reason = "start was cancelled" if cancelled else failure_text(exc)
            await self._fail(inp, reason)
            if cancelled:
                raise
            raise ApplicationError(f"replica {rid} failed to start: {reason}", non_retryable=True) from None

        res = await mark(rid, ReplicaStatus.READY, endpoint=ready.endpoint)
        if not res.applied:
            # Stopped, failed or lost while it was starting (a node re-registered without it, a stop came):
            # do not leave an engine running that nothing routes to. Draining: its node pushed "ready", a
            # stop came and is draining the requests it already serves; that stop stops it afterwards.
            self._phase = f"abandoned ({res.status})"
            if res.status == ReplicaStatus.DRAINING and workflow.patched(DRAIN_OWNS):
                raise ApplicationError(f"replica {rid} became draining while starting; its stop drains and stops it",
                                       non_retryable=True)
            await stop_shards(rid, inp.shards)
            raise ApplicationError(f"replica {rid} became {res.status} while starting; its shards were stopped",
                                   non_retryable=True)
        await workflow.execute_activity(activities.reset_model_failures, ResetModelFailuresInput(model=inp.model),
                                        task_queue=CONTROL_QUEUE, **options.CONTROL)
        self._phase = "ready"
        return ReplicaStartResult(replica_id=rid, endpoint=ready.endpoint)

    async def _fail(self, inp: ReplicaStartInput, reason: str) -> None:
        self._phase = "failed: " + reason
        await asyncio.shield(self._cleanup(inp, reason))

    async def _cleanup(self, inp: ReplicaStartInput, reason: str) -> None:
        # Failed first: out of routing, and the exits the stop causes are not news to anyone.
        res = await mark(inp.replica_id, ReplicaStatus.FAILED, failure=reason[-2000:], reason="failed to start")
        await stop_shards(inp.replica_id, inp.shards, res.generation)
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
        info = await workflow.execute_activity(
            activities.get_replica_shards, ReplicaShardsInput(replica_id=rid), task_queue=CONTROL_QUEUE,
            **options.CONTROL,
        )
        final = inp.final_status
        failure = (inp.reason or None) if final != ReplicaStatus.STOPPED else None
        fences = workflow.patched(STOP_FENCES_START)
        # A starting replica has nothing in flight to drain; marking it draining would let its start's
        # cleanup record it as failed. It is marked with its final status at once instead.
        if final == ReplicaStatus.STOPPED and inp.drain_timeout_s > 0 and not (fences and info.status == ReplicaStatus.STARTING):
            res = await mark(rid, ReplicaStatus.DRAINING)
            rank0 = next((s for s in info.shards if s.rank == 0), None)
            if res.applied and rank0 is not None:
                await self._drain(rid, rank0, inp.drain_timeout_s, inp.wait_heartbeat_timeout_s)
        marked = await mark(rid, final, failure=failure, reason=inp.reason or None)
        if fences:
            # Marked first, so the start's next check sees it is not wanted; then the start is cancelled and
            # waited for, so nothing launches onto GPUs this stop is about to free.
            closed = await workflow.execute_activity(
                activities.await_start_closed, AwaitStartClosedInput(replica_id=rid, timeout_s=START_CLOSE_WAIT_S),
                task_queue=CONTROL_QUEUE, **options.await_close(START_CLOSE_WAIT_S),
            )
            if not closed.closed:
                workflow.logger.warning("start of %s did not close (%s); its launches stay fenced", rid, closed.status)
            await stop_shards(rid, info.shards, marked.generation)
        else:
            await stop_shards(rid, info.shards)
        res = await settle(rid, inp.reason)
        await wake_reconciler(f"replica {rid} {res.status}")
        return res.status

    async def _drain(self, rid: str, rank0: ShardPlacement, timeout_s: float, heartbeat_s: float = 30.0) -> None:
        try:
            await workflow.execute_activity(
                activities.drain_shard, DrainShardInput(shard_id=shard_id(rid, 0), timeout_s=timeout_s),
                task_queue=node_queue(rank0.node_id), **options.drain(timeout_s, heartbeat_s),
            )
        except ActivityError as exc:
            workflow.logger.warning("drain of %s did not finish: %s", rid, failure_text(exc))
