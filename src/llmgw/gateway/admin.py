"""The admin API (127.0.0.1:8081): catalog apply, models (with status; retry), replicas (with causes; engine logs),
nodes, explain, API keys, tenants and usage, reclaim. Used by `llmgw ctl`."""

from __future__ import annotations

from datetime import timedelta

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.catalog.loader import CatalogError, read_catalog
from llmgw.catalog.rules import apply_warnings
from llmgw.gateway.errors import APIError, http_exception_error, json_error, validation_error
from llmgw.gateway.jsonbody import BoundedJSON
from llmgw.gateway.mirror_check import mirror_warnings
from llmgw.db import catalog_repo, fleet_repo, reconciler_repo
from llmgw.gateway.status_service import StatusService
from llmgw.gateway.tenant_service import TenantService
from llmgw.placement.liveness import FleetLiveness, fleet_liveness
from llmgw.schemas.api import (
    ApplyRequest, ApplyResponse, KeyCreated, KeyCreateRequest, KeyView, LiveReplicaView, LogsView, ModelView,
    NodeRemoveRequest, NodeRemoveResponse, NodeView, ReplicaView, RetryResult,
)
from llmgw.schemas.tenants import LimitsChange, TenantCreate, TenantDeleted, TenantView, UsageReport
from llmgw.workflows import attributes
from llmgw.schemas.payloads import (
    LivenessFacts, NodeSnap, ReclaimInput, ReclaimResult, ReplicaSnap, ShardPlacement, Snapshot,
)
from llmgw.workflows.queues import CONTROL_QUEUE
from llmgw.security.admin_guard import AdminGuard
from llmgw.security.api_keys import ApiKeyService
from llmgw.spelling import did_you_mean
from llmgw.temporal import LazyClient


def create_admin_api(engine: AsyncEngine, temporal: LazyClient, unreachable_after_s: float, lost_after_s: float,
                     liveness: LivenessFacts | None = None, token: str | None = None, require_token: bool = False):
    """The admin API behind its guard (security/admin_guard.py): with `require_token`, every request
    must carry `Authorization: Bearer <token>`. `liveness` carries the liveness settings (poller grace,
    silent share) the planner uses too."""
    app = FastAPI(title="llmgw admin API", docs_url=None, redoc_url=None, openapi_url=None)
    facts = liveness or LivenessFacts()

    async def fleet(conn) -> tuple[list, FleetLiveness]:
        """Nodes and their liveness as the planner judges it (both witnesses, the blind observer)."""
        rows = await fleet_repo.list_nodes(conn)
        reps = await fleet_repo.active_replicas_with_shards(conn)
        seen = await fleet_repo.liveness_reads(conn, unreachable_after_s, facts.lost_teardown_window_s)
        snap = Snapshot(
            now=await fleet_repo.db_now(conn), unreachable_after_s=unreachable_after_s, lost_after_s=lost_after_s,
            liveness=facts.model_copy(update={
                "observer_since": seen.node_api_since, "pollers_since": seen.pollers_since,
                "doubted_at": seen.doubted_at}),
            nodes=[NodeSnap(id=n.id, status="ready", last_heartbeat=n.last_heartbeat, polled_at=n.polled_at,
                            left_at=n.left_at) for n in rows],
            replicas=[ReplicaSnap(id=r["id"], model=r["model"], profile=r["profile"], status=r["status"],
                                  shards=[ShardPlacement(node_id=s["node_id"], rank=s["rank"]) for s in shards])
                      for r, shards in reps])
        return rows, fleet_liveness(snap)
    status = StatusService(engine, temporal, temporal.settings.resolved_temporal_ui_url,
                           temporal.settings.temporal_namespace)

    @app.exception_handler(CatalogError)
    async def _catalog_error(request: Request, exc: CatalogError):
        return JSONResponse(status_code=400, content={"error": {"message": str(exc), "type": "invalid_request_error",
                                                                "param": "catalog", "code": "catalog_refused",
                                                                "problems": exc.problems}})

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return json_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Unknown routes and methods, and HTTPExceptions, in the same envelope as every other error."""
        return json_error(http_exception_error(request.method, request.url.path, exc.status_code, exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(exc.errors())

    @app.get("/admin/v1/catalog")
    async def get_catalog():
        async with engine.connect() as conn:
            return (await catalog_repo.get_catalog(conn)).model_dump(mode="json", exclude_defaults=True)

    @app.post("/admin/v1/catalog", response_model=ApplyResponse)
    async def apply(req: ApplyRequest) -> ApplyResponse:
        loaded = read_catalog(req.catalog)
        async with engine.begin() as conn:
            if req.dry_run:
                diff = await catalog_repo.diff_catalog(conn, loaded.catalog)
            else:
                diff = await catalog_repo.apply_catalog(conn, loaded.catalog)
        diff.notes = loaded.notes
        if not req.dry_run:
            await temporal.wake("catalog applied")  # before the warnings: they are advice, the catalog is in
        diff.warnings = apply_warnings(loaded.catalog, diff.removed) + await mirror_warnings(
            loaded.catalog, temporal.settings.resolved_mirror_url)
        return diff

    @app.get("/admin/v1/models", response_model=list[ModelView])
    async def models():
        """Every catalog model with its status (ready, loading, failing with restarts and backoff, ...)."""
        return await status.models()

    @app.post("/admin/v1/models/{model:path}/retry", response_model=RetryResult)
    async def retry(model: str):
        """Clear a failing model's backoff and failed-start count, so the reconciler starts it now."""
        return await status.retry(model)

    @app.get("/admin/v1/replicas", response_model=list[ReplicaView])
    async def replicas(all: bool = False):
        """Active replicas and the latest failed one of each failing model (`all`: every replica); each
        with the nodes of its shards that are not Ready (`silent_nodes`)."""
        views = await status.replicas(include_ended=all)
        async with engine.connect() as conn:
            _, live = await fleet(conn)
        return [_with_silent(v, live) for v in views]

    @app.get("/admin/v1/replicas/{ref}/logs", response_model=LogsView)
    async def logs(ref: str, rank: int = Query(0, ge=0, le=4096), offset: int = Query(-1, ge=-1),
                   limit: int = Query(65536, ge=1, le=1 << 20)):
        """A shard's engine log, read on its node: its tail (offset -1) or from `offset` (following)."""
        return await status.logs(ref, rank, offset, limit)

    @app.get("/admin/v1/nodes", response_model=list[NodeView])
    async def nodes():
        """Every node with its status and both witnesses: heartbeats (node API) and pollers (Temporal)."""
        async with engine.connect() as conn:
            rows, live = await fleet(conn)
        return [NodeView(id=n.id, status=live.status(n.id), last_heartbeat=n.last_heartbeat, inventory=n.inventory,
                         heartbeat_age_s=round(n.age_s, 1),
                         polled_at=n.polled_at, poll_age_s=None if n.poll_age_s is None else round(n.poll_age_s, 1),
                         liveness=live.nodes[n.id].describe(), notes=live.notes, registered_at=n.registered_at)
                for n in rows]

    @app.post("/admin/v1/nodes/{node_id}/remove", response_model=NodeRemoveResponse)
    async def remove_node(node_id: str, req: NodeRemoveRequest):
        """Forget a node now (a decommissioned machine), as the reconciler does once it has been Lost for
        `node_forget_after_s`. Refused while replicas still have a shard on it, unless `force`."""
        async with engine.begin() as conn:
            rows, fleet_live = await fleet(conn)
            row = next((n for n in rows if n.id == node_id), None)
            if row is None:
                return json_error(APIError(404, f"no node named {node_id!r}{did_you_mean(node_id, [n.id for n in rows])}; "
                                           "`llmgw ctl nodes` lists them", param="node_id", code="not_found"))
            status = fleet_live.status(node_id)
            live = [LiveReplicaView(id=s.replica_id, model=s.model, status=s.status)
                    for s in await fleet_repo.live_shards_on(conn, node_id)]
            note = (f"node {node_id} is {status} (heard from {row.age_s:.0f}s ago): unless its agent is stopped it "
                    "will register again" if status != "lost" else "")
            if live and not req.force and not req.dry_run:
                names = ", ".join(f"{r.id[:8]} ({r.model}, {r.status})" for r in live)
                return json_error(APIError(
                    409, f"node {node_id} still has {len(live)} live replica(s): {names}; stop them first (remove "
                         "their models, or wait until the node is lost and they are rebuilt elsewhere), or pass "
                         "--force (force: true) to mark them lost and rebuild them elsewhere now",
                    param="force", code="node_in_use"))
            removed = False if req.dry_run else await fleet_repo.remove_node(conn, node_id)
        if removed:
            await temporal.wake(f"node {node_id} removed")
        return NodeRemoveResponse(node_id=node_id, status=status, removed=removed, live_replicas=live, note=note)

    @app.post("/admin/v1/reclaim", response_model=ReclaimResult)
    async def reclaim(req: ReclaimInput) -> ReclaimResult:
        """Run a ReclaimWorkflow and return its result: list by default, delete with `collect`."""
        if temporal.client is None:
            raise HTTPException(503, "Temporal is not reachable yet; retry in a moment")
        import uuid

        registered = await temporal.attributes.registered(temporal.client)
        return await temporal.client.execute_workflow(
            "ReclaimWorkflow", req, id=f"reclaim/{uuid.uuid4().hex[:12]}", task_queue=CONTROL_QUEUE,
            result_type=ReclaimResult, execution_timeout=timedelta(minutes=10),
            search_attributes=attributes.lifecycle("reclaim") if registered else None)

    @app.get("/admin/v1/explain/{model:path}")
    async def explain(model: str):
        """The latest reconcile pass's lines about `model` (every candidate turned down, and why), when
        that pass ran, and why each of its replicas is where it is (or why it stopped)."""
        async with engine.connect() as conn:
            catalog = await catalog_repo.get_catalog(conn)
            model = next((m.name for m in catalog.models if model in m.aliases), model)  # an alias: its model
            lines, at = await catalog_repo.get_decisions_at(conn, model)
            rec = await reconciler_repo.get(conn)
        rows = await status.replicas(include_ended=True, model=model, limit=10)
        if lines is None and not rows:
            names = [n for m in catalog.models for n in (m.name, *m.aliases)]
            return json_error(APIError(404, f"no model or alias named {model!r} in the catalog"
                                       + did_you_mean(model, names), param="model", code="model_not_found"))
        failing = None
        if rec is not None and rec.failure:  # the planner itself failed: no pass has decided since
            failing = {"failure": rec.failure, "failed_at": rec.failed_at, "attempt": rec.attempt,
                       "last_pass_at": rec.pass_at}
        return {"model": model, "decisions": lines or [], "decided_at": at, "reconciler_failure": failing,
                "replicas": [r.model_dump(mode="json") for r in rows]}

    keys = ApiKeyService(engine)

    @app.get("/admin/v1/keys", response_model=list[KeyView])
    async def list_keys():
        return [KeyView(**k) for k in await keys.list()]

    @app.post("/admin/v1/keys", response_model=KeyCreated)
    async def create_key(req: KeyCreateRequest) -> KeyCreated:
        key, row = await keys.create(req.name, req.tenant, req.limits.stored())
        return KeyCreated(**row, key=key)

    @app.post("/admin/v1/keys/{key_id}", response_model=KeyView)
    async def set_key(key_id: str, req: LimitsChange):
        """Change a key's own limits: only the fields given; null removes one."""
        row = await keys.set_limits(key_id, req.limits)
        if row is None:
            return json_error(APIError(404, f"no API key with id {key_id[:40]!r}", param="id", code="not_found"))
        return KeyView(**row)

    tenant_service = TenantService(engine)

    @app.get("/admin/v1/tenants", response_model=list[TenantView])
    async def list_tenants():
        return await tenant_service.list()

    @app.post("/admin/v1/tenants", response_model=TenantView)
    async def create_tenant(req: TenantCreate) -> TenantView:
        return await tenant_service.create(req)

    @app.post("/admin/v1/tenants/{name}", response_model=TenantView)
    async def set_tenant(name: str, req: LimitsChange) -> TenantView:
        """Change a tenant's limits: only the fields given; null removes one."""
        return await tenant_service.set(name, req.limits)

    @app.delete("/admin/v1/tenants/{name}", response_model=TenantDeleted)
    async def delete_tenant(name: str, revoke_keys: bool = False) -> TenantDeleted:
        """Delete a tenant (409 while it has active keys, unless `revoke_keys`); its usage stays."""
        return await tenant_service.delete(name, revoke_keys)

    @app.get("/admin/v1/usage", response_model=UsageReport)
    async def usage(tenant: str | None = Query(None, max_length=200), since: str = Query("7d", max_length=40),
                    by: str = Query("tenant", max_length=40)) -> UsageReport:
        """Token use per tenant, and per model, key or UTC day (`by`), over the last `since` (30m, 24h, 7d)."""
        return await tenant_service.usage(tenant, since, by)

    @app.post("/admin/v1/keys/{key_id}/revoke", response_model=KeyView)
    async def revoke_key(key_id: str):
        row = await keys.revoke(key_id)
        if row is None:
            return json_error(APIError(404, f"no API key with id {key_id!r}", param="id", code="not_found"))
        return KeyView(**row)

    return AdminGuard(BoundedJSON(app), token, require_token)


def _with_silent(v: ReplicaView, live: FleetLiveness) -> ReplicaView:
    """`v` with the nodes of its shards that are not Ready, as "node status" (`silent_nodes`)."""
    v.silent_nodes = sorted({f"{s.node_id} {live.status(s.node_id)}" for s in v.shards
                             if live.status(s.node_id) != "ready"})
    return v
