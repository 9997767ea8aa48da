"""What the control plane does with node reports. The fleet is authoritative about what runs:

- a shard the node does not report is not running (a registration follows a fresh start or reconnect, so
  nothing dispatched before it is running unless reported); its replica is marked lost, including when
  the node reports nothing at all (seeds 001, "An agent reporting nothing is reporting something").
  Not a starting shard that no boot has reported launching (no pid): it was fetching its weights, and its
  start is retried on the new boot (node/attempts.py), so an agent restart mid-download rebuilds nothing;
- a shard the node reports that belongs to a live replica is kept (adopted after a worker restart);
- a Ready shard we have no record of (the control plane lost its database) is adopted as a replica when
  it runs exactly what the catalog asks for: its model and profile are in the catalog, its profile hash
  matches, and the profile is a single-shard one;
- anything else (unidentifiable, left the catalog, its replica ended) is stopped: a process holding
  resources that nothing can describe is worse than no process, because placement hands them out again;
- every heartbeat is compared too (issue 9): a shard the node had launched and no longer lists fails its
  replica (out of routing within one heartbeat); a shard the node reports `stopped` while its replica is
  live (its agent stopped its engines on exit) makes the replica lost. The agent sends one request at a
  time, built when sent, so a heartbeat is never older than a report it follows.

A node speaks only for itself (Kubernetes' NodeRestriction; issue 11). Its identity is proven by the
node API (mTLS); here, whatever it says is checked against what is placed on it:
- a report on a shard placed on another node, or naming another replica than the shard's, changes nothing:
  a transition report is refused (403 `node_restriction`), and a registration asks the node to stop it;
- a shard it runs that we have no record of is adopted only under a replica id nobody has, with the shard
  id that replica's rank 0 has (`<replica>-r0`): a node cannot add itself to another node's replica;
- every endpoint it reports must be at one of its own addresses (security/node_address.py), else the
  report is refused as above: the gateway proxies clients to these endpoints. What is stored is the
  endpoint pinned to the address verified at report time, never a name the gateway would resolve again.

Readiness is pushed (issue 13): when a node reports the last of a starting replica's shards ready, the
replica is marked Ready here, at rank 0's endpoint, and gateways route to it on the NOTIFY that follows.
The start workflow's own `mark_replica(ready)` then finds it Ready and goes on as if it had marked it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import catalog_repo, fleet_repo
from llmgw.engines.exits import describe_exit
from llmgw.schemas.api import (
    HeartbeatRequest, HeartbeatResponse, LaunchCheckRequest, LaunchCheckResponse, LeaveRequest, LeaveResponse,
    PeerRef, RegisterRequest, RegisterResponse, ShardStatusRequest,
)
from llmgw.schemas.catalog import Catalog
from llmgw.schemas.inventory import Inventory, ShardReport
from llmgw.schemas.status import ReplicaStatus, ShardStatus, wanted_by_start
from llmgw.security.node_address import AddressUnknown, NodeAddresses, pin_endpoint
from llmgw.temporal import LazyClient

log = logging.getLogger(__name__)


class NodeRestricted(Exception):
    """A node reported on something that is not its own; `str()` says what (the node API answers 403)."""


def not_its_own(node_id: str, report: ShardReport | LaunchCheckRequest, known: fleet_repo.KnownShard | None) -> str | None:
    """Why `node_id` may not report (or ask about) `report`'s shard, given its row `known` (None when it may,
    or when the shard is unknown: that is for adoption to decide)."""
    if known is None:
        return None
    if known.node_id != node_id:
        return f"shard {report.shard_id} is placed on node {known.node_id}, not on {node_id}"
    if report.replica_id != known.replica_id:
        return f"shard {report.shard_id} belongs to replica {known.replica_id}, not {report.replica_id}"
    return None


def unidentifiable(report: ShardReport, catalog: Catalog) -> str | None:
    """Why a shard we have no record of cannot be adopted, or None when it can."""
    if report.shard_id != fleet_repo.shard_id(report.replica_id, report.rank):
        return f"its id is not rank {report.rank} of replica {report.replica_id}"
    model = catalog.get(report.model)
    if model is None:
        return f"model {report.model!r} is not in the catalog"
    profile = model.profile(report.profile)
    if profile is None:
        return f"model {report.model!r} has no profile {report.profile!r}"
    if report.profile_hash != model.launch_profile(profile).spec_hash():  # (its adapters included)
        return "it runs a different profile than the catalog now asks for"
    if profile.nodes > 1 or report.rank != 0:
        return "a shard of a multi-node replica cannot be adopted alone"
    if report.state != ShardStatus.READY or not report.endpoint:
        return f"it is {report.state}, not serving"
    return None


def batchable(req: HeartbeatRequest) -> bool:
    """A steady-state heartbeat (no inventory, no download progress): the kind `heartbeat_many` takes."""
    return req.inventory is None and not req.downloads


def not_live_here(req: HeartbeatRequest, live: list[fleet_repo.NodeShard]) -> list[str]:
    """The shards `req` lists (not as failed) that are not among `live`, its node's shards of replicas that
    have not ended: to be looked up (none, in a steady fleet)."""
    live_ids = {shard.id for shard in live}
    return [s.shard_id for s in req.shards if s.state != ShardStatus.FAILED and s.shard_id not in live_ids]


def ended_here(req: HeartbeatRequest, rows: dict[str, fleet_repo.KnownShard]) -> list[str]:
    """The shards `req` lists, placed on its node, whose replica has ended (`rows`: the looked-up shards):
    a stop that did not reach the node, or failed there, and was settled anyway (the GPUs count as free).
    The node stops them now, rather than only at its next registration."""
    return list(dict.fromkeys(s.shard_id for s in req.shards if (row := rows.get(s.shard_id)) is not None
                              and s.state != ShardStatus.FAILED and row.node_id == req.node_id
                              and row.replica_status.is_ended))


class FleetService:
    def __init__(self, engine: AsyncEngine, temporal: LazyClient, peer_fresh_s: float = 15.0):
        """`peer_fresh_s`: a node is named as a peer to fetch from only if it beat within this long
        (`node_unreachable_after_s`)."""
        self.engine = engine
        self.temporal = temporal
        self.peer_fresh_s = peer_fresh_s
        self.observer_id = f"{fleet_repo.NODE_API}{uuid.uuid4().hex[:12]}"

    async def observe_loop(self, interval_s: float, gap_s: float) -> None:
        """Tick this process's observer row every `interval_s` while it runs (placement/liveness.py): a
        node's heartbeats count as silent only while the node API was there to receive them. A tick after
        a gap of more than `gap_s` (this process frozen, Postgres down) starts a new run of sight."""
        while True:
            try:
                async with self.engine.begin() as conn:
                    await fleet_repo.observer_tick(conn, self.observer_id, gap_s)
            except Exception as exc:  # noqa: BLE001 - Postgres away: the gap is the point; keep ticking
                log.warning("observer tick failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def register(self, req: RegisterRequest, node: NodeAddresses, version: str | None = None) -> RegisterResponse:
        """`version`: the node worker's llmgw version, from its `User-Agent` (None: not an llmgw one, or older)."""
        req = req.model_copy(update={"inventory": await self._pin_peer(req.node_id, req.inventory, node)})
        reported = {s.shard_id: s for s in req.shards}
        resp = RegisterResponse(node_id=req.node_id, peers=True)
        lost: list[str] = []
        foreign: dict[str, str] = {}
        unverified: set[str] = set()  # its endpoint's name cannot be resolved now: neither kept anew nor stopped
        for sid, report in list(reported.items()):
            try:
                reported[sid], why = await self._pin(report, node)
                if why:
                    foreign[sid] = why
            except AddressUnknown as exc:
                log.warning("node %s reports shard %s, whose endpoint cannot be checked now (%s); leaving it as "
                            "it was until the node registers again", req.node_id, sid, exc)
                unverified.add(sid)
        async with self.engine.begin() as conn:
            prev_boot = await fleet_repo.upsert_node(conn, req.node_id, req.boot_id, req.inventory, version)
            known = await fleet_repo.known_shards(conn, list(reported))
            catalog = None
            for sid, report in reported.items():
                if sid in unverified:
                    continue  # its row, if any, is not marked lost below either
                row = known.get(sid)
                why = foreign.get(sid) or not_its_own(req.node_id, report, row)
                if why is not None:
                    log.warning("node %s reports %s; asking it to stop that engine", req.node_id, why)
                    resp.stop.append(sid)
                    continue
                if row is not None and not row.replica_status.is_ended:
                    await fleet_repo.update_shard(conn, req.node_id, report)
                    resp.adopted.append(sid)
                    continue
                if row is None:
                    catalog = catalog or await catalog_repo.get_catalog(conn)
                    why = unidentifiable(report, catalog)
                    if why is None and await fleet_repo.adopt_replica(conn, req.node_id, report):
                        resp.adopted.append(sid)
                        log.info("adopted shard %s on %s: it runs %s as the catalog asks", sid, req.node_id, report.model)
                        continue
                    log.warning("node %s runs shard %s, which cannot be adopted (%s); asking the node to stop it",
                                req.node_id, sid, why or f"replica id {report.replica_id} is taken")
                resp.stop.append(sid)
            for shard in await fleet_repo.shards_on_node(conn, req.node_id):
                if shard.id in reported and shard.id not in foreign:
                    continue
                # A starting shard of the same boot may be mid-launch, and one no boot has reported launching
                # (no pid: fetching its weights, or not begun) is still its start's to launch: the new boot
                # retries that start at once (node/attempts.py). Any other unreported shard is gone.
                if shard.status == ShardStatus.STARTING and (prev_boot == req.boot_id or shard.pid is None):
                    continue
                t = await fleet_repo.transition_replica(
                    conn, shard.replica_id, ReplicaStatus.LOST,
                    failure=f"node {req.node_id} registered without shard {shard.id}")
                if t.applied:
                    lost.append(shard.replica_id)
        if lost:
            log.warning("node %s does not run replicas %s any more; marked lost", req.node_id, ", ".join(lost))
        self.temporal.wake_soon(f"node {req.node_id} registered")
        return resp

    async def _pin_peer(self, node_id: str, inv: Inventory, node: NodeAddresses) -> Inventory:
        """`inv` with its peer listener's URL pinned to the node's verified address (the rule of engine
        endpoints: a node may only point peers at itself), or dropped, with a note that says why."""
        if not inv.peer_url:
            return inv
        try:
            pinned = await pin_endpoint(inv.peer_url, node)
        except AddressUnknown as exc:
            return inv.model_copy(update={"peer_url": None, "notes": [*inv.notes, f"peer listener not advertised: {exc}"]})
        if pinned.refusal:
            log.warning("node %s advertises a peer listener elsewhere: %s", node_id, pinned.refusal)
            return inv.model_copy(update={"peer_url": None, "notes": [
                *inv.notes, f"peer listener not advertised: {pinned.refusal}"][:100]})
        return inv.model_copy(update={"peer_url": pinned.endpoint})

    async def heartbeat(self, req: HeartbeatRequest, node: NodeAddresses | None = None) -> HeartbeatResponse:
        """`node`: where the beat came from, to pin a peer listener its inventory (when it carries one) names."""
        if req.inventory is not None and req.inventory.peer_url:
            req = req.model_copy(update={"inventory": await self._pin_peer(req.node_id, req.inventory, node)
                                         if node is not None else req.inventory.model_copy(update={"peer_url": None})})
        gone: list[str] = []
        stop: list[str] = []
        async with self.engine.begin() as conn:
            known = await fleet_repo.heartbeat(conn, req.node_id, req.boot_id, req.inventory, req.downloads)
            if known:
                live = await fleet_repo.shards_on_node(conn, req.node_id)
                others = not_live_here(req, live)
                stop = ended_here(req, await fleet_repo.known_shards(conn, others)) if others else []
                gone = await self._fail_unlisted(conn, req, live)
        return self._answer(req, known, gone, stop)

    async def heartbeat_many(self, reqs: list[HeartbeatRequest]) -> list[HeartbeatResponse]:
        """The answers to `reqs`, steady-state heartbeats (no inventory, no downloads: `batchable`), each
        decided exactly as `heartbeat` decides it, in one transaction of one statement for them all
        (`fleet_repo.heartbeat_many`), plus one lookup of the shards they list that are not live here and
        a transition for each shard gone (none of either in a steady fleet). Raises what the database
        raises: nothing of the batch is then applied (control/heartbeat_batch.py retries each alone)."""
        decided: list[tuple[bool, list[str], list[str]]] = []
        async with self.engine.begin() as conn:
            live_by = await fleet_repo.heartbeat_many(conn, [(r.node_id, r.boot_id) for r in reqs])
            others = [not_live_here(r, live_by[(r.node_id, r.boot_id)]) if (r.node_id, r.boot_id) in live_by
                      else [] for r in reqs]
            wanted = sorted({sid for ids in others for sid in ids})
            rows = await fleet_repo.known_shards(conn, wanted) if wanted else {}
            for r, ids in zip(reqs, others):
                live = live_by.get((r.node_id, r.boot_id))
                if live is None:
                    decided.append((False, [], []))
                    continue
                stop = ended_here(r, {sid: rows[sid] for sid in ids if sid in rows}) if ids else []
                decided.append((True, await self._fail_unlisted(conn, r, live), stop))
        return [self._answer(r, known, gone, stop) for r, (known, gone, stop) in zip(reqs, decided)]

    async def _fail_unlisted(self, conn, req: HeartbeatRequest, live: list[fleet_repo.NodeShard]) -> list[str]:
        """Fail the replica of each shard in `live` the node had launched and `req` no longer lists; returns
        the replicas failed now."""
        listed = {s.shard_id for s in req.shards}
        gone: list[str] = []
        for shard in live:
            if shard.id in listed or not shard.launched:
                continue
            t = await fleet_repo.transition_replica(
                conn, shard.replica_id, ReplicaStatus.FAILED,
                failure=f"node {req.node_id} no longer runs shard {shard.id} (its heartbeat does not list it)")
            if t.applied:
                gone.append(shard.replica_id)
        return gone

    def _answer(self, req: HeartbeatRequest, known: bool, gone: list[str], stop: list[str]) -> HeartbeatResponse:
        """The answer to a committed heartbeat, with what it changed logged (and the reconciler woken)."""
        if gone:
            log.warning("node %s no longer runs replicas %s; marked failed", req.node_id, ", ".join(gone))
            self.temporal.wake_soon(f"node {req.node_id} no longer runs {', '.join(gone)}")
        if stop:
            log.warning("node %s still runs shards %s of ended replicas; asking it to stop them", req.node_id,
                        ", ".join(sorted(stop)))
        return HeartbeatResponse(ok=known, reregister=not known, stop=sorted(stop) or None)

    async def leave(self, req: LeaveRequest) -> LeaveResponse:
        """The node's agent is leaving and stops its engines on the way out: the node is Unreachable from
        now until it registers again (nothing is placed on it), and every replica with a shard on it that
        has not ended is lost, for this cause, before a peer rank elsewhere can fail it for another."""
        lost: list[str] = []
        async with self.engine.begin() as conn:
            replica_ids = await fleet_repo.leave_node(conn, req.node_id, req.boot_id)
            for replica_id in replica_ids or []:
                t = await fleet_repo.transition_replica(
                    conn, replica_id, ReplicaStatus.LOST,
                    failure=f"node {req.node_id} left: its agent stopped its engines as it exited",
                    replaced=False)  # an agent that says it leaves was stopped on purpose: no restart to count
                if t.applied:
                    lost.append(replica_id)
        if replica_ids is None:
            return LeaveResponse(known=False)
        log.warning("node %s left (its agent is stopping its engines)%s", req.node_id,
                    f"; replicas {', '.join(lost)} marked lost" if lost else "")
        self.temporal.wake_soon(f"node {req.node_id} left")
        return LeaveResponse(known=True, lost=lost)

    async def _pin(self, report: ShardReport, node: NodeAddresses) -> tuple[ShardReport, str | None]:
        """`report` with its endpoint pinned to the verified address, and why it is refused (None when not).
        Raises `AddressUnknown` when the endpoint's name cannot be resolved now."""
        if not report.endpoint:
            return report, None
        pinned = await pin_endpoint(report.endpoint, node)
        if pinned.refusal:
            return report, f"shard {report.shard_id}: {pinned.refusal}"
        if pinned.endpoint != report.endpoint:
            report = report.model_copy(update={"endpoint": pinned.endpoint})
        return report, None

    async def launch_check(self, req: LaunchCheckRequest) -> LaunchCheckResponse:
        """Is the shard's replica still `starting` (wanted by its start), and its fencing generation? Asked by
        its node before a fetch and again before a launch that followed a long one; raises `NodeRestricted`
        for a shard placed on another node."""
        async with self.engine.connect() as conn:
            row = (await fleet_repo.known_shards(conn, [req.shard_id])).get(req.shard_id)
        if row is None:
            return LaunchCheckResponse(wanted=False, status="unknown")
        why = not_its_own(req.node_id, req, row)
        if why is not None:
            raise NodeRestricted(why)
        wanted = wanted_by_start(row.replica_status)
        peers: list[PeerRef] | None = None
        if wanted and req.cache_name:
            async with self.engine.connect() as conn:
                peers = [PeerRef(node_id=n, url=u) for n, u in await fleet_repo.peers_holding(
                    conn, req.cache_name, req.node_id, self.peer_fresh_s)]
        return LaunchCheckResponse(wanted=wanted, status=row.replica_status, generation=row.generation, peers=peers)

    async def shard_status(self, req: ShardStatusRequest, node: NodeAddresses) -> None:
        """A shard changed state on its node. A failure takes its replica out of routing at once; so does a
        stop the control plane did not ask for (the agent stopped its engines as it exited): lost. Raises
        `NodeRestricted` for a report on a shard placed on another node, or with an endpoint elsewhere; a
        report on a shard the control plane has no record of changes nothing."""
        failed_replica = None
        s, why = await self._pin(req.shard, node)  # AddressUnknown: the node API answers 503, the node retries
        async with self.engine.begin() as conn:
            row = (await fleet_repo.known_shards(conn, [s.shard_id])).get(s.shard_id)
            why = why or not_its_own(req.node_id, s, row)
            if why is not None:
                log.warning("refused a report from node %s: %s", req.node_id, why)
                raise NodeRestricted(why)
            if row is None:
                return
            status = await fleet_repo.update_shard(conn, req.node_id, s)
            if s.state == ShardStatus.READY and status == ReplicaStatus.STARTING:
                # Pushed by the node the moment the engine answered: routed now, not after the start
                # workflow's next step (which then finds it Ready and carries on).
                await fleet_repo.ready_if_every_shard_is(conn, row.replica_id)
            elif s.state == ShardStatus.FAILED and status is not None and not status.is_ended:
                # First line: the cause, decoded; then the engine's own last words (what `ctl replicas` shows).
                why = f"shard {s.shard_id} on {req.node_id} {s.exit_reason or describe_exit(s.exit_code)}"
                if s.output_tail and s.output_tail.strip():
                    why += "\nlast output:\n" + s.output_tail.strip()[-1500:]
                if (await fleet_repo.transition_replica(conn, row.replica_id, ReplicaStatus.FAILED, failure=why)).applied:
                    failed_replica = row.replica_id
            elif s.state == ShardStatus.STOPPED and status is not None and not status.is_ended:
                t = await fleet_repo.transition_replica(
                    conn, row.replica_id, ReplicaStatus.LOST, failure=f"node {req.node_id} stopped shard {s.shard_id} "
                    "on its own (its agent stopped its engines as it exited)")
                if t.applied:
                    failed_replica = row.replica_id
        if failed_replica:
            log.warning("replica %s ended: shard %s %s", failed_replica, s.shard_id,
                        "stopped by its node" if s.state == ShardStatus.STOPPED else s.exit_reason or describe_exit(s.exit_code))
            ended = ReplicaStatus.LOST if s.state == ShardStatus.STOPPED else ReplicaStatus.FAILED
            self.temporal.wake_soon(f"replica {failed_replica} {ended}")
