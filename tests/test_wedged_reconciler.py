"""A reconciler whose workflow task keeps failing from real non-determinism (issue 38): a run written by one
workflow code, replayed by a worker whose code issues another command, on a real Temporal dev server. The
control worker's `ensure_reconciler` replaces it, and says why: the cause Temporal recorded and the
failure's message, in what it returns, in `llmgw_reconcilers_replaced_total{cause}` and in the terminated
run's reason; the run stays in Temporal with its history."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from llmgw.control.worker import WEDGED_ATTEMPTS, ensure_reconciler
from llmgw.telemetry import ControlMetrics
from llmgw.temporal import WIRE_CONVERTER
from llmgw.workflows.ids import RECONCILER_ID
from tests.helpers import await_until

pytestmark = pytest.mark.integration


@workflow.defn(name="ReconcilerWorkflow")
class Before:
    """What a run was started by: a timer first."""

    @workflow.run
    async def run(self, _: dict) -> None:
        await workflow.sleep(1)
        await workflow.wait_condition(lambda: False)


@workflow.defn(name="ReconcilerWorkflow")
class After:
    """A deploy that changed the first command without `workflow.patched`: an activity where the timer was."""

    @workflow.run
    async def run(self, _: dict) -> None:
        await workflow.execute_activity("nothing", start_to_close_timeout=timedelta(seconds=5))


async def test_a_reconciler_wedged_by_non_determinism_is_replaced_with_its_cause_surfaced(temporal, namespace):
    client = await Client.connect(temporal.address, namespace=namespace, data_converter=WIRE_CONVERTER)
    queue = f"wedge-{uuid.uuid4().hex[:8]}"  # not the control queue: the replacement run waits there untouched
    async with Worker(client, task_queue=queue, workflows=[Before], workflow_runner=UnsandboxedWorkflowRunner()):
        handle = await client.start_workflow("ReconcilerWorkflow", {}, id=RECONCILER_ID, task_queue=queue)
        await await_until(lambda: _has(handle, EventType.EVENT_TYPE_TIMER_STARTED), what="the first task done")
    run_id = handle.result_run_id
    # The timer fires; the new code replays the history without a cache and meets a timer it does not issue.
    async with Worker(client, task_queue=queue, workflows=[After], workflow_runner=UnsandboxedWorkflowRunner()):
        async def wedged():
            desc = await handle.describe()
            return desc.raw_description.pending_workflow_task.attempt >= WEDGED_ATTEMPTS
        await await_until(wedged, timeout_s=60, what=f"{WEDGED_ATTEMPTS} attempts of the workflow task")

        metrics = ControlMetrics()
        done = await ensure_reconciler(client, metrics=metrics)
    history = await client.get_workflow_handle(RECONCILER_ID, run_id=run_id).fetch_history()
    [failed] = [e.workflow_task_failed_event_attributes for e in history.events
                if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
    assert "nondetermin" in failed.failure.message.lower()
    # What the operator is told: the cause, the message and the run to look at.
    assert done is not None and done.startswith("replaced: its workflow task failed"), done
    assert "non_deterministic_error" in done and failed.failure.message.strip()[:80] in done and run_id in done
    assert metrics.registry.get_sample_value("llmgw_reconcilers_replaced_total",
                                             {"cause": "non_deterministic_error"}) == 1
    # The run is kept, terminated, with the reason; a new run replaced it.
    assert (await client.get_workflow_handle(RECONCILER_ID, run_id=run_id).describe()).status \
        == WorkflowExecutionStatus.TERMINATED
    [terminated] = [e.workflow_execution_terminated_event_attributes for e in history.events
                    if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED]
    assert "non_deterministic_error" in terminated.reason
    now = await client.get_workflow_handle(RECONCILER_ID).describe()
    assert now.run_id != run_id and now.status == WorkflowExecutionStatus.RUNNING
    await client.get_workflow_handle(RECONCILER_ID).terminate("test over")


async def _has(handle, event_type) -> bool:
    return any(e.event_type == event_type for e in (await handle.fetch_history()).events)
