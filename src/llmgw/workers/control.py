"""The control worker (`llmgw worker`): runs every workflow and the control-plane activities.

Several can run; Temporal shares the work. On start it makes sure the singleton reconciler is running
(started with a conflict policy that returns the running one, so a second worker never starts another).
"""

from __future__ import annotations

import asyncio
import logging

from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from llmgw.activities.control import ControlActivities
from llmgw.config import Settings
from llmgw.db.engine import async_engine
from llmgw.schemas.payloads import ReconcilerInput
from llmgw.telemetry import ControlMetrics
from llmgw.temporal import SearchAttributeCheck, connect
from llmgw.workflows import attributes
from llmgw.workflows.logs import ShardLogWorkflow
from llmgw.workflows.queues import CONTROL_QUEUE, RECONCILER_ID
from llmgw.workflows.reclaim import ReclaimWorkflow
from llmgw.workflows.reconciler import ReconcilerWorkflow
from llmgw.workflows.replica import ReplicaStartWorkflow, ReplicaStopWorkflow
from llmgw.workflows.rollout import RolloutWorkflow

log = logging.getLogger(__name__)
WORKFLOWS = [ReconcilerWorkflow, ReplicaStartWorkflow, ReplicaStopWorkflow, ReclaimWorkflow, ShardLogWorkflow,
             RolloutWorkflow]


def workflow_runner() -> SandboxedWorkflowRunner:
    """The sandbox every workflow runs in, on the worker and in the replay tests alike. Pydantic and
    OpenTelemetry pass through: payload models keep their identity, and spans made inside workflows reach
    the process's tracer provider rather than a sandboxed no-op one."""
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules("pydantic", "opentelemetry"))


async def ensure_reconciler(client, settings: Settings, search_attributes: bool = False) -> None:
    await client.start_workflow(
        ReconcilerWorkflow.run, ReconcilerInput(interval_s=settings.reconcile_interval_s),
        id=RECONCILER_ID, task_queue=CONTROL_QUEUE, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=attributes.lifecycle("reconciler") if search_attributes else None,
    )


async def run_control_worker(settings: Settings, stop: asyncio.Event) -> None:
    engine = async_engine(settings.require_database_url())
    client = await connect(settings)
    check = SearchAttributeCheck(settings.temporal_namespace, settings.temporal_search_attributes)
    metrics = ControlMetrics()
    if settings.control_metrics_port:
        metrics.serve(settings.control_metrics_port, settings.host)
    acts = ControlActivities(engine, settings.node_unreachable_after_s, settings.node_lost_after_s,
                             client=client, attributes=check, metrics=metrics,
                             backoff_base_s=settings.start_backoff_base_s, backoff_max_s=settings.start_backoff_max_s,
                             drain_timeout_s=settings.drain_timeout_s)
    worker = Worker(client, task_queue=CONTROL_QUEUE, workflows=WORKFLOWS, activities=acts.all(),
                    workflow_runner=workflow_runner())
    try:
        async with worker:
            await ensure_reconciler(client, settings, await check.registered(client))
            log.info("control worker polling %s; reconciler running", CONTROL_QUEUE)
            await stop.wait()
    finally:
        await engine.dispose()
