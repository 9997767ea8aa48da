"""Results of control activities stored with their effects (control/idempotent.py): all their SQL."""

from __future__ import annotations

import random
from datetime import timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import activity_results

KEEP = timedelta(days=7)  # far longer than any retry of a control activity


async def get_result(conn: AsyncConnection, key: str) -> tuple[bool, dict | None]:
    """(True, the stored JSON result) when an activity committed under `key`, else (False, None)."""
    row = (await conn.execute(select(activity_results.c.result).where(activity_results.c.key == key))).first()
    return (False, None) if row is None else (True, row.result)


async def put_result(conn: AsyncConnection, key: str, activity: str, result: dict | None) -> None:
    """Store a result under `key` in the caller's transaction; a second insert of the same key conflicts
    (the racing attempt's transaction rolls back). Now and then, rows older than `KEEP` go."""
    await conn.execute(insert(activity_results).values(key=key, activity=activity, result=result))
    if random.random() < 0.01:  # keep the table small without a job of its own
        await conn.execute(delete(activity_results).where(activity_results.c.created_at < func.now() - KEEP))
