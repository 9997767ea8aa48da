"""Tenants and usage for the admin API (issue 15): create, list and change tenants; report usage.

Routes call this service; the SQL is in db/tenants_repo.py and db/usage_repo.py; what is a valid name or
limit is in schemas/tenants.py. Every refusal is a 4xx naming the field: 400 for a bad value, 404 for no
such tenant, 409 for a tenant that exists or one past `MAX_TENANTS`.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import catalog_repo, keys_repo, tenants_repo, usage_repo
from llmgw.http.errors import APIError
from llmgw.schemas.tenants import NO_TENANT, model_allowed
from llmgw.schemas.catalog import Catalog
from llmgw.schemas.tenants import (
    MAX_TENANTS, USAGE_BY, Limits, TenantCreate, TenantDeleted, TenantView, UsageReport, UsageRow, tenant_name_problem,
)
from llmgw.spelling import did_you_mean

_SINCE = re.compile(r"([1-9][0-9]{0,5})(m|h|d)")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400}
MAX_SINCE_S = 400 * 86400


def parse_since(text: str) -> float:
    """`30m`, `24h`, `7d` -> seconds; a 400 naming `since` otherwise (at most 400 days)."""
    m = _SINCE.fullmatch(text or "")
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)] if m else None
    if seconds is None or seconds > MAX_SINCE_S:
        raise APIError(400, f"`since` is a duration such as 30m, 24h or 7d, at most 400d (got {text[:40]!r})",
                       param="since")
    return float(seconds)


def check_tenant_name(name: str, param: str = "tenant") -> None:
    why = tenant_name_problem(name)
    if why:
        raise APIError(400, why, param=param)


def unmatched(limits: Limits, catalog: Catalog) -> list[str]:
    """Notes on the patterns of `limits` that match no model (name or alias) of `catalog` now."""
    return [f"models: {p!r} matches no model of the catalog now" for p in limits.models or []
            if not any(model_allowed([p], m) for m in catalog.models)]


def _view(row: tenants_repo.TenantRow, notes: list[str] | None = None) -> TenantView:
    notes = list(notes or [])
    try:
        limits = Limits.model_validate(row.limits)
    except ValidationError as exc:  # written around the admin API: listed, as the gateways treat it
        limits = Limits()
        notes.append(f"its stored limits are not valid and are not enforced ({exc.errors()[0]['msg']}); "
                     f"`llmgw ctl tenants set {row.name}` with each limit replaces them")
    return TenantView(name=row.name, limits=limits, keys=row.keys, created_at=row.created_at,
                      updated_at=row.updated_at, notes=notes)


class TenantService:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def create(self, req: TenantCreate) -> TenantView:
        async with self.engine.begin() as conn:
            if await tenants_repo.count_tenants(conn) >= MAX_TENANTS:
                raise APIError(409, f"there are {MAX_TENANTS} tenants already, the most a gateway holds",
                               param="name", code="too_many_tenants")
            row = await tenants_repo.create_tenant(conn, req.name, req.limits.stored())
            if row is None:
                raise APIError(409, f"a tenant named {req.name!r} exists; `llmgw ctl tenants set {req.name}` changes "
                               "its limits", param="name", code="tenant_exists")
            catalog = await catalog_repo.get_catalog(conn)
        return _view(row, unmatched(req.limits, catalog))

    async def list(self) -> list[TenantView]:
        async with self.engine.connect() as conn:
            return [_view(r) for r in await tenants_repo.list_tenants(conn)]

    async def set(self, name: str, change: Limits) -> TenantView:
        """Change the fields of the tenant's limits that `change` was given (null removes one)."""
        check_tenant_name(name, "name")
        async with self.engine.begin() as conn:
            row = await tenants_repo.get_tenant(conn, name)
            if row is None:
                raise APIError(404, f"no tenant named {name!r}; `llmgw ctl tenants list` shows them", param="name",
                               code="not_found")
            try:
                limits = Limits.model_validate(row.limits).updated(change)
            except ValidationError:  # stored around the admin API, and not enforced: what is given replaces it
                limits = Limits().updated(change)
            row = await tenants_repo.set_limits(conn, name, limits.stored())
            catalog = await catalog_repo.get_catalog(conn)
        assert row is not None
        return _view(row, unmatched(limits, catalog))

    async def delete(self, name: str, revoke_keys: bool) -> TenantDeleted:
        """Delete a tenant: 409 `tenant_has_keys` naming them while it has active keys, unless
        `revoke_keys`, which revokes them in the same transaction (every gateway hears it through NOTIFY)."""
        check_tenant_name(name, "name")
        async with self.engine.begin() as conn:
            found, active = await tenants_repo.delete_tenant(conn, name, revoke_keys)
            if not found:
                known = [r.name for r in await tenants_repo.list_tenants(conn)]
                raise APIError(404, f"no tenant named {name!r}{did_you_mean(name, known)}; `llmgw ctl tenants list` "
                               "shows them", param="name", code="not_found")
        if active and not revoke_keys:
            shown = ", ".join(f"{k.id} ({k.name})" if k.name else k.id for k in active[:10])
            more = f" and {len(active) - 10} more" if len(active) > 10 else ""
            raise APIError(409, f"tenant {name!r} has {len(active)} active key(s): {shown}{more}; revoke them "
                           f"(`llmgw ctl keys revoke ID`), or `llmgw ctl tenants delete {name} --revoke-keys` revokes "
                           "them with it", param="name", code="tenant_has_keys")
        return TenantDeleted(name=name, revoked=[k.id for k in active])

    async def usage(self, tenant: str | None, since: str, by: str) -> UsageReport:
        """Use over the last `since` (`7d`), per tenant and per `by` (tenant, model, key, day)."""
        if by not in USAGE_BY:
            raise APIError(400, f"`by` is one of {', '.join(USAGE_BY)} (got {by[:40]!r})", param="by")
        if tenant is not None and tenant != NO_TENANT:
            check_tenant_name(tenant)
        seconds = parse_since(since)
        async with self.engine.connect() as conn:
            now = await usage_repo.db_now(conn)
            rows = await usage_repo.report(conn, now - seconds, by,
                                           None if tenant is None else "" if tenant == NO_TENANT else tenant)
            names = {k.id: k.name for k in await keys_repo.list_keys(conn)} if by == "key" else {}
            if not rows and tenant not in (None, NO_TENANT) and await tenants_repo.get_tenant(conn, tenant) is None:
                known = [r.name for r in await tenants_repo.list_tenants(conn)]
                raise APIError(404, f"no tenant named {tenant!r}{did_you_mean(tenant, known)}; `llmgw ctl tenants "
                               "list` shows them", param="tenant", code="not_found")
        out = []
        for r in rows:
            g = r.group
            out.append(UsageRow(
                tenant=r.tenant or NO_TENANT, model=g if by == "model" else None, key_id=g if by == "key" else None,
                key_name=names.get(g) if by == "key" else None, day=g if by == "day" else None,
                requests=r.requests, prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens,
                total_tokens=r.prompt_tokens + r.completion_tokens, last_at=r.last_at))
        return UsageReport(since=datetime.fromtimestamp(now - seconds, timezone.utc),
                           until=datetime.fromtimestamp(now, timezone.utc), by=by, tenant=tenant, rows=out)
