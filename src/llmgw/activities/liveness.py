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

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

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
