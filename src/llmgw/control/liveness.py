"""The second liveness witness: is a node's worker polling its task queue `node/<id>`?

Read from Temporal's task-queue description (`DescribeTaskQueue`, activity pollers, their last access
time), by the control worker inside an activity, never in workflow code. Independent of the node API: a
frozen gateway, an expired node-API certificate or Postgres down leave it untouched.

An idle poller's last access is when its current long poll began (Temporal's
`matching.longPollExpirationInterval`, 60 s by default), so the planner allows that much age
(`poller_grace_s`) before the witness counts as silent. Temporal keeps pollers in memory: after it
restarts a node has none until its worker polls again, which is why the last time seen is kept in
Postgres (`nodes.polled_at`) and only ever moves forward.

**Bounded per pass, in rotation** (issue 42). One RPC per node per pass costs about 1 ms of Temporal's CPU
(bench/fleet.py): 10 s a pass at 10k nodes. So a pass reads at most `poller_reads_per_pass` nodes (1,024),
those read longest ago first (never-read nodes before all), and asks no more after `poller_read_budget_s`
(1 s), waiting for the answers of those it asked (within 5 s in all). When each node was read is kept (`nodes.poll_read_at`) and a node's poller
silence counts only up to it (placement/liveness.py). Freshness: every node's pollers are read at least
once every ceil(N / poller_reads_per_pass) passes (every pass up to 1,024 nodes, as before; every 10th at
10k nodes: 100 s at the 10 s reconcile interval when nothing else triggers a pass), so a lost node is
declared at most that much later than `node_lost_after_s` + `poller_grace_s` after its last poll, and a
live node is never judged silent for not having been read.
"""

from __future__ import annotations

import asyncio
import time

from datetime import datetime, timedelta, timezone

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from llmgw.config import Settings
from llmgw.db import fleet_repo
from llmgw.placement.liveness import FleetLiveness, fleet_liveness
from llmgw.schemas.payloads import LivenessFacts, Snapshot
from llmgw.workflows.queues import node_queue

CONCURRENCY = 16
LIMIT_S = 5.0  # for a whole pass, whatever its budget: the snapshot activity must stay well inside its own timeout


def rotation(nodes: list[fleet_repo.NodeRow], per_pass: int) -> list[str]:
    """The node ids whose pollers this pass reads: at most `per_pass`, never-read nodes first, then those
    read longest ago (`poll_read_at`), ties by id."""
    never = datetime.min.replace(tzinfo=timezone.utc)
    order = sorted(nodes, key=lambda n: (n.poll_read_at or never, n.id))
    return [n.id for n in order[:per_pass]]


async def poll_ages(client: Client, node_ids: list[str], budget_s: float,
                    limit_s: float = LIMIT_S) -> tuple[dict[str, float], list[str], str | None]:
    """Seconds since each node's worker last began a poll on its queue (nodes read but never seen polling
    are absent), the nodes whose pollers were read (polling or not), and why the pollers could not be read
    (None when they could). Clock: this host's against Temporal's.

    `node_ids` are asked in order, `CONCURRENCY` at a time; none is asked after `budget_s` (those left keep
    their older read, so they come first next pass), and every RPC asked is waited for, up to `limit_s`
    for the whole pass: a node whose answer is slow is not passed over for good, it only slows the pass.
    An RPC error, or no answer at all, makes the witness unreadable this pass."""
    deadline = time.monotonic() + budget_s
    queue = iter(node_ids)
    ages: dict[str, float | None] = {}

    async def asker() -> None:
        for node_id in queue:
            resp = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
                namespace=client.namespace, task_queue=TaskQueue(name=node_queue(node_id)),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY))
            seen = [p.last_access_time.ToNanoseconds() / 1e9 for p in resp.pollers if p.HasField("last_access_time")]
            ages[node_id] = max(0.0, time.time() - max(seen)) if seen else None
            if time.monotonic() >= deadline:
                return

    if not node_ids:
        return {}, [], None
    try:
        await asyncio.wait_for(asyncio.gather(*[asker() for _ in range(min(CONCURRENCY, len(node_ids)))]), limit_s)
    except asyncio.TimeoutError:
        if not ages:
            return {}, [], f"no answer from Temporal within {limit_s:g}s for any of {len(node_ids)} task queues"
    except Exception as exc:  # noqa: BLE001 - RPCError: the witness is unreadable this pass, and says so
        return {}, [], f"{type(exc).__name__}: {exc}"[:300]
    return {n: a for n, a in ages.items() if a is not None}, list(ages), None


async def read_pollers(engine: AsyncEngine, client: Client | None,
                       settings: Settings) -> tuple[dict[str, float], list[str], str | None]:
    """`poll_ages` for this pass's slice of the registered nodes (`rotation`; outside any transaction:
    these are RPCs)."""
    if client is None:
        return {}, [], "no Temporal client in this worker"
    async with engine.connect() as conn:
        ids = rotation(await fleet_repo.poll_reads(conn), settings.poller_reads_per_pass)
    return await poll_ages(client, ids, settings.poller_read_budget_s)


async def record_and_read_liveness(conn: AsyncConnection, now: datetime, ages: dict[str, float], read: list[str],
                                   pollers_error: str | None, settings: Settings) -> LivenessFacts:
    """Keep what the pollers showed (`nodes.polled_at`; which nodes were read now, `poll_read_at`; and the
    pollers' run of sight when they could be read), then read every liveness fact a pass needs, in the
    snapshot's transaction."""
    await fleet_repo.set_polled(conn, {n: now - timedelta(seconds=a) for n, a in ages.items()}, read, now)
    fresh = settings.node_unreachable_after_s
    if pollers_error is None:
        await fleet_repo.observer_tick(conn, fleet_repo.POLLERS, fresh)
    seen = await fleet_repo.liveness_reads(conn, fresh, settings.lost_teardown_window_s)
    return LivenessFacts(
        observer_since=seen.node_api_since, pollers_error=pollers_error, pollers_since=seen.pollers_since,
        doubted_at=seen.doubted_at, poller_grace_s=settings.poller_grace_s, silent_share=settings.silent_share,
        lost_teardown_limit=settings.lost_teardown_limit, lost_teardown_window_s=settings.lost_teardown_window_s,
        recent_lost=seen.recent_lost)


async def remember_doubt(engine: AsyncEngine, snapshot: Snapshot) -> FleetLiveness | None:
    """When this snapshot finds the observer doubtful, record it (`LivenessFacts.doubted_at`): the passes
    after the doubt ends give every node `lost_after_s` afresh. Returns the fleet's liveness as judged from
    the snapshot when nothing was recorded (the planner's to reuse), else None."""
    if snapshot.liveness is None:
        return None
    fleet = fleet_liveness(snapshot)
    if not fleet.blind:
        return fleet
    async with engine.begin() as conn:
        await fleet_repo.observer_tick(conn, fleet_repo.DOUBT, snapshot.lost_after_s)
        snapshot.liveness.doubted_at = await fleet_repo.observer_seen(conn, fleet_repo.DOUBT)
