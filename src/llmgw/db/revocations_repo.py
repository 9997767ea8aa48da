"""The deny-list of node certificates (`node_cert_revocations`, migration 0012): every SQL about it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import node_cert_revocations as rev


@dataclass(frozen=True)
class Revocation:
    """One row: `serial` (one certificate) or `issued_before` (every certificate of `node_id` issued up to then)."""

    node_id: str
    serial: str | None
    issued_before: datetime | None
    reason: str
    revoked_at: datetime


def _row(r) -> Revocation:
    return Revocation(r.node_id, r.serial, r.issued_before, r.reason, r.revoked_at)


async def revoke_node(conn: AsyncConnection, node_id: str, reason: str) -> Revocation:
    """Refuse every certificate of `node_id` issued up to now (the database clock)."""
    r = (await conn.execute(rev.insert().values(node_id=node_id, issued_before=func.now(), reason=reason)
                            .returning(rev))).one()
    return _row(r)


async def revoke_serial(conn: AsyncConnection, node_id: str, serial: str, reason: str) -> Revocation:
    """Refuse the certificate with `serial` (lower-case hex); revoking it again changes nothing."""
    await conn.execute(insert(rev).values(node_id=node_id, serial=serial, reason=reason)
                       .on_conflict_do_nothing(index_elements=[rev.c.serial]))
    return _row((await conn.execute(select(rev).where(rev.c.serial == serial))).one())


async def all_revocations(conn: AsyncConnection) -> list[Revocation]:
    """Every row, oldest first (a fleet's revocations are few: read whole by each node-API process)."""
    return [_row(r) for r in (await conn.execute(select(rev).order_by(rev.c.id))).all()]


async def node_revoked_since(conn: AsyncConnection, node_id: str) -> datetime | None:
    """The latest "every certificate of `node_id` issued before" cutoff, or None."""
    return (await conn.execute(select(func.max(rev.c.issued_before)).where(rev.c.node_id == node_id))).scalar_one()
