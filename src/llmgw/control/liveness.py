"""The second liveness witness: is a node's worker polling its task queue `node/<id>`?

Read from Temporal's task-queue description (`DescribeTaskQueue`, activity pollers, their last access
time), by the control worker inside an activity, never in workflow code. Independent of the node API: a
frozen gateway, an expired node-API certificate or Postgres down leave it untouched.

An idle poller's last access is when its current long poll began (Temporal's
`matching.longPollExpirationInterval`, 60 s by default), so the planner allows that much age
(`poller_grace_s`) before the witness counts as silent. Temporal keeps pollers in memory: after it
restarts a node has none until its worker polls again, which is why the last time seen is kept in
Postgres (`nodes.polled_at`) and only ever moves forward.
"""

from __future__ import annotations

import asyncio
import time

from datetime import datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from llmgw.config import Settings
from llmgw.db import fleet_repo
from llmgw.placement.liveness import fleet_liveness
from llmgw.schemas.payloads import LivenessFacts, Snapshot
from llmgw.workflows.queues import node_queue

CONCURRENCY = 16
TIMEOUT_S = 5.0  # for all nodes together: the snapshot activity must stay well inside its own timeout


async def poll_ages(client: Client, node_ids: list[str]) -> tuple[dict[str, float], str | None]:
    """Seconds since each node's worker last began a poll on its queue (nodes never seen are absent), and
    why the pollers could not be read (None when they could). Clock: this host's against Temporal's."""
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(node_id: str) -> float | None:
        async with sem:
            resp = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
                namespace=client.namespace, task_queue=TaskQueue(name=node_queue(node_id)),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY))
        seen = [p.last_access_time.ToNanoseconds() / 1e9 for p in resp.pollers if p.HasField("last_access_time")]
        return max(0.0, time.time() - max(seen)) if seen else None

    try:
        ages = await asyncio.wait_for(asyncio.gather(*[one(n) for n in node_ids]), TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - RPCError, timeout: the witness is unreadable this pass, and says so
        return {}, f"{type(exc).__name__}: {exc}"[:300]
    return {n: a for n, a in zip(node_ids, ages) if a is not None}, None


async def read_pollers(engine: AsyncEngine, client: Client | None) -> tuple[dict[str, float], str | None]:
    """`poll_ages` for every registered node (outside any transaction: these are RPCs)."""
    if client is None:
        return {}, "no Temporal client in this worker"
    async with engine.connect() as conn:
        ids = [n.id for n in await fleet_repo.list_nodes(conn)]
    return await poll_ages(client, ids)


async def record_and_read_liveness(conn: AsyncConnection, now: datetime, ages: dict[str, float],
                                   pollers_error: str | None, settings: Settings) -> LivenessFacts:
    """Keep what the pollers showed (`nodes.polled_at`, and the pollers' run of sight when they could be
    read), then read every liveness fact a pass needs, in the snapshot's transaction."""
    await fleet_repo.set_polled(conn, {n: now - timedelta(seconds=a) for n, a in ages.items()})
    fresh = settings.node_unreachable_after_s
    if pollers_error is None:
        await fleet_repo.observer_tick(conn, fleet_repo.POLLERS, fresh)
    seen = await fleet_repo.liveness_reads(conn, fresh, settings.lost_teardown_window_s)
    return LivenessFacts(
        observer_since=seen.node_api_since, pollers_error=pollers_error, pollers_since=seen.pollers_since,
        doubted_at=seen.doubted_at, poller_grace_s=settings.poller_grace_s, silent_share=settings.silent_share,
        lost_teardown_limit=settings.lost_teardown_limit, lost_teardown_window_s=settings.lost_teardown_window_s,
        recent_lost=seen.recent_lost)


async def remember_doubt(engine: AsyncEngine, snapshot: Snapshot) -> None:
    """When this snapshot finds the observer doubtful, record it (`LivenessFacts.doubted_at`): the passes
    after the doubt ends give every node `lost_after_s` afresh."""
    if snapshot.liveness is None or not fleet_liveness(snapshot).blind:
        return
    async with engine.begin() as conn:
        await fleet_repo.observer_tick(conn, fleet_repo.DOUBT, snapshot.lost_after_s)
        snapshot.liveness.doubted_at = await fleet_repo.observer_seen(conn, fleet_repo.DOUBT)
