"""Nodes, replicas and decisions for the admin API: the fleet as the planner judges it, forgetting a node,
revoking its certificates, and `explain`. Routes (control/admin.py) validate and call this; the transactions and refusals are here."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.control.status_service import StatusService
from llmgw.db import adapters_repo, catalog_repo, fleet_repo, reconciler_repo, revocations_repo
from llmgw.http.errors import APIError
from llmgw.placement.liveness import FleetLiveness, fleet_liveness, pollers_seen
from llmgw.security.pki import NODE_ID_RE, serial_text
from llmgw.schemas.api import (
    LiveReplicaView, NodeRemoveRequest, NodeRemoveResponse, NodeView, ReplicaView, RevocationView, RevokeRequest,
)
from llmgw.schemas.payloads import LivenessFacts, NodeSnap, ReplicaSnap, ShardPlacement, Snapshot
from llmgw.spelling import did_you_mean
from llmgw.temporal import LazyClient


class FleetAdmin:
    """Bound to the database, the Temporal client (to wake the reconciler) and the liveness settings the
    planner uses (`facts`: poller grace, silent share), so a node reads here as the planner judges it."""

    def __init__(self, engine: AsyncEngine, temporal: LazyClient, status: StatusService, unreachable_after_s: float,
                 lost_after_s: float, facts: LivenessFacts):
        self.engine = engine
        self.temporal = temporal
        self.status = status
        self.unreachable_after_s = unreachable_after_s
        self.lost_after_s = lost_after_s
        self.facts = facts

    async def _fleet(self, conn) -> tuple[list, FleetLiveness]:
        """Nodes and their liveness as the planner judges it (both witnesses, the blind observer)."""
        rows = await fleet_repo.list_nodes(conn)
        reps = await fleet_repo.active_replicas_with_shards(conn)
        seen = await fleet_repo.liveness_reads(conn, self.unreachable_after_s, self.facts.lost_teardown_window_s)
        snap = Snapshot(
            now=await fleet_repo.db_now(conn), unreachable_after_s=self.unreachable_after_s,
            lost_after_s=self.lost_after_s,
            liveness=self.facts.model_copy(update={
                "observer_since": seen.node_api_since, "pollers_since": seen.pollers_since,
                "doubted_at": seen.doubted_at}),
            nodes=[NodeSnap(id=n.id, status="ready", last_heartbeat=n.last_heartbeat, polled_at=n.polled_at,
                            poll_read_at=n.poll_read_at, left_at=n.left_at) for n in rows],
            replicas=[ReplicaSnap(id=r.id, model=r.model, profile=r.profile, status=r.status,
                                  shards=[ShardPlacement(node_id=s.node_id, rank=s.rank) for s in r.shards])
                      for r in reps])
        return rows, fleet_liveness(snap)

    async def nodes(self) -> list[NodeView]:
        async with self.engine.connect() as conn:
            rows, live = await self._fleet(conn)
        return [NodeView(id=n.id, status=live.status(n.id), last_heartbeat=n.last_heartbeat, inventory=n.inventory,
                         heartbeat_age_s=round(n.age_s, 1),
                         polled_at=n.polled_at, poll_age_s=None if n.poll_age_s is None else round(n.poll_age_s, 1),
                         poll_read_at=n.poll_read_at, pollers=pollers_seen(n.poll_age_s, _read_age(n),
                                                                          self.facts.poller_grace_s),
                         liveness=live.nodes[n.id].describe(), notes=live.notes, registered_at=n.registered_at,
                         version=n.version or "")
                for n in rows]

    async def replicas(self, include_ended: bool) -> list[ReplicaView]:
        """`StatusService.replicas`, each with the nodes of its shards that are not Ready (`silent_nodes`)."""
        views = await self.status.replicas(include_ended=include_ended)
        async with self.engine.connect() as conn:
            _, live = await self._fleet(conn)
        return [_with_silent(v, live) for v in views]

    async def remove_node(self, node_id: str, req: NodeRemoveRequest) -> NodeRemoveResponse:
        """Forget a node now. 404 naming the nodes there are; 409 `node_in_use` while replicas still have a
        shard on it, unless `force` (their replicas are marked lost and rebuilt elsewhere)."""
        async with self.engine.begin() as conn:
            rows, fleet_live = await self._fleet(conn)
            row = next((n for n in rows if n.id == node_id), None)
            if row is None:
                raise APIError(404, f"no node named {node_id!r}{did_you_mean(node_id, [n.id for n in rows])}; "
                               "`llmgw ctl nodes` lists them", param="node_id", code="not_found")
            status = fleet_live.status(node_id)
            live = [LiveReplicaView(id=s.replica_id, model=s.model, status=s.status)
                    for s in await fleet_repo.live_shards_on(conn, node_id)]
            revoked = await revocations_repo.node_revoked_since(conn, node_id)
            if revoked is not None:
                note = (f"node {node_id}'s certificates issued before {revoked.isoformat(timespec='seconds')} are "
                        "revoked: it cannot register again unless it is given a new one")
            elif status != "lost":
                note = (f"node {node_id} is {status} (heard from {row.age_s:.0f}s ago): its agent will register it "
                        f"again unless it is stopped or its certificate revoked (llmgw ctl cert revoke {node_id})")
            else:
                note = ""
            if live and not req.force and not req.dry_run:
                names = ", ".join(f"{r.id[:8]} ({r.model}, {r.status})" for r in live)
                raise APIError(
                    409, f"node {node_id} still has {len(live)} live replica(s): {names}; stop them first (remove "
                         "their models, or wait until the node is lost and they are rebuilt elsewhere), or pass "
                         "--force (force: true) to mark them lost and rebuild them elsewhere now",
                    param="force", code="node_in_use")
            removed = False if req.dry_run else await fleet_repo.remove_node(conn, node_id)
        if removed:
            await self.temporal.wake(f"node {node_id} removed")
        return NodeRemoveResponse(node_id=node_id, status=status, removed=removed, live_replicas=live, note=note)

    async def revoke(self, node_id: str, req: RevokeRequest) -> RevocationView:
        """Put `node_id`'s certificates (every one issued up to now, or the one with `req.serial`) on the
        deny-list; every node-API process refuses them within its `revocation_refresh_s`. 400 for a node
        id no certificate can have."""
        if not NODE_ID_RE.match(node_id):
            raise APIError(400, f"node id {node_id!r}: no certificate names it (letters, digits, '.', '_' and '-', "
                           "up to 63)", param="node_id")
        async with self.engine.begin() as conn:
            if req.serial is None:
                row = await revocations_repo.revoke_node(conn, node_id, req.reason)
            else:
                row = await revocations_repo.revoke_serial(conn, node_id, serial_text(req.serial), req.reason)
        return RevocationView(**row.__dict__)

    async def revocations(self) -> list[RevocationView]:
        async with self.engine.connect() as conn:
            return [RevocationView(**r.__dict__) for r in await revocations_repo.all_revocations(conn)]

    async def explain(self, model: str) -> dict:
        """The latest reconcile pass's lines about `model` (an alias or a LoRA adapter: its model), when that
        pass ran, the planner's own failure if it is failing, its last 10 replicas, and its adapters with the
        Ready replicas holding each and those whose node could not fetch or verify its file (issue 40). 404 for a name no model has."""
        async with self.engine.connect() as conn:
            catalog = await catalog_repo.get_catalog(conn)
            model = next((m.name for m in catalog.models if model in m.aliases or m.adapter(model)), model)
            lines, at = await catalog_repo.get_decisions_at(conn, model)
            rec = await reconciler_repo.get(conn)
            entry = catalog.get(model)
            held = await adapters_repo.held(conn) if entry is not None and entry.adapters else []
            bad = await adapters_repo.unverified(conn) if entry is not None and entry.adapters else []
        rows = await self.status.replicas(include_ended=True, model=model, limit=10)
        if lines is None and not rows:
            names = [n for m in catalog.models for n in (m.name, *m.aliases)]
            raise APIError(404, f"no model or alias named {model!r} in the catalog" + did_you_mean(model, names),
                           param="model", code="model_not_found")
        failing = None
        if rec is not None and rec.failure:  # the planner itself failed: no pass has decided since
            failing = {"failure": rec.failure, "failed_at": rec.failed_at, "attempt": rec.attempt,
                       "last_pass_at": rec.pass_at}
        adapters = [{"name": a.name, "version": a.version, "tenants": a.tenants,
                     "replicas": [{"id": h.replica_id, "loaded_at": h.loaded_at.isoformat(),
                                   "used_at": h.used_at.isoformat()} for h in held if h.adapter == a.name],
                     "unverified": [{"id": b.replica_id, "node": b.node_id, "error": b.error}
                                    for b in bad if b.adapter == a.name]}
                    for a in (entry.adapters if entry is not None else [])]
        return {"model": model, "decisions": lines or [], "decided_at": at, "reconciler_failure": failing,
                "replicas": [r.model_dump(mode="json") for r in rows], "adapters": adapters}


def _with_silent(v: ReplicaView, live: FleetLiveness) -> ReplicaView:
    """`v` with the nodes of its shards that are not Ready, as "node status" (`silent_nodes`)."""
    v.silent_nodes = sorted({f"{s.node_id} {live.status(s.node_id)}" for s in v.shards
                             if live.status(s.node_id) != "ready"})
    return v


def _read_age(n: fleet_repo.NodeRow) -> float | None:
    """Seconds since the control worker last read NODE's pollers, by the database clock its poll age is in."""
    if n.poll_read_at is None or n.polled_at is None or n.poll_age_s is None:
        return None
    return max(0.0, n.poll_age_s - (n.poll_read_at - n.polled_at).total_seconds())
