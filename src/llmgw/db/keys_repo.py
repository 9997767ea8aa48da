"""Gateway API keys. All SQL for them lives here; only hashes are stored (llmgw.security.api_keys)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import api_keys

_LISTED = (api_keys.c.id, api_keys.c.name, api_keys.c.prefix, api_keys.c.created_at, api_keys.c.revoked_at,
           api_keys.c.tenant, api_keys.c.limits)


@dataclass(frozen=True)
class KeyRow:
    """A key as listed: never its hash; `prefix` is its first characters; `limits` its own (`Limits` as JSON)."""

    id: str
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    tenant: str | None
    limits: dict


def _key(r) -> KeyRow:
    return KeyRow(r.id, r.name, r.prefix, r.created_at, r.revoked_at, r.tenant, r.limits)


@dataclass(frozen=True)
class ActiveKey:
    """A key the gateway accepts: its hash, its tenant (None: none) and its own limits (`Limits` as JSON)."""

    id: str
    key_hash: str
    tenant: str | None
    limits: dict


async def create_key(conn: AsyncConnection, key_id: str, name: str, prefix: str, key_hash: str,
                     tenant: str | None = None, limits: dict | None = None) -> KeyRow:
    """Insert a key; returns its row (without the hash)."""
    row = (await conn.execute(
        api_keys.insert().values(id=key_id, name=name, prefix=prefix, key_hash=key_hash, tenant=tenant,
                                 limits=limits or {})
        .returning(*_LISTED)
    )).one()
    return _key(row)


async def list_keys(conn: AsyncConnection) -> list[KeyRow]:
    """Every key ever created, revoked ones included, oldest first (without hashes)."""
    q = select(*_LISTED)
    return [_key(r) for r in (await conn.execute(q.order_by(api_keys.c.created_at, api_keys.c.id))).all()]


async def get_key(conn: AsyncConnection, key_id: str) -> KeyRow | None:
    row = (await conn.execute(select(*_LISTED).where(api_keys.c.id == key_id))).first()
    return _key(row) if row else None


async def revoke_key(conn: AsyncConnection, key_id: str) -> KeyRow | None:
    """Mark a key revoked (idempotent). Returns its row, or None when no key has that id."""
    await conn.execute(update(api_keys).where(and_(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None)))
                       .values(revoked_at=func.now()))
    return await get_key(conn, key_id)


async def set_limits(conn: AsyncConnection, key_id: str, limits: dict) -> KeyRow | None:
    """Replace a key's own limits. Returns its row, or None when no key has that id."""
    await conn.execute(update(api_keys).where(api_keys.c.id == key_id).values(limits=limits))
    return await get_key(conn, key_id)


async def active_keys(conn: AsyncConnection) -> tuple[list[ActiveKey], int]:
    """(the keys that are not revoked, how many keys were ever created)."""
    rows = (await conn.execute(select(api_keys.c.id, api_keys.c.key_hash, api_keys.c.tenant, api_keys.c.limits)
                               .where(api_keys.c.revoked_at.is_(None)))).all()
    total = (await conn.execute(select(func.count()).select_from(api_keys))).scalar_one()
    return [ActiveKey(r.id, r.key_hash, r.tenant, r.limits or {}) for r in rows], int(total)
