"""`RolloutWorkflow`: replace a model's replicas that run an older profile, one at a time (issue 13).

Id `rollout/<model>`, started by the reconciler when a pass finds outdated replicas (a second start while
one runs is refused, so there is one per model). Each step is decided by the `rollout_step` activity from a
fresh snapshot (placement/rollout.py), never in this code: `retire` drains and stops one old replica with a
child `ReplicaStopWorkflow` (id `replica/<id>/stop`) and waits for it; `wait` sleeps `POLL_S` (the
reconciler places the surge replica, or the model is backing off); `done` ends it. The query `progress`
says where it is, for the Temporal UI. Continues as new every `MAX_STEPS` steps.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.payloads import (
        ReplicaStopInput, RolloutInput, RolloutResult, RolloutStep, RolloutStepInput,
    )
    from llmgw.schemas.status import ReplicaStatus
    from llmgw.workflows import activities, options
    from llmgw.workflows.queues import CONTROL_QUEUE
    from llmgw.workflows.ids import replica_stop_id
    from llmgw.workflows.replica import ReplicaStopWorkflow

POLL_S = 2.0
MAX_STEPS = 200


@workflow.defn(name="RolloutWorkflow")
class RolloutWorkflow:
    def __init__(self) -> None:
        self._progress = "starting"
        self._retired: list[str] = []
        self._woken = False

    @workflow.query
    def progress(self) -> str:
        """The last step: what it did or waits for, with the count of outdated replicas left."""
        return self._progress

    @workflow.signal
    def wake(self) -> None:
        self._woken = True

    @workflow.run
    async def run(self, inp: RolloutInput) -> RolloutResult:
        for _ in range(MAX_STEPS):
            step = await workflow.execute_activity(
                activities.rollout_step, RolloutStepInput(model=inp.model), task_queue=CONTROL_QUEUE,
                **options.CONTROL)
            self._progress = f"{step.kind}: {step.reason} ({step.outdated} outdated, {step.current_ready} new Ready)"
            if step.kind == "done":
                return RolloutResult(model=inp.model, retired=self._retired, reason=step.reason)
            if step.kind == "retire" and step.replica_id:
                await self._retire(step)
                continue
            self._woken = False
            try:
                await workflow.wait_condition(lambda: self._woken, timeout=timedelta(seconds=POLL_S))
            except TimeoutError:
                pass
        workflow.continue_as_new(inp.model_copy(update={"steps": inp.steps + MAX_STEPS}))

    async def _retire(self, step: RolloutStep) -> None:
        rid = step.replica_id
        assert rid
        try:
            await workflow.execute_child_workflow(
                ReplicaStopWorkflow.run,
                ReplicaStopInput(replica_id=rid, reason=f"replaced by a rolling update: {step.reason}",
                                 drain_timeout_s=step.drain_timeout_s, final_status=ReplicaStatus.STOPPED),
                id=replica_stop_id(rid), task_queue=CONTROL_QUEUE,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            )
        except WorkflowAlreadyStartedError:
            # Something else is stopping it already (the reconciler, an eviction): the next step sees it gone.
            await workflow.sleep(timedelta(seconds=POLL_S))
        self._retired.append(rid)
