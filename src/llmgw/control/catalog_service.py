"""The catalog for the admin API: read it, apply it (or show what applying would change), and reclaim
node caches of what it no longer wants."""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.catalog.loader import CatalogError, read_catalog
from llmgw.catalog.rules import apply_warnings
from llmgw.control.mirror_check import mirror_findings, mirror_names
from llmgw.db import catalog_repo
from llmgw.http.errors import APIError
from llmgw.schemas.api import ApplyRequest, ApplyResponse
from llmgw.schemas.payloads import ReclaimInput, ReclaimResult
from llmgw.temporal import LazyClient
from llmgw.workflows import attributes
from llmgw.workflows.ids import reclaim_id
from llmgw.workflows.queues import CONTROL_QUEUE


class CatalogService:
    def __init__(self, engine: AsyncEngine, temporal: LazyClient):
        self.engine = engine
        self.temporal = temporal

    async def get(self) -> dict:
        async with self.engine.connect() as conn:
            return (await catalog_repo.get_catalog(conn)).model_dump(mode="json", exclude_defaults=True)

    async def apply(self, req: ApplyRequest) -> ApplyResponse:
        """The diff against the stored catalog, applied unless `dry_run`. Raises `CatalogError` (400
        `catalog_refused` with every problem) for a catalog the rules refuse; nothing is written then."""
        loaded = read_catalog(req.catalog)
        findings = await mirror_findings(loaded.catalog, self.temporal.settings.resolved_mirror_url)
        async with self.engine.begin() as conn:
            named = mirror_names(await catalog_repo.get_catalog(conn))  # a missing one named before: a note
            refused = [f for f in findings if f.name is not None and f.name not in named]
            if refused:
                raise CatalogError([f.refusal() for f in refused])
            if req.dry_run:
                diff = await catalog_repo.diff_catalog(conn, loaded.catalog)
            else:
                diff = await catalog_repo.apply_catalog(conn, loaded.catalog)
        diff.notes = loaded.notes
        if not req.dry_run:
            await self.temporal.wake("catalog applied")  # before the warnings: they are advice, the catalog is in
        diff.warnings = apply_warnings(loaded.catalog, diff.removed) + [f.warning() for f in findings]
        return diff

    async def reclaim(self, req: ReclaimInput) -> ReclaimResult:
        """Run a ReclaimWorkflow and return its result: list by default, delete with `collect`."""
        if self.temporal.client is None:
            raise APIError(503, "Temporal is not reachable yet; retry in a moment", type="service_unavailable")
        registered = await self.temporal.attributes.registered(self.temporal.client)
        return await self.temporal.client.execute_workflow(
            "ReclaimWorkflow", req, id=reclaim_id(uuid.uuid4().hex[:12]), task_queue=CONTROL_QUEUE,
            result_type=ReclaimResult, execution_timeout=timedelta(minutes=10),
            search_attributes=attributes.lifecycle("reclaim") if registered else None)
