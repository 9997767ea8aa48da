"""The control worker (`llmgw worker`): runs the fleet's workflows and the control-plane activities.
(`MirrorWorkflow` runs on the mirror worker, beside the mirror's directory: mirror/worker.py.)

Several can run; Temporal shares the work. Every `reconciler_watch_s` it makes sure the singleton
reconciler is running: started with a conflict policy that returns the running one (so a second worker
never starts another), started again if it ever closed (completed, failed, terminated), and replaced if its
workflow task keeps failing (a deploy that broke replay, a bug in workflow code). Replacing it is safe: the
reconciler holds no state of its own (every pass reads a fresh snapshot; its children are abandoned, not
cancelled, when it closes). docs/architecture.md, "Changing workflow code".
"""

from __future__ import annotations

import asyncio
import logging

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker

from llmgw.control.activities import ControlActivities
from llmgw.control.batch_activities import BatchActivities
from llmgw.control.decide import DecideActivities
from llmgw.config import Settings
from llmgw.db.engine import async_engine
from llmgw.schemas.payloads import ReconcilerInput
from llmgw.telemetry import ControlMetrics
from llmgw.temporal import SearchAttributeCheck, connect, workflow_runner
from llmgw.workflows import attributes
from llmgw.workflows.batch import BatchWorkflow
from llmgw.workflows.logs import ShardLogWorkflow
from llmgw.workflows.queues import CONTROL_QUEUE
from llmgw.workflows.ids import RECONCILER_ID
from llmgw.workflows.reclaim import ReclaimWorkflow
from llmgw.workflows.reconciler import ReconcilerWorkflow
from llmgw.workflows.replica import ReplicaStartWorkflow, ReplicaStopWorkflow
from llmgw.workflows.rollout import RolloutWorkflow
from llmgw.workflows.sleep import ReplicaSleepWorkflow, ReplicaWakeWorkflow
from llmgw.workflows.stage import StageWeightsWorkflow

log = logging.getLogger(__name__)
WORKFLOWS = [ReconcilerWorkflow, ReplicaStartWorkflow, ReplicaStopWorkflow, ReclaimWorkflow, ShardLogWorkflow,
             RolloutWorkflow, ReplicaSleepWorkflow, ReplicaWakeWorkflow, BatchWorkflow,
             StageWeightsWorkflow]
__all__ = ["WORKFLOWS", "ensure_reconciler", "run_control_worker", "watch_reconciler", "workflow_runner"]


# A reconciler whose workflow task has been tried this many times without completing is wedged.
WEDGED_ATTEMPTS = 3
MAX_REASON = 2000  # of a termination's reason: a failure message may be long (a whole stack)
_CAUSE_PREFIX = "WORKFLOW_TASK_FAILED_CAUSE_"


async def last_task_failure(client: Client, run_id: str) -> tuple[str, str]:
    """The reconciler run's latest failed workflow task, from its history: the cause
    (`non_deterministic_error`, `workflow_worker_unhandled_failure`, ...) and the failure's message;
    ("unknown", "") when the history holds none, or it cannot be read."""
    from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause

    try:
        history = await client.get_workflow_handle(RECONCILER_ID, run_id=run_id).fetch_history()
    except Exception as exc:  # noqa: BLE001 - the replacement goes ahead; say why the cause is missing
        return "unknown", f"(its history could not be read: {exc})"
    for event in reversed(history.events):
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
            a = event.workflow_task_failed_event_attributes
            cause = WorkflowTaskFailedCause.Name(a.cause).removeprefix(_CAUSE_PREFIX).lower()
            return cause, a.failure.message.strip()[:500]
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT:
            return "timed_out", "its workflow task timed out (no worker completed it)"
    return "unknown", ""


async def ensure_reconciler(client: Client, search_attributes: bool = False,
                            metrics: ControlMetrics | None = None) -> str | None:
    """Start the reconciler unless it is running; replace it when its workflow task keeps failing.
    Returns what was done ("started", "restarted after it was <status>", "replaced: ..."), None if nothing.
    `search_attributes`: the namespace has llmgw's (workflows/attributes.py), so the run carries them.

    A replaced run is not hidden: what made its task fail (the cause Temporal recorded, such as
    `non_deterministic_error`, and the failure's message) is in what this returns (the worker logs it as an
    error), in `llmgw_reconcilers_replaced_total{cause}`, and in the terminated run's reason; the run itself
    stays in Temporal, history and all, for diagnosis (until the namespace's retention)."""
    handle = client.get_workflow_handle(RECONCILER_ID)
    done = "started"
    try:
        desc = await handle.describe()
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
    else:
        if desc.status == WorkflowExecutionStatus.RUNNING:
            attempt = desc.raw_description.pending_workflow_task.attempt
            if attempt < WEDGED_ATTEMPTS:
                return None
            cause, message = await last_task_failure(client, desc.run_id)
            done = (f"replaced: its workflow task failed {attempt - 1} times, {cause}: {message} (run {desc.run_id} "
                    f"terminated and kept: temporal workflow show -w {RECONCILER_ID} -r {desc.run_id})")
            if metrics is not None:
                metrics.reconcilers_replaced.labels(cause=cause).inc()
            await handle.terminate(reason=f"replaced by the control worker: {done}"[:MAX_REASON])
        else:
            done = f"restarted after it was {desc.status.name.lower() if desc.status else 'closed'}"
    await client.start_workflow(
        ReconcilerWorkflow.run, ReconcilerInput(),
        id=RECONCILER_ID, task_queue=CONTROL_QUEUE, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=attributes.lifecycle("reconciler") if search_attributes else None,
    )
    return done


async def watch_reconciler(client: Client, every_s: float, stop: asyncio.Event,
                           check: SearchAttributeCheck | None = None, metrics: ControlMetrics | None = None) -> None:
    """`ensure_reconciler` now and every `every_s` seconds until `stop`; errors are logged, never fatal."""
    while not stop.is_set():
        try:
            done = await ensure_reconciler(client, await check.registered(client) if check else False, metrics)
            if done == "started":
                log.info("reconciler started")
            elif done and done.startswith("replaced"):
                log.error("reconciler %s", done)
            elif done:
                log.warning("reconciler %s", done)
        except Exception:  # noqa: BLE001 - Temporal briefly away: the next round tries again
            log.exception("could not check the reconciler")
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_s)
        except asyncio.TimeoutError:
            pass


def activities(acts: ControlActivities, decide: DecideActivities, batches: BatchActivities | None = None) -> list:
    """Every activity the control worker registers: one implementation of each control stub in
    `llmgw.workflows.activities.CONTROL` (tests/test_activity_stubs.py)."""
    return acts.all() + decide.all() + (batches.all() if batches is not None else [])


def origin_interceptors(settings: Settings) -> list:
    """The signer of node activities (control/origin.py), from `activity_signing_key` (or the one beside the CA).
    Without it nodes that check refuse every activity, so this says so at start."""
    from llmgw.control.origin import OriginSigning
    from llmgw.security.activity_origin import Signer, load_private_key

    path = settings.resolved_activity_signing_key
    if path is None:
        log.warning("no activity signing key (LLMGW_ACTIVITY_SIGNING_KEY, or activity-signing.key beside "
                    "LLMGW_CA_CERT; `llmgw ctl cert ca` makes it): node activities go unsigned, and every node "
                    "that checks their origin refuses them")
        return []
    try:
        key = load_private_key(path)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot load the activity signing key {path}: {exc}") from None
    return [OriginSigning(Signer(key, settings.activity_origin_ttl_s))]


async def run_control_worker(settings: Settings, stop: asyncio.Event) -> None:
    engine = async_engine(settings.require_database_url())
    client = await connect(settings)
    check = SearchAttributeCheck(settings.temporal_namespace, settings.temporal_search_attributes)
    metrics = ControlMetrics()
    if settings.control_metrics_port:
        metrics.serve(settings.control_metrics_port, settings.host)
    acts = ControlActivities(engine, settings.node_unreachable_after_s, settings.node_lost_after_s,
                             client=client, settings=settings, attributes=check, metrics=metrics,
                             backoff_base_s=settings.start_backoff_base_s, backoff_max_s=settings.start_backoff_max_s,
                             drain_timeout_s=settings.replica_drain_timeout_s)
    decide = DecideActivities(engine, settings, acts.read_snapshot, metrics, client=client, judged=acts.judged)
    worker = Worker(client, task_queue=CONTROL_QUEUE, workflows=WORKFLOWS, activities=activities(acts, decide, BatchActivities(engine, settings)),
                    workflow_runner=workflow_runner(), interceptors=origin_interceptors(settings))
    try:
        async with worker:
            log.info("control worker polling %s", CONTROL_QUEUE)
            await watch_reconciler(client, settings.reconciler_watch_s, stop, check, metrics)
    finally:
        await engine.dispose()
