"""Control-plane activities, run by the control worker. Every database write goes through `llmgw.db`.

The state changes (`record_placement`, `mark_replica`, `settle_replica`, `record_replica_failure`) are
idempotent under retry-after-commit: each stores its result with its effect, keyed by the workflow run and
activity id, and a retry returns that result (`control/idempotent.py`).
"""

from __future__ import annotations

import asyncio
import random
import time
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from llmgw.control.idempotent import CrashHook, once
from llmgw.control.liveness import read_pollers, record_and_read_liveness, remember_doubt
from llmgw.config import Settings
from llmgw.control.gc_pause import gc_paused
from llmgw.db import catalog_repo, fleet_repo, snapshot_reads, status_repo
from llmgw.telemetry import ControlMetrics
from llmgw.placement.plan import backoff_delay, rollout_step
from llmgw.weights.naming import cache_name_for, parse_source
from llmgw.placement.liveness import FleetLiveness
from llmgw.schemas.status import ReplicaStatus, wanted_by_start
from llmgw.schemas.payloads import (
    AwaitStartClosedInput, AwaitStartClosedResult, CheckReplicaInput, CheckReplicaResult,
    MarkReplicaInput, MarkReplicaResult, MarkSleepInput, NodeSnap, ReclaimTargets, RecordDecisionsInput, RecordPlacementInput,
    RecordReplicaFailureInput, ReplicaShardsInput, ReplicaShardsResult, ResetModelFailuresInput,
    RolloutStep, RolloutStepInput, SettleReplicaInput, SettleReplicaResult, Snapshot,
)
from llmgw.workflows.ids import replica_sleep_id, replica_start_id

if TYPE_CHECKING:
    from llmgw.temporal import SearchAttributeCheck


class ControlActivities:
    """Bound to one database engine (and, for the liveness witness and start fencing, the Temporal client).
    Register `all()` on the control worker."""

    def __init__(self, engine: AsyncEngine, unreachable_after_s: float, lost_after_s: float,
                 client: Client | None = None, settings: Settings | None = None,
                 attributes: "SearchAttributeCheck | None" = None, metrics: ControlMetrics | None = None,
                 backoff_base_s: float = 5.0, backoff_max_s: float = 600.0, drain_timeout_s: float = 60.0):
        self.engine = engine
        self.unreachable_after_s = unreachable_after_s
        self.lost_after_s = lost_after_s
        self.client = client  # Temporal: the pollers witness, start fencing, the namespace's search attributes
        self.settings = settings or Settings(node_unreachable_after_s=unreachable_after_s, node_lost_after_s=lost_after_s)
        self.crash = CrashHook(self.settings.test_crash_after_commit, self.settings.test_crash_marker)
        self.attributes = attributes
        self.metrics = metrics or ControlMetrics()
        self._catalog_memo = catalog_repo.CatalogMemo()  # the snapshot's catalog, parsed again only when changed
        self._inventory_memo = fleet_repo.InventoryMemo()  # and each node's inventory
        self._snapshot_memo = snapshot_reads.SnapshotMemo()  # and its replicas and model states
        self._judged: tuple[Snapshot | None, FleetLiveness | None] = (None, None)  # (read_snapshot)
        self.backoff = (backoff_base_s, backoff_max_s)
        self.drain_timeout_s = drain_timeout_s

    def all(self) -> list:
        return [self.read_snapshot, self.record_placement, self.record_decisions, self.mark_replica,
                self.settle_replica, self.record_replica_failure, self.reset_model_failures, self.get_replica_shards,
                self.reclaim_targets, self.check_replica, self.await_start_closed, self.rollout_step, self.mark_sleep]

    @activity.defn(name="read_snapshot")
    async def read_snapshot(self) -> Snapshot:
        """Catalog, model state, nodes, active replicas and unsettled ended ones, read as one consistent view
        (REPEATABLE READ: in READ COMMITTED each statement saw the commits made since the one before, so a
        node registering between the replicas' read and the nodes' was seen without the replica its
        registration adopted, and a second one was placed beside it); the second liveness witness (pollers
        on node queues) is read meanwhile, then kept (`nodes.polled_at`) in a transaction of its own with
        the liveness facts (writes in the view's transaction would conflict with every heartbeat)."""
        # The pollers are RPCs to Temporal: asked while the database is read, not before (issue 13: a
        # pass is on the path from a request to its load).
        pollers = asyncio.ensure_future(read_pollers(self.engine, self.client, self.settings))
        try:
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="REPEATABLE READ")
                async with conn.begin():
                    catalog, unreadable = await catalog_repo.read_catalog(conn, self._catalog_memo)
                    states = await snapshot_reads.snapshot_model_states(conn, self._snapshot_memo)
                    reps = await snapshot_reads.snapshot_replicas(conn, self._snapshot_memo)
                    nodes = await fleet_repo.list_nodes(conn, self._inventory_memo)
            ages, read, pollers_error = await pollers
            async with self.engine.begin() as conn:
                # The transaction's start (`now()`), a few ms after the pollers answered: their ages are
                # counted back from it (ms, against thresholds of seconds).
                now = await fleet_repo.db_now(conn)
                facts = await record_and_read_liveness(conn, now, ages, read, pollers_error, self.settings)
        finally:
            pollers.cancel()
        polled = {n: now - timedelta(seconds=a) for n, a in ages.items()}  # as just kept (never backwards)
        read_now = set(read)
        snapshot = Snapshot(
            now=now, unreachable_after_s=self.unreachable_after_s, lost_after_s=self.lost_after_s,
            liveness=facts, start_budget_s=self.settings.start_budget_s,
            sleep_host_memory_gb=self.settings.sleep_host_memory_gb,
            prestage_recent_s=self.settings.prestage_recent_s, prestage_disk_gb=self.settings.prestage_disk_gb,
            models=catalog.models, model_states=states,
            nodes=[NodeSnap(id=n.id, status="ready", last_heartbeat=n.last_heartbeat,
                            polled_at=max(filter(None, (n.polled_at, polled.get(n.id))), default=None),
                            poll_read_at=now if n.id in read_now else n.poll_read_at,
                            inventory=n.inventory, left_at=n.left_at) for n in nodes],
            replicas=reps,
            search_attributes=await self.attributes.registered(self.client) if self.attributes else False,
            unreadable_models=sorted(unreadable),
        )
        # The fleet's liveness as judged from this snapshot, for the pass that plans with it (plan_pass).
        self._judged = (snapshot, await remember_doubt(self.engine, snapshot))
        self.metrics.snapshot(snapshot)
        return snapshot

    def judged(self, snapshot: Snapshot) -> FleetLiveness | None:
        """The fleet's liveness as `read_snapshot` judged it from `snapshot`, when that was the latest read
        (for its pass's plan: fleet_liveness is ~20 ms at 10k nodes), else None."""
        seen, fleet = self._judged
        return fleet if seen is snapshot else None

    @activity.defn(name="rollout_step")
    async def rollout_step(self, inp: RolloutStepInput) -> RolloutStep:
        """What `model`'s rolling replacement does next, decided from a fresh snapshot (placement/rollout.py)."""
        with gc_paused():  # (control/gc_pause.py)
            step = rollout_step(await self.read_snapshot(), inp.model)
        return step.model_copy(update={"drain_timeout_s": self.drain_timeout_s})

    @activity.defn(name="record_placement")
    async def record_placement(self, inp: RecordPlacementInput) -> None:
        async def body(conn) -> None:
            await fleet_repo.create_replica(conn, inp.replica_id, inp.model, inp.profile, inp.shards, inp.reason)
        await once(self.engine, "record_placement", None, body, self.crash)

    @activity.defn(name="record_decisions")
    async def record_decisions(self, inp: RecordDecisionsInput) -> None:
        async with self.engine.begin() as conn:
            await catalog_repo.save_decisions(conn, inp.refusals)
        took = (datetime.now(timezone.utc) - inp.started_at).total_seconds() if inp.started_at else None
        self.metrics.recorded(inp.kinds, inp.refusals, took)

    @activity.defn(name="mark_replica")
    async def mark_replica(self, inp: MarkReplicaInput) -> MarkReplicaResult:
        """Move a replica to `inp.status`; a retry after the commit gets the first attempt's answer (and
        counts nothing again: the metrics are counted only by the attempt that committed)."""
        times = []

        async def body(conn) -> MarkReplicaResult:
            if inp.status == ReplicaStatus.READY:
                t = await fleet_repo.record_ready(conn, inp.replica_id, inp.endpoint)
            else:
                t = await fleet_repo.transition_replica(conn, inp.replica_id, inp.status, inp.endpoint, inp.failure,
                                                        inp.reason)
            if t.applied and inp.status == ReplicaStatus.READY:
                times.append(await status_repo.replica_times(conn, inp.replica_id))
            return MarkReplicaResult(applied=t.applied, status=t.status or "unknown", generation=t.generation)
        result = await once(self.engine, "mark_replica", MarkReplicaResult, body, self.crash, detail=inp.status)
        if times and times[0] is not None:
            self.metrics.starts.labels(times[0].model, ReplicaStatus.READY).inc()
            self.metrics.time_to_ready.labels(times[0].model).observe(times[0].time_to_ready_s or 0.0)
        return result

    @activity.defn(name="settle_replica")
    async def settle_replica(self, inp: SettleReplicaInput) -> SettleReplicaResult:
        """Mark an ended replica settled (every shard asked to stop). `applied` only for the first caller."""
        times = []

        async def body(conn) -> SettleReplicaResult:
            s = await fleet_repo.settle_replica(conn, inp.replica_id, inp.reason or None)
            if s.applied and s.status == ReplicaStatus.FAILED:
                times.append(await status_repo.replica_times(conn, inp.replica_id))
                if inp.count_failure and s.model:
                    await self._count_failure(conn, s.model)
            return SettleReplicaResult(applied=s.applied, status=s.status or "unknown", model=s.model or "")
        result = await once(self.engine, "settle_replica", SettleReplicaResult, body, self.crash)
        if times and times[0] is not None and times[0].time_to_ready_s is None:  # it never served: a failed start
            self.metrics.starts.labels(times[0].model, ReplicaStatus.FAILED).inc()
        return result

    @activity.defn(name="record_replica_failure")
    async def record_replica_failure(self, inp: RecordReplicaFailureInput) -> None:
        """Count a failed start against `inp.model` and set its jittered exponential backoff (seeds 003). What
        workflows without `settle_replica(count_failure)` call after settling (patch SETTLE_COUNTS)."""
        await once(self.engine, "record_replica_failure", None, lambda conn: self._count_failure(conn, inp.model),
                   self.crash)

    async def _count_failure(self, conn, model: str) -> None:
        states = {s.name: s for s in await catalog_repo.model_states(conn)}
        failures = (states[model].failures if model in states else 0) + 1
        now = await fleet_repo.db_now(conn)
        until = now + backoff_delay(failures, random.random(), *self.backoff)
        await catalog_repo.record_failure(conn, model, until)

    @activity.defn(name="reset_model_failures")
    async def reset_model_failures(self, inp: ResetModelFailuresInput) -> None:
        """A start reached Ready: the model's failed starts and backoff are cleared, once. A retry after its
        commit must not clear a failure another replica of the model counted in between (its backoff too)."""
        await once(self.engine, "reset_model_failures", None,
                   lambda conn: catalog_repo.reset_failures(conn, inp.model), self.crash)

    @activity.defn(name="get_replica_shards")
    async def get_replica_shards(self, inp: ReplicaShardsInput) -> ReplicaShardsResult:
        async with self.engine.begin() as conn:
            status, generation = await fleet_repo.replica_state(conn, inp.replica_id)
            return ReplicaShardsResult(shards=await fleet_repo.replica_shards(conn, inp.replica_id),
                                       status=status or "", generation=generation)

    @activity.defn(name="check_replica")
    async def check_replica(self, inp: CheckReplicaInput) -> CheckReplicaResult:
        """Is the replica still wanted by its start (still `starting`), and its fencing generation. A start
        asks before every launch, so a replica stopped while it fetched never launches."""
        async with self.engine.begin() as conn:
            status, generation = await fleet_repo.replica_state(conn, inp.replica_id)
        return CheckReplicaResult(wanted=wanted_by_start(status), status=status or "unknown", generation=generation)

    @activity.defn(name="mark_sleep")
    async def mark_sleep(self, inp: MarkSleepInput) -> MarkReplicaResult:
        """Ready -> sleeping, or sleeping -> Ready (issue 39). A retry finds it done and is told so."""
        async with self.engine.begin() as conn:
            t = await fleet_repo.mark_sleep(conn, inp.replica_id, inp.asleep)
        target = ReplicaStatus.SLEEPING if inp.asleep else ReplicaStatus.READY
        return MarkReplicaResult(applied=t.applied or t.status is target, status=t.status or "unknown",
                                 generation=t.generation)

    @activity.defn(name="await_start_closed")
    async def await_start_closed(self, inp: AwaitStartClosedInput) -> AwaitStartClosedResult:
        """Cancel the replica's start workflow (when `cancel`) and wait until it has closed, heartbeating, up
        to `timeout_s`. A stop waits here before it stops shards and frees GPUs, so a start cannot launch
        onto GPUs placement has handed to someone else. A start that never closes (wedged) is waited for
        only `timeout_s`: the nodes' fences still refuse its launches."""
        if self.client is None:
            return AwaitStartClosedResult(closed=False, status="no Temporal client in this worker")
        wf = replica_sleep_id(inp.replica_id) if inp.workflow == "sleep" else replica_start_id(inp.replica_id)
        handle = self.client.get_workflow_handle(wf)
        deadline = time.monotonic() + inp.timeout_s
        cancelled = not inp.cancel
        while True:
            try:
                desc = await handle.describe()
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:
                    return AwaitStartClosedResult(closed=True, status=f"no {inp.workflow} workflow")
                raise
            if desc.status not in (None, WorkflowExecutionStatus.RUNNING):
                return AwaitStartClosedResult(closed=True, status=desc.status.name.lower())
            if not cancelled:
                try:
                    await handle.cancel()
                except RPCError as exc:  # closed between describe and cancel: the next describe says so
                    activity.logger.info("cancel of %s: %s", handle.id, exc)
                cancelled = True
            if time.monotonic() > deadline:
                return AwaitStartClosedResult(closed=False, status=f"still running after {inp.timeout_s:g}s")
            activity.heartbeat()
            await asyncio.sleep(0.25)

    @activity.defn(name="reclaim_targets")
    async def reclaim_targets(self) -> ReclaimTargets:
        """Cache names of every fetchable source in the catalog (adapters' included), and the nodes heard from
        recently."""
        async with self.engine.begin() as conn:
            catalog = await catalog_repo.get_catalog(conn)
            nodes = await fleet_repo.list_nodes(conn)
        wanted = sorted({cache_name_for(p.source) for m in catalog.models for p in m.profiles
                         if p.source and parse_source(p.source).kind == "remote"}
                        | {cache_name_for(a.source) for m in catalog.models for a in m.adapters
                           if parse_source(a.source).kind == "remote"})
        return ReclaimTargets(wanted=wanted, nodes=[n.id for n in nodes if n.age_s < self.lost_after_s])
