"""Tenants (issue 15). All SQL for them lives here; their limits are `schemas.tenants.Limits` as JSON."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import api_keys, tenants


@dataclass(frozen=True)
class TenantRow:
    name: str
    limits: dict
    keys: int  # active keys
    created_at: datetime
    updated_at: datetime


def _listed():
    active = (select(func.count()).select_from(api_keys)
              .where(and_(api_keys.c.tenant == tenants.c.name, api_keys.c.revoked_at.is_(None)))
              .scalar_subquery())
    return select(tenants.c.name, tenants.c.limits, active.label("keys"), tenants.c.created_at, tenants.c.updated_at)


@dataclass(frozen=True)
class TenantKey:
    """An active key of a tenant, as a refused delete names it."""

    id: str
    name: str


def _row(r) -> TenantRow:
    return TenantRow(r.name, r.limits or {}, int(r.keys), r.created_at, r.updated_at)


async def create_tenant(conn: AsyncConnection, name: str, limits: dict) -> TenantRow | None:
    """Insert a tenant; None when one of that name exists."""
    done = (await conn.execute(insert(tenants).values(name=name, limits=limits)
                               .on_conflict_do_nothing(index_elements=[tenants.c.name])
                               .returning(tenants.c.name))).first()
    return await get_tenant(conn, name) if done else None


async def get_tenant(conn: AsyncConnection, name: str) -> TenantRow | None:
    r = (await conn.execute(_listed().where(tenants.c.name == name))).first()
    return _row(r) if r else None


async def tenant_exists(conn: AsyncConnection, name: str) -> bool:
    """Whether tenant `name` exists, holding it (FOR KEY SHARE) until the transaction ends: a key created
    for it in this transaction and a concurrent `delete_tenant` wait on each other, never both go ahead."""
    return (await conn.execute(select(tenants.c.name).where(tenants.c.name == name).with_for_update(key_share=True))
            ).first() is not None


async def delete_tenant(conn: AsyncConnection, name: str, revoke_keys: bool) -> tuple[bool, list[TenantKey]]:
    """Delete tenant `name`: (whether it existed, its active keys). With active keys and not
    `revoke_keys` nothing is changed; else its active keys are revoked, every key of it keeps no tenant
    (a revoked key lists as one of no tenant), and the tenant goes. Its usage rows stay (`ctl usage`)."""
    if (await conn.execute(select(tenants.c.name).where(tenants.c.name == name).with_for_update())).first() is None:
        return False, []
    active = [TenantKey(r.id, r.name) for r in (await conn.execute(
        select(api_keys.c.id, api_keys.c.name).where(and_(api_keys.c.tenant == name, api_keys.c.revoked_at.is_(None)))
        .order_by(api_keys.c.created_at, api_keys.c.id))).all()]
    if active and not revoke_keys:
        return True, active
    await conn.execute(update(api_keys).where(and_(api_keys.c.tenant == name, api_keys.c.revoked_at.is_(None)))
                       .values(revoked_at=func.now()))
    await conn.execute(update(api_keys).where(api_keys.c.tenant == name).values(tenant=None))
    await conn.execute(delete(tenants).where(tenants.c.name == name))
    return True, active


async def list_tenants(conn: AsyncConnection) -> list[TenantRow]:
    return [_row(r) for r in (await conn.execute(_listed().order_by(tenants.c.name))).all()]


async def count_tenants(conn: AsyncConnection) -> int:
    return int((await conn.execute(select(func.count()).select_from(tenants))).scalar_one())


async def set_limits(conn: AsyncConnection, name: str, limits: dict) -> TenantRow | None:
    """Replace a tenant's limits; None when there is no such tenant."""
    await conn.execute(update(tenants).where(tenants.c.name == name).values(limits=limits, updated_at=func.now()))
    return await get_tenant(conn, name)


async def all_limits(conn: AsyncConnection) -> dict[str, dict]:
    """Tenant name -> its limits, for the gateway."""
    return {r.name: r.limits or {} for r in (await conn.execute(select(tenants.c.name, tenants.c.limits))).all()}
