"""The admin API (127.0.0.1:8081): catalog apply, models (with status; retry), replicas (with causes; engine logs),
nodes, explain, API keys, tenants and usage, reclaim. Used by `llmgw ctl`."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.catalog.loader import CatalogError
from llmgw.control.admin_guard import AdminGuard
from llmgw.control.catalog_service import CatalogService
from llmgw.control.codec_api import mount_codec
from llmgw.control.fleet_admin import FleetAdmin
from llmgw.control.key_service import ApiKeyService
from llmgw.control.status_service import StatusService
from llmgw.control.tenant_service import TenantService
from llmgw.http.errors import APIError, install_error_handlers
from llmgw.http.jsonbody import BoundedJSON
from llmgw.schemas.api import (
    FLEET_PAGE, ApplyRequest, ApplyResponse, KeyCreated, KeyCreateRequest, KeyView, LogsView, ModelView,
    NodeRemoveRequest, NodeRemoveResponse, NodeView, ReplicaView, RetryResult, RevocationView, RevokeRequest,
)
from llmgw.schemas.payloads import LivenessFacts, ReclaimInput, ReclaimResult
from llmgw.schemas.tenants import LimitsChange, TenantCreate, TenantDeleted, TenantView, UsageReport
from llmgw.temporal import LazyClient, payload_codec


STATIC = Path(__file__).parent / "static"
# The page runs only its own inline script, talks only to this listener, and is framed by no other page.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                           "connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
                "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}


def create_admin_api(engine: AsyncEngine, temporal: LazyClient, unreachable_after_s: float, lost_after_s: float,
                     liveness: LivenessFacts | None = None, token: str | None = None,
                     metrics: Callable[[], bytes] | None = None):
    """The admin API behind its guard (control/admin_guard.py): every request must carry
    `Authorization: Bearer <token>`, wherever it listens (issue 36: on loopback it had been optional, and
    any local user of a shared GPU box could administer the fleet). `liveness` carries the liveness
    settings (poller grace, silent share) the planner uses too. `metrics`: the page of tenant-labelled
    series served at `/metrics`."""
    app = FastAPI(title="llmgw admin API", docs_url=None, redoc_url=None, openapi_url=None)
    status = StatusService(engine, temporal, temporal.settings.resolved_temporal_ui_url,
                           temporal.settings.temporal_namespace)
    fleet = FleetAdmin(engine, temporal, status, unreachable_after_s, lost_after_s, liveness or LivenessFacts())
    catalog = CatalogService(engine, temporal)
    keys = ApiKeyService(engine)
    tenant_service = TenantService(engine)

    install_error_handlers(app, "the admin API")
    mount_codec(app, payload_codec(temporal.settings))

    @app.exception_handler(CatalogError)
    async def _catalog_error(request: Request, exc: CatalogError):
        return JSONResponse(status_code=400, content={"error": {"message": str(exc), "type": "invalid_request_error",
                                                                "param": "catalog", "code": "catalog_refused",
                                                                "problems": exc.problems}})

    @app.get(FLEET_PAGE)
    async def fleet_page():
        """The fleet page: static, read-only, holding no data; it asks for the token and reads the admin API
        with it like `ctl` (control/static/fleet.html)."""
        return Response((STATIC / "fleet.html").read_bytes(), media_type="text/html; charset=utf-8",
                        headers=PAGE_HEADERS)

    @app.get("/metrics")
    async def tenant_metrics():
        """Series that name tenants (telemetry.py `GatewayMetrics.render_tenants`): never on the public port."""
        return Response(metrics() if metrics is not None else b"", media_type="text/plain; version=0.0.4")

    @app.get("/admin/v1/catalog")
    async def get_catalog():
        return await catalog.get()

    @app.post("/admin/v1/catalog", response_model=ApplyResponse)
    async def apply(req: ApplyRequest) -> ApplyResponse:
        return await catalog.apply(req)

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
        return await fleet.replicas(include_ended=all)

    @app.get("/admin/v1/replicas/{ref}/logs", response_model=LogsView)
    async def logs(ref: str, rank: int = Query(0, ge=0, le=4096), offset: int = Query(-1, ge=-1),
                   limit: int = Query(65536, ge=1, le=1 << 20)):
        """A shard's engine log, read on its node: its tail (offset -1) or from `offset` (following)."""
        return await status.logs(ref, rank, offset, limit)

    @app.get("/admin/v1/nodes", response_model=list[NodeView])
    async def nodes():
        """Every node with its status and both witnesses: heartbeats (node API) and pollers (Temporal)."""
        return await fleet.nodes()

    @app.post("/admin/v1/nodes/{node_id}/remove", response_model=NodeRemoveResponse)
    async def remove_node(node_id: str, req: NodeRemoveRequest):
        """Forget a node now (a decommissioned machine), as the reconciler does once it has been Lost for
        `node_forget_after_s`. Refused while replicas still have a shard on it, unless `force`."""
        return await fleet.remove_node(node_id, req)

    @app.post("/admin/v1/nodes/{node_id}/revoke", response_model=RevocationView)
    async def revoke(node_id: str, req: RevokeRequest):
        """Revoke a node's certificates: every one issued up to now, or the one with `serial`. Every node-API
        process refuses them within `revocation_refresh_s` (403 `certificate_revoked`)."""
        return await fleet.revoke(node_id, req)

    @app.get("/admin/v1/revocations", response_model=list[RevocationView])
    async def revocations():
        """The deny-list of node certificates, oldest first."""
        return await fleet.revocations()

    @app.post("/admin/v1/reclaim", response_model=ReclaimResult)
    async def reclaim(req: ReclaimInput) -> ReclaimResult:
        """Run a ReclaimWorkflow and return its result: list by default, delete with `collect`."""
        return await catalog.reclaim(req)

    @app.get("/admin/v1/explain/{model:path}")
    async def explain(model: str):
        """The latest reconcile pass's lines about `model` (every candidate turned down, and why), when
        that pass ran, and why each of its replicas is where it is (or why it stopped)."""
        return await fleet.explain(model)

    @app.get("/admin/v1/keys", response_model=list[KeyView])
    async def list_keys():
        return [KeyView(**asdict(k)) for k in await keys.list()]

    @app.post("/admin/v1/keys", response_model=KeyCreated)
    async def create_key(req: KeyCreateRequest) -> KeyCreated:
        key, row = await keys.create(req.name, req.tenant, req.limits.stored())
        return KeyCreated(**asdict(row), key=key)

    @app.post("/admin/v1/keys/{key_id}", response_model=KeyView)
    async def set_key(key_id: str, req: LimitsChange):
        """Change a key's own limits: only the fields given; null removes one."""
        row = await keys.set_limits(key_id, req.limits)
        if row is None:
            raise APIError(404, f"no API key with id {key_id[:40]!r}", param="id", code="not_found")
        return KeyView(**asdict(row))

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
            raise APIError(404, f"no API key with id {key_id!r}", param="id", code="not_found")
        return KeyView(**asdict(row))

    return AdminGuard(BoundedJSON(app), token)

