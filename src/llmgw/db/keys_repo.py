"""Gateway API keys. All SQL for them lives here; only hashes are stored (llmgw.security.api_keys)."""

from __future__ import annotations

from sqlalchemy import and_, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import api_keys


async def create_key(conn: AsyncConnection, key_id: str, name: str, prefix: str, key_hash: str) -> dict:
    """Insert a key; returns its row (without the hash)."""
    row = (await conn.execute(
        api_keys.insert().values(id=key_id, name=name, prefix=prefix, key_hash=key_hash)
        .returning(api_keys.c.id, api_keys.c.name, api_keys.c.prefix, api_keys.c.created_at, api_keys.c.revoked_at)
    )).mappings().one()
    return dict(row)


async def list_keys(conn: AsyncConnection) -> list[dict]:
    """Every key ever created, revoked ones included, oldest first (without hashes)."""
    q = select(api_keys.c.id, api_keys.c.name, api_keys.c.prefix, api_keys.c.created_at, api_keys.c.revoked_at)
    return [dict(r) for r in (await conn.execute(q.order_by(api_keys.c.created_at, api_keys.c.id))).mappings().all()]


async def revoke_key(conn: AsyncConnection, key_id: str) -> dict | None:
    """Mark a key revoked (idempotent). Returns its row, or None when no key has that id."""
    await conn.execute(update(api_keys).where(and_(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None)))
                       .values(revoked_at=func.now()))
    row = (await conn.execute(
        select(api_keys.c.id, api_keys.c.name, api_keys.c.prefix, api_keys.c.created_at, api_keys.c.revoked_at)
        .where(api_keys.c.id == key_id))).mappings().first()
    return dict(row) if row else None


async def key_hashes(conn: AsyncConnection) -> tuple[frozenset[str], int]:
    """(hashes of the keys that are not revoked, how many keys were ever created)."""
    active = (await conn.execute(select(api_keys.c.key_hash).where(api_keys.c.revoked_at.is_(None)))).scalars().all()
    total = (await conn.execute(select(func.count()).select_from(api_keys))).scalar_one()
    return frozenset(active), int(total)
