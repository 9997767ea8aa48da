"""The reconciler's own row (`reconciler_state`, id 1): what `llmgw ctl explain` says about the reconciler
itself, and the full reasons of the placements its latest pass decided."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import reconciler_state as rs


@dataclass
class ReconcilerRow:
    pass_at: datetime | None
    failed_at: datetime | None
    failure: str | None
    attempt: int | None


async def record_pass(conn: AsyncConnection, placements: dict[str, str]) -> None:
    """A pass succeeded: clear any failure, keep `placements` (replica id -> reason) for record_placement."""
    values = {"pass_at": func.now(), "failed_at": None, "failure": None, "attempt": None, "placements": placements}
    await conn.execute(insert(rs).values(id=1, **values).on_conflict_do_update(index_elements=[rs.c.id], set_=values))


async def record_failure(conn: AsyncConnection, failure: str, attempt: int) -> None:
    """The planner failed on attempt `attempt` of a pass (it is retried with a newer snapshot)."""
    values = {"failed_at": func.now(), "failure": failure[:2000], "attempt": attempt}
    await conn.execute(insert(rs).values(id=1, **values).on_conflict_do_update(index_elements=[rs.c.id], set_=values))


async def placement_reason(conn: AsyncConnection, replica_id: str) -> str | None:
    """The full reason the latest pass gave for placing `replica_id` (None if that pass did not place it)."""
    return (await conn.execute(select(rs.c.placements[replica_id].astext).where(rs.c.id == 1))).scalar_one_or_none()


async def get(conn: AsyncConnection) -> ReconcilerRow | None:
    row = (await conn.execute(select(rs.c.pass_at, rs.c.failed_at, rs.c.failure, rs.c.attempt).where(rs.c.id == 1))).first()
    return ReconcilerRow(row.pass_at, row.failed_at, row.failure, row.attempt) if row else None
