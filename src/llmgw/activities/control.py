"""Control-plane activities, run by the control worker. Every database write goes through `llmgw.db`.

All are idempotent on the ids the workflow gives them: a retried `record_placement` finds its replica,
a retried `mark_replica` finds the transition already made.
"""

from __future__ import annotations

import random
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity

from llmgw.db import catalog_repo, fleet_repo, status_repo
from llmgw.telemetry import ControlMetrics
from llmgw.placement.plan import backoff_delay, rollout_step
from llmgw.weights.naming import cache_name_for, parse_source
from llmgw.schemas.payloads import (
    MarkReplicaInput, MarkReplicaResult, NodeSnap, ReclaimTargets, RecordDecisionsInput, RecordPlacementInput,
    ReplicaShardsInput, ReplicaShardsResult, ReplicaSnap, RolloutStep, RolloutStepInput, SettleReplicaInput, SettleReplicaResult, ShardPlacement,
    Snapshot,
)

if TYPE_CHECKING:
    from llmgw.temporal import SearchAttributeCheck


class ControlActivities:
    """Bound to one database engine. Register `all()` on the control worker."""

    def __init__(self, engine: AsyncEngine, unreachable_after_s: float, lost_after_s: float, client=None,
                 attributes: "SearchAttributeCheck | None" = None, metrics: ControlMetrics | None = None,
                 backoff_base_s: float = 5.0, backoff_max_s: float = 600.0, drain_timeout_s: float = 60.0):
        self.engine = engine
        self.unreachable_after_s = unreachable_after_s
        self.lost_after_s = lost_after_s
        self.client = client  # Temporal, to ask whether the namespace has llmgw's search attributes
        self.attributes = attributes
        self.metrics = metrics or ControlMetrics()
        self.backoff = (backoff_base_s, backoff_max_s)
        self.drain_timeout_s = drain_timeout_s

    def all(self) -> list:
        return [self.read_snapshot, self.record_placement, self.record_decisions, self.mark_replica,
                self.settle_replica, self.record_replica_failure, self.reset_model_failures, self.get_replica_shards,
                self.reclaim_targets, self.rollout_step]

    @activity.defn(name="read_snapshot")
    async def read_snapshot(self) -> Snapshot:
        """Catalog, model state, nodes, active replicas and unsettled ended ones, read in one transaction."""
        async with self.engine.begin() as conn:
            now = await fleet_repo.db_now(conn)
            catalog = await catalog_repo.get_catalog(conn)
            states = await catalog_repo.model_states(conn)
            nodes = await fleet_repo.list_nodes(conn)
            reps = await fleet_repo.active_replicas_with_shards(conn)
        snapshot = Snapshot(
            now=now, unreachable_after_s=self.unreachable_after_s, lost_after_s=self.lost_after_s,
            models=catalog.models, model_states=states,
            nodes=[NodeSnap(id=n.id, status="ready", last_heartbeat=n.last_heartbeat, inventory=n.inventory) for n in nodes],
            replicas=[
                ReplicaSnap(id=r["id"], model=r["model"], profile=r["profile"], status=r["status"],
                            created_at=r["created_at"], updated_at=r["updated_at"], settled=r["settled_at"] is not None,
                            profile_hash=r["profile_hash"],
                            shards=[ShardPlacement(node_id=s["node_id"], rank=s["rank"], gpus=list(s["gpus"] or [])) for s in shards])
                for r, shards in reps
            ],
            search_attributes=await self.attributes.registered(self.client) if self.attributes else False,
        )
        self.metrics.snapshot(snapshot)
        return snapshot

    @activity.defn(name="rollout_step")
    async def rollout_step(self, inp: RolloutStepInput) -> RolloutStep:
        """What `model`'s rolling replacement does next, decided from a fresh snapshot (placement/rollout.py)."""
        step = rollout_step(await self.read_snapshot(), inp.model)
        return step.model_copy(update={"drain_timeout_s": self.drain_timeout_s})

    @activity.defn(name="record_placement")
    async def record_placement(self, inp: RecordPlacementInput) -> None:
        async with self.engine.begin() as conn:
            await fleet_repo.create_replica(conn, inp.replica_id, inp.model, inp.profile, inp.shards, inp.reason)

    @activity.defn(name="record_decisions")
    async def record_decisions(self, inp: RecordDecisionsInput) -> None:
        async with self.engine.begin() as conn:
            await catalog_repo.save_decisions(conn, inp.refusals)
        took = (datetime.now(timezone.utc) - inp.started_at).total_seconds() if inp.started_at else None
        self.metrics.recorded(inp.kinds, inp.refusals, took)

    @activity.defn(name="mark_replica")
    async def mark_replica(self, inp: MarkReplicaInput) -> MarkReplicaResult:
        async with self.engine.begin() as conn:
            applied, status = await fleet_repo.mark_replica(conn, inp.replica_id, inp.status, inp.endpoint, inp.failure,
                                                            inp.reason)
            times = await status_repo.replica_times(conn, inp.replica_id) if applied and inp.status == "ready" else None
        if times is not None:
            self.metrics.starts.labels(times.model, "ready").inc()
            self.metrics.time_to_ready.labels(times.model).observe(times.time_to_ready_s or 0.0)
        return MarkReplicaResult(applied=applied, status=status or "unknown")

    @activity.defn(name="settle_replica")
    async def settle_replica(self, inp: SettleReplicaInput) -> SettleReplicaResult:
        """Mark an ended replica settled (every shard asked to stop). `applied` only for the first caller."""
        async with self.engine.begin() as conn:
            applied, status, model = await fleet_repo.settle_replica(conn, inp.replica_id, inp.reason or None)
            times = await status_repo.replica_times(conn, inp.replica_id) if applied and status == "failed" else None
        if times is not None and times.time_to_ready_s is None:  # it never served: a failed start
            self.metrics.starts.labels(times.model, "failed").inc()
        return SettleReplicaResult(applied=applied, status=status or "unknown", model=model or "")

    @activity.defn(name="record_replica_failure")
    async def record_replica_failure(self, model: str) -> None:
        """Count a failed start against `model` and set its jittered exponential backoff (seeds 003)."""
        async with self.engine.begin() as conn:
            states = {s.name: s for s in await catalog_repo.model_states(conn)}
            failures = (states[model].failures if model in states else 0) + 1
            now = await fleet_repo.db_now(conn)
            until = now + backoff_delay(failures, random.random(), *self.backoff)
            await catalog_repo.record_failure(conn, model, until)

    @activity.defn(name="reset_model_failures")
    async def reset_model_failures(self, model: str) -> None:
        async with self.engine.begin() as conn:
            await catalog_repo.reset_failures(conn, model)

    @activity.defn(name="get_replica_shards")
    async def get_replica_shards(self, inp: ReplicaShardsInput) -> ReplicaShardsResult:
        async with self.engine.begin() as conn:
            return ReplicaShardsResult(shards=await fleet_repo.replica_shards(conn, inp.replica_id))



    @activity.defn(name="reclaim_targets")
    async def reclaim_targets(self) -> ReclaimTargets:
        """Cache names of every fetchable source in the catalog, and the nodes heard from recently."""
        async with self.engine.begin() as conn:
            catalog = await catalog_repo.get_catalog(conn)
            nodes = await fleet_repo.list_nodes(conn)
        wanted = sorted({cache_name_for(p.source) for m in catalog.models for p in m.profiles
                         if p.source and parse_source(p.source).kind == "remote"})
        return ReclaimTargets(wanted=wanted, nodes=[n.id for n in nodes if n.age_s < self.lost_after_s])
