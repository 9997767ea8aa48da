"""The `decide` activity: one reconcile pass's thinking, outside workflow code.

It reads the snapshot (both liveness witnesses and the observer's facts, issue 9), forgets nodes judged
Lost for longer than `node_forget_after_s`, runs the pure planner (`placement.plan.plan_pass`), saves every decision and refusal for `llmgw ctl explain`, and returns only
what the workflow must act on (`DecideResult`: a few small actions, and this pass's settings).

Why here and not in the workflow (issue 10, "Deploys"): a planner change then never makes a recorded pass
replay differently, the snapshot (megabytes at a thousand nodes) never enters workflow history, and a
planner exception is this activity failing, retried with a newer snapshot and shown by `ctl explain`,
rather than a workflow task that fails forever on the same recorded snapshot.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from opentelemetry import trace
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from llmgw.control.gc_pause import gc_paused
from llmgw.control.idempotent import CrashHook, may_have_committed, store, stored
from llmgw.control.starts import Stages, StrandedStarts, start_replica, start_wake
from llmgw.config import Settings
from llmgw.db import catalog_repo, fleet_repo, reconciler_repo
from llmgw.placement.decisions import Decision, Plan
from llmgw.placement.liveness import FleetLiveness, fleet_liveness
from llmgw.placement.plan import plan_pass
from llmgw.schemas.payloads import (
    MAX_PASS_LINES, DecideInput, DecideResult, PassAction, RecordPlacementsInput, ReplicaSnap,
    Snapshot,
)
from llmgw.telemetry import ControlMetrics

log = logging.getLogger(__name__)
ACTING = ("place", "stop", "evict", "lost", "cleanup", "rollout", "sleep", "wake")
START_CONCURRENCY = 16  # start RPCs in flight at once when a pass placed many replicas

Hook = Callable[[Snapshot, Plan], Plan]


def load_hook(spec: str | None) -> Hook | None:
    """`module:function` (`Settings.planner_hook`, tests only) -> the function, or None."""
    if not spec:
        return None
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class DecideActivities:
    """The reconciler's pass: `decide`, then `record_placements` for what it placed.

    `read_snapshot` is the control activities' (one transaction: catalog, states, nodes, replicas)."""

    def __init__(self, engine: AsyncEngine, settings: Settings, read_snapshot: Callable[[], Awaitable[Snapshot]],
                 metrics: ControlMetrics | None = None, client: Client | None = None,
                 judged: Callable[[Snapshot], FleetLiveness | None] | None = None):
        self.engine = engine
        self.judged = judged  # the liveness `read_snapshot` judged from a snapshot (ControlActivities.judged)
        self.client = client  # starts what a pass placed (`start_replicas`); None: the reconciler does
        self.settings = settings
        self.read_snapshot = read_snapshot
        self.metrics = metrics or ControlMetrics()
        self.hook = load_hook(settings.planner_hook)
        self.crash = CrashHook(settings.test_crash_after_commit, settings.test_crash_marker)
        self.stranded = StrandedStarts(client) if client is not None else None
        self.stages = Stages(client) if client is not None else None

    def all(self) -> list:
        return [self.decide, self.record_placements]

    @activity.defn(name="decide")
    async def decide(self, inp: DecideInput) -> DecideResult:
        beat = asyncio.create_task(_heartbeats())
        try:
            with gc_paused():  # (control/gc_pause.py)
                result, snapshot, plan = await self._decide(inp)
            if inp.start_replicas and inp.record_placements and self.client is not None:
                # Shielded: a run closed now (terminated) cancels this activity, and the placements it just
                # committed would be left without a start (`control/starts.py` finds those later).
                started = await asyncio.shield(self._start_placed(result))
                result = result.model_copy(update={"started": started})
                if snapshot is not None:  # (None: a retry that returned what its first attempt stored)
                    placed = {a.replica_id for a in result.actions if a.kind == "place"}
                    await self.stranded.repair(snapshot, placed, result.ready_timeout_s,
                                               result.wait_heartbeat_timeout_s)
            if plan is not None and snapshot is not None and self.stages is not None and plan.of_kind("stage"):
                # After the starts: a stage is for a later request, a start for one waiting now.
                try:
                    await asyncio.shield(self.stages.start(plan.of_kind("stage"), snapshot, plan.node_status))
                except Exception:  # noqa: BLE001 - a stage is an optimisation: never a reason to fail the pass
                    log.exception("starting this pass's stages failed")
            return result
        finally:
            beat.cancel()

    async def _start_placed(self, result: DecideResult) -> list[str]:
        """Start the start workflow of every replica the pass placed, once its placement is committed (a
        retry, which returns the stored result, starts them again: a start already there, running or
        closed, is never started twice), and the wake workflow of every replica it wakes (issue 39: a
        request waits on it). The ids started or found started; one that could not be started is left to
        the reconciler, which starts it as its child."""
        sem = asyncio.Semaphore(START_CONCURRENCY)

        async def start(a: PassAction) -> str | None:
            async with sem:
                ok = await start_replica(self.client, a.replica_id, a.model, a.profile_spec, a.shards,
                                         result.ready_timeout_s, result.search_attributes, a.sleep_mode,
                                         result.wait_heartbeat_timeout_s)
                return a.replica_id if ok else None

        async def wake(a: PassAction) -> str | None:
            async with sem:
                return a.replica_id if await start_wake(self.client, a, result.search_attributes) else None

        places = [a for a in result.actions if a.kind == "place" and a.profile_spec is not None]
        wakes = [a for a in result.actions if a.kind == "wake"]
        return [rid for rid in await asyncio.gather(*[wake(a) for a in wakes], *[start(a) for a in places])
                if rid is not None]

    async def _decide(self, inp: DecideInput) -> tuple[DecideResult, Snapshot | None, Plan | None]:
        """One pass. With `inp.record_placements`, the replicas it places are created in the transaction
        that saves its decisions, with its result stored beside them: a retry after that commit returns the
        same actions (the same replica ids), so each placed replica gets its start workflow exactly once."""
        if inp.record_placements and may_have_committed():  # a first attempt has nothing stored: no transaction
            async with self.engine.begin() as conn:
                found, result = await stored(conn, "decide", DecideResult)
            if found and result is not None:
                return result, None, None
        started = time.monotonic()
        s = self.settings
        forget_after_s = max(s.node_forget_after_s, s.node_lost_after_s)  # never a node that is not yet Lost
        snapshot = await self.read_snapshot()
        judged = self.judged(snapshot) if self.judged is not None else None  # (its liveness, judged once)
        # Only nodes the planner judges Lost (both witnesses silent, the observer not in doubt: issue 9)
        # and silent for `forget_after_s`; the snapshot is read again when one was forgotten.
        candidates = forgettable(snapshot, forget_after_s, judged)
        if candidates:
            async with self.engine.begin() as conn:
                forgotten = await fleet_repo.forget_lost_nodes(conn, forget_after_s, candidates)
            for node_id in forgotten:
                log.info("forgot node %s: lost and silent for longer than %gs (node_forget_after_s)", node_id,
                         forget_after_s)
            if forgotten:
                snapshot = await self.read_snapshot()
                judged = self.judged(snapshot) if self.judged is not None else None
        try:
            plan = plan_pass(snapshot, max_placements=s.reconcile_max_placements, fleet=judged)
            if self.hook is not None:
                plan = self.hook(snapshot, plan)
            explanations = plan.explanations()
        except Exception as exc:  # noqa: BLE001 - any planner bug: say so where operators look, then retry
            attempt = activity.info().attempt
            log.exception("the planner failed (attempt %d); retrying with a newer snapshot", attempt)
            failure = f"{type(exc).__name__}: {exc}"
            async with self.engine.begin() as conn:
                await reconciler_repo.record_failure(conn, failure, attempt)
            raise ApplicationError(f"the planner failed: {failure}", type="PlannerFailed") from exc
        actions: list[PassAction] = []
        reasons: dict[str, str] = {}
        replicas = {r.id: r for r in snapshot.replicas}
        for d in plan.decisions:
            if d.kind in ACTING:
                actions.append(_action(d, replicas.get(d.replica_id or "")))
                if d.kind == "place":
                    reasons[actions[-1].replica_id] = "\n".join([d.line(), *d.refusals])
        lines = [d.line() for d in plan.decisions if d.kind not in ("keep",)]
        result = DecideResult(
            actions=actions, more=plan.more,
            lines=lines[:MAX_PASS_LINES] + ([f"... and {len(lines) - MAX_PASS_LINES} more"] if len(lines) > MAX_PASS_LINES else []),
            interval_s=s.reconcile_interval_s, ready_timeout_s=s.replica_ready_timeout_s,
            drain_timeout_s=s.replica_drain_timeout_s, wait_heartbeat_timeout_s=s.node_wait_heartbeat_timeout_s,
            search_attributes=snapshot.search_attributes)
        places = [a for a in actions if a.kind == "place"]
        async with self.engine.begin() as conn:
            await catalog_repo.save_decisions(conn, explanations)
            await catalog_repo.record_idle_stops(conn, sorted({d.model for d in plan.decisions
                                                               if d.kind == "stop" and d.to_zero}))
            await reconciler_repo.record_pass(conn, reasons)
            if inp.record_placements and places:
                for a in places:
                    await fleet_repo.create_replica(conn, a.replica_id, a.model, a.profile or "default", a.shards,
                                                    reasons.get(a.replica_id) or a.line)
                await store(conn, "decide", result)
        if inp.record_placements and places:
            self.crash("decide", "place")
        self.metrics.recorded([d.kind for d in plan.decisions], explanations, time.monotonic() - started)
        if plan.acts():
            log.info("reconcile pass %d: %s", inp.passes, "; ".join(a.line for a in actions))
            # A pass that does something is a span with every decision and refusal (a no-op without tracing).
            trace.get_tracer("llmgw.reconciler").start_span("reconcile pass", attributes={
                "llmgw.decisions": [d.line() for d in plan.decisions],
                "llmgw.refusals": [r for d in plan.decisions for r in d.refusals]}).end()
        return result, snapshot, plan

    @activity.defn(name="record_placements")
    async def record_placements(self, inp: RecordPlacementsInput) -> None:
        """Create every replica the pass placed (`starting`, one shard row per rank), in one transaction.
        Idempotent on the replica ids. Each reason is the full one `decide` saved, else the decision's line."""
        async with self.engine.begin() as conn:
            for p in inp.placements:
                reason = await reconciler_repo.placement_reason(conn, p.replica_id) or p.reason
                await fleet_repo.create_replica(conn, p.replica_id, p.model, p.profile, p.shards, reason)


async def _heartbeats(every_s: float = 2.0) -> None:
    """Heartbeat while `decide` runs: its worker is alive (options.DECIDE has a 10 s heartbeat timeout)."""
    while True:
        activity.heartbeat()
        await asyncio.sleep(every_s)


def forgettable(snapshot: Snapshot, after_s: float, fleet: FleetLiveness | None = None) -> list[str]:
    """Nodes this snapshot's liveness (`fleet`, when judged already) judges Lost whose witnesses have both
    been silent for `after_s`."""
    fleet = fleet or fleet_liveness(snapshot)
    return sorted(i for i, n in fleet.nodes.items() if n.status == "lost"
                  and min(n.heartbeat_silent_s or 0.0, n.poller_silent_s or 0.0) >= after_s)


def _action(d: Decision, rep: ReplicaSnap | None) -> PassAction:
    """The action for one acting decision; a stop carries its replica's profile and nodes (memo, search
    attributes of its stop workflow)."""
    if d.kind == "place":
        return PassAction(kind="place", model=d.model, line=d.line(), replica_id=str(uuid.uuid4()), profile=d.profile,
                          profile_spec=d.profile_spec, shards=d.shards, sleep_mode=d.sleep_mode)
    if d.kind == "rollout":
        return PassAction(kind="rollout", model=d.model, line=d.line())
    assert d.replica_id
    return PassAction(kind=d.kind, model=d.model, line=d.line(), replica_id=d.replica_id, reason=d.reason,
                      drain=d.drain, final_status=d.final_status, profile=rep.profile if rep else None,
                      nodes=sorted({sh.node_id for sh in rep.shards}) if rep else [])
