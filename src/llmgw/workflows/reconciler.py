"""`ReconcilerWorkflow`: the singleton loop that makes what runs match the catalog.

Each pass reads a snapshot (activity), plans with the pure `plan_pass`, records its decisions for
`llmgw ctl explain`, and starts child workflows (replica start/stop, abandoned on close so they outlive a
continue-as-new): `place` starts a replica; `stop` and `evict` drain then stop one; `lost` and `cleanup`
stop every shard of one that cannot serve. Woken by the `wake` signal (catalog changed, node registered,
demand, replica failed or stopped) and by a timer. Continues as new every `MAX_PASSES` passes to keep its
history short. Every child carries a memo (model, profile) and, when the namespace has them registered (the
snapshot says), llmgw's search attributes (workflows/attributes.py).
"""

from __future__ import annotations

import warnings
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.contrib.opentelemetry import workflow as otel
from temporalio.exceptions import WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from llmgw.placement.decisions import Decision, Plan
    from llmgw.placement.plan import plan_pass
    from llmgw.schemas.payloads import (
        ReconcilerInput, RecordDecisionsInput, RecordPlacementInput, ReplicaSnap, ReplicaStartInput, ReplicaStopInput,
        RolloutInput, Snapshot,
    )
    from llmgw.workflows import attributes, options
    from llmgw.workflows.queues import CONTROL_QUEUE, replica_start_id, replica_stop_id, rollout_id
    from llmgw.workflows.replica import ReplicaStartWorkflow, ReplicaStopWorkflow
    from llmgw.workflows.rollout import RolloutWorkflow

MAX_PASSES = 100


@workflow.defn(name="ReconcilerWorkflow")
class ReconcilerWorkflow:
    def __init__(self) -> None:
        self._wakes: list[str] = []
        self._last: list[str] = []
        self._search_attributes = False  # the namespace has llmgw's search attributes (from the snapshot)
        self._replicas: dict[str, ReplicaSnap] = {}  # from the latest snapshot: a stop's profile and nodes

    @workflow.signal
    def wake(self, reason: str) -> None:
        self._wakes.append(reason)

    @workflow.query
    def last_pass(self) -> list[str]:
        """The last pass's decisions, one line each."""
        return self._last

    @workflow.run
    async def run(self, inp: ReconcilerInput) -> None:
        for _ in range(MAX_PASSES):
            self._wakes.clear()
            started = workflow.now()
            snapshot: Snapshot = await workflow.execute_activity(
                "read_snapshot", result_type=Snapshot, task_queue=CONTROL_QUEUE, **options.CONTROL,
            )
            self._search_attributes = snapshot.search_attributes
            self._replicas = {r.id: r for r in snapshot.replicas}
            plan = plan_pass(snapshot)
            await self._act(plan, inp, started)
            if plan.more:
                continue
            try:
                await workflow.wait_condition(lambda: bool(self._wakes), timeout=timedelta(seconds=inp.interval_s))
            except TimeoutError:
                pass
            if workflow.info().is_continue_as_new_suggested():
                break
        workflow.continue_as_new(inp.model_copy(update={"passes": inp.passes + MAX_PASSES}))

    async def _act(self, plan: Plan, inp: ReconcilerInput, started: datetime) -> None:
        lines = [d.line() for d in plan.decisions]
        self._last = lines
        if plan.acts():
            acting = [d.line() for d in plan.decisions if d.kind not in ("keep", "wait")]
            workflow.logger.info("reconcile pass: %s", "; ".join(acting))
            # A pass that does something is a span, with every decision and refusal (no-op when tracing is off).
            with warnings.catch_warnings():  # without the tracing interceptor this is a no-op that warns
                warnings.simplefilter("ignore", DeprecationWarning)
                otel.completed_span("reconcile pass", attributes={
                    "llmgw.decisions": lines, "llmgw.refusals": [r for d in plan.decisions for r in d.refusals]})
        await workflow.execute_activity(
            "record_decisions", RecordDecisionsInput(lines=lines, refusals=plan.explanations(),
                                                     kinds=[d.kind for d in plan.decisions], started_at=started),
            task_queue=CONTROL_QUEUE, **options.CONTROL,
        )
        for d in plan.decisions:
            if d.kind == "place":
                await self._place(d, inp)
            elif d.kind in ("stop", "evict", "lost", "cleanup"):
                await self._stop(d, inp)
            elif d.kind == "rollout" and workflow.patched("rollout"):
                await self._rollout(d)

    async def _rollout(self, d: Decision) -> None:
        """Make sure the model's `RolloutWorkflow` runs (one per model: a second start is refused)."""
        try:
            await workflow.start_child_workflow(
                RolloutWorkflow.run, RolloutInput(model=d.model), id=rollout_id(d.model), task_queue=CONTROL_QUEUE,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON, memo=attributes.memo(d.model),
                search_attributes=attributes.lifecycle("rollout", d.model) if self._search_attributes else None,
            )
        except WorkflowAlreadyStartedError:
            pass

    async def _place(self, d: Decision, inp: ReconcilerInput) -> None:
        replica_id = str(workflow.uuid4())
        await workflow.execute_activity(
            "record_placement",
            RecordPlacementInput(replica_id=replica_id, model=d.model, profile=d.profile or "default",
                                 shards=d.shards, reason="\n".join([d.line(), *d.refusals])),
            task_queue=CONTROL_QUEUE, **options.CONTROL,
        )
        assert d.profile_spec is not None
        await workflow.start_child_workflow(
            ReplicaStartWorkflow.run,
            ReplicaStartInput(replica_id=replica_id, model=d.model, profile=d.profile_spec, shards=d.shards,
                              ready_timeout_s=inp.ready_timeout_s),
            id=replica_start_id(replica_id), task_queue=CONTROL_QUEUE,
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            memo=attributes.memo(d.model, d.profile or "default"),
            search_attributes=attributes.lifecycle("start", d.model, replica_id, [s.node_id for s in d.shards])
            if self._search_attributes else None,
        )

    async def _stop(self, d: Decision, inp: ReconcilerInput) -> None:
        assert d.replica_id
        rep = self._replicas.get(d.replica_id)
        try:
            await workflow.start_child_workflow(
                ReplicaStopWorkflow.run,
                ReplicaStopInput(replica_id=d.replica_id, reason=d.reason,
                                 drain_timeout_s=inp.drain_timeout_s if d.drain else 0,
                                 final_status=d.final_status),
                id=replica_stop_id(d.replica_id), task_queue=CONTROL_QUEUE,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                memo=attributes.memo(d.model, rep.profile if rep else None),
                search_attributes=attributes.lifecycle("stop", d.model, d.replica_id,
                                                       [s.node_id for s in rep.shards] if rep else None)
                if self._search_attributes else None,
            )
        except WorkflowAlreadyStartedError:
            pass  # already stopping
