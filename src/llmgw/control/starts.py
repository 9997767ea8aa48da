"""Starting a placed replica's start workflow from the control worker, and finding placements left without
one (review F3).

`decide` creates a placed replica (`starting`) in the transaction that saves its pass, then starts its
start workflow. Between the two, only a retry of that same `decide` attempt closes the gap; if the
reconciler's run is closed meanwhile (terminated by an operator, or by the control worker as wedged after a
deploy that broke replay), no retry comes and the replica sat `starting`, holding its GPUs with nothing
launched, until the start budget (an hour) failed it. So every pass looks at the `starting` replicas older
than `STRANDED_AFTER_S` it has not yet seen a start workflow for, asks Temporal, and starts the missing
ones (the id's `REJECT_DUPLICATE` policy makes a start already there, running or closed, a no-op).
"""

from __future__ import annotations

import logging
import time

from temporalio.client import Client
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from llmgw.db.fleet_repo import MAX_PEERS
from llmgw.schemas.catalog import Profile
from llmgw.schemas.inventory import PeerRef
from llmgw.schemas.payloads import ReplicaStartInput, ReplicaWakeInput, ShardPlacement, Snapshot, StageWeightsInput
from llmgw.schemas.status import ReplicaStatus
from llmgw.workflows import attributes
from llmgw.workflows.queues import CONTROL_QUEUE
from llmgw.weights.naming import cache_name_for
from llmgw.workflows.ids import replica_start_id, replica_wake_id, stage_id

log = logging.getLogger(__name__)
STRANDED_AFTER_S = 20.0  # a placement this old with no start workflow was left behind (a start RPC takes ms)
CHECKS_PER_PASS = 32  # describe RPCs one pass may spend on it


async def start_replica(client: Client, replica_id: str, model: str, profile: Profile, shards: list[ShardPlacement],
                        ready_timeout_s: float, search_attributes: bool, sleep_mode: bool = False,
                        wait_heartbeat_timeout_s: float = 30.0) -> bool:
    """Start `replica_id`'s start workflow; True when it runs or ran (started now or before), False when
    Temporal could not be asked (the caller leaves it to a later attempt). `sleep_mode`: its engine is
    launched able to sleep (its model has `scaling.sleep_after`)."""
    try:
        await client.start_workflow(
            "ReplicaStartWorkflow",
            ReplicaStartInput(replica_id=replica_id, model=model, profile=profile, shards=shards,
                              ready_timeout_s=ready_timeout_s, sleep_mode=sleep_mode,
                              wait_heartbeat_timeout_s=wait_heartbeat_timeout_s),
            id=replica_start_id(replica_id), task_queue=CONTROL_QUEUE,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            memo=attributes.memo(model, profile.name or "default"),
            search_attributes=attributes.lifecycle("start", model, replica_id, [x.node_id for x in shards])
            if search_attributes else None,
            request_eager_start=True,
        )
    except WorkflowAlreadyStartedError:
        pass  # started by an earlier attempt
    except RPCError as exc:
        log.warning("could not start replica %s's start workflow (%s)", replica_id, exc)
        return False
    return True


class StrandedStarts:
    """Per control worker: the starting replicas whose start workflow was seen (not asked about again)."""

    def __init__(self, client: Client):
        self.client = client
        self.seen: set[str] = set()

    async def repair(self, snapshot: Snapshot, just_placed: set[str], ready_timeout_s: float,
                     wait_heartbeat_timeout_s: float = 30.0) -> list[str]:
        """Start the start workflow of every placement in `snapshot` left without one; returns their ids."""
        starting = {r.id: r for r in snapshot.replicas if r.status == ReplicaStatus.STARTING}
        self.seen &= set(starting)
        profiles = {(m.name, p.name): m.launch_profile(p) for m in snapshot.models for p in m.profiles}
        sleeping = {m.name for m in snapshot.models if m.effective_scaling.sleep_after is not None}
        repaired: list[str] = []
        checks = 0
        for r in starting.values():
            if r.id in self.seen or r.id in just_placed or r.created_at is None:
                continue
            if (snapshot.now - r.created_at).total_seconds() < STRANDED_AFTER_S:
                continue
            profile = profiles.get((r.model, r.profile))
            if profile is None:  # its profile left the catalog: the planner stops or rolls it
                continue
            if checks >= CHECKS_PER_PASS:
                break
            checks += 1
            try:
                await self.client.get_workflow_handle(replica_start_id(r.id)).describe()
                self.seen.add(r.id)
                continue
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:
                    continue  # Temporal is away: ask again next pass
            log.warning("replica %s of %s was placed %.0fs ago and has no start workflow (its pass's run was "
                        "closed before it started one); starting it now", r.id, r.model,
                        (snapshot.now - r.created_at).total_seconds())
            if await start_replica(self.client, r.id, r.model, profile, r.shards, ready_timeout_s,
                                   snapshot.search_attributes,
                                   r.model in sleeping and profile.sleep_refusal() is None, wait_heartbeat_timeout_s):
                self.seen.add(r.id)
                repaired.append(r.id)
        return repaired


async def start_wake(client: Client, a, search_attributes: bool) -> bool:
    """Start the wake workflow of a `wake` action (issue 39) from `decide`, as a start is: a woken replica is a
    request waiting, and the reconciler's child start had cost a workflow task before the wake's first step.
    True when it runs or ran; one running already (a pass before decided the same) is left to run; a closed
    one's id is reused (a replica sleeps and wakes many times). False when Temporal could not be asked: the
    reconciler starts it as its child."""
    try:
        await client.start_workflow(
            "ReplicaWakeWorkflow", ReplicaWakeInput(replica_id=a.replica_id, model=a.model, reason=a.reason),
            id=replica_wake_id(a.replica_id), task_queue=CONTROL_QUEUE,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE, memo=attributes.memo(a.model, a.profile),
            search_attributes=attributes.lifecycle("wake", a.model, a.replica_id, a.nodes or None)
            if search_attributes else None,
            request_eager_start=True,
        )
    except WorkflowAlreadyStartedError:
        pass  # running: that wake serves this pass too
    except RPCError as exc:
        log.warning("could not start replica %s's wake workflow (%s)", a.replica_id, exc)
        return False
    return True


# ---- pre-staging (issue 39; placement/prestage.py) -------------------------------------------------------

STAGE_RETRY_S = 300.0  # a stage this process started is not started again for this long (one that failed)


class Stages:
    """Starts the `StageWeightsWorkflow` of each `stage` decision a pass made (never the reconciler's
    workflow: runs from before replay unchanged). A stage running already is left to run (the id's conflict
    policy); one that closed may run again (its weights since reclaimed), but not within `STAGE_RETRY_S` of
    this process's last start of it, so a stage that fails (its source gone) is not retried every pass."""

    def __init__(self, client: Client):
        self.client = client
        self._started: dict[str, float] = {}

    async def start(self, decisions: list, snapshot: Snapshot, node_status: dict[str, str]) -> list[str]:
        """The ids started now."""
        now = time.monotonic()
        out = []
        for d in decisions:
            node = d.shards[0].node_id
            name = cache_name_for(d.profile_spec.source)
            wid = stage_id(node, name)
            if wid in self._started and now - self._started[wid] < STAGE_RETRY_S:
                continue
            peers = [PeerRef(node_id=n.id, url=n.inventory.peer_url) for n in snapshot.nodes
                     if n.id != node and n.inventory.peer_url and name in n.inventory.cached_sources
                     and node_status.get(n.id) == "ready"][:MAX_PEERS]
            try:
                await self.client.start_workflow(
                    "StageWeightsWorkflow",
                    StageWeightsInput(node_id=node, model=d.model, source=d.profile_spec.source, cache_name=name,
                                      peers=peers),
                    id=wid, task_queue=CONTROL_QUEUE, id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                    memo=attributes.memo(d.model, d.profile or "default"))
            except WorkflowAlreadyStartedError:
                pass  # running: left to finish
            except RPCError as exc:
                log.warning("could not start %s (%s)", wid, exc)
                continue
            self._started[wid] = now
            out.append(wid)
            log.info("staging %s's weights on %s ahead of its next start%s", d.model, node,
                     f" (from {', '.join(p.node_id for p in peers)} or the mirror)" if peers else "")
        return out
