"""Tenants (issue 15). All SQL for them lives here; their limits are `schemas.tenants.Limits` as JSON."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, func, select, update
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
