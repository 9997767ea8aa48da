"""Per-model load reported by gateways (autoscaling). All SQL for `gateway_load` lives here.

Each gateway upserts one row per model it has seen load for, every second, and deletes its rows for models
whose load fell to zero; a gateway that dies stops refreshing, and its rows stop counting after
`LOAD_FRESH_S` (they are deleted after `LOAD_FORGET_S`). The snapshot reads the sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import gateway_load

LOAD_FRESH_S = 10.0  # rows older than this are a dead (or partitioned) gateway's: not counted
LOAD_FORGET_S = 3600.0  # ... and after this they are deleted


@dataclass
class ModelLoad:
    """One gateway's load for one model, as it reports it."""

    model: str
    in_flight: int = 0
    queued: int = 0
    peak: int = 0
    served_per_s: float = 0.0

    @property
    def idle(self) -> bool:
        return not (self.in_flight or self.queued or self.peak or self.served_per_s)


async def report(conn: AsyncConnection, gateway_id: str, loads: list[ModelLoad]) -> None:
    """Replace `gateway_id`'s rows with `loads` (idle models' rows are removed)."""
    busy = [x for x in loads if not x.idle]
    names = [x.model for x in busy]
    stale = delete(gateway_load).where(gateway_load.c.gateway_id == gateway_id)
    if names:
        stale = stale.where(gateway_load.c.model.not_in(names))
    await conn.execute(stale)
    for x in busy:
        values = dict(in_flight=x.in_flight, queued=x.queued, peak=x.peak, served_per_s=x.served_per_s)
        stmt = insert(gateway_load).values(gateway_id=gateway_id, model=x.model, **values)
        await conn.execute(stmt.on_conflict_do_update(
            index_elements=[gateway_load.c.gateway_id, gateway_load.c.model], set_={**values, "updated_at": func.now()}))


async def forget(conn: AsyncConnection, gateway_id: str) -> None:
    """A gateway stopping cleanly takes its load with it."""
    await conn.execute(delete(gateway_load).where(gateway_load.c.gateway_id == gateway_id))


async def totals(conn: AsyncConnection) -> dict[str, ModelLoad]:
    """Model -> load summed over the gateways heard from in the last `LOAD_FRESH_S` (by the database clock).
    Also deletes rows of gateways silent for `LOAD_FORGET_S`."""
    await conn.execute(delete(gateway_load).where(
        gateway_load.c.updated_at < func.now() - timedelta(seconds=LOAD_FORGET_S)))
    fresh = gateway_load.c.updated_at >= func.now() - timedelta(seconds=LOAD_FRESH_S)
    q = (select(gateway_load.c.model, func.sum(gateway_load.c.in_flight), func.sum(gateway_load.c.queued),
                func.sum(gateway_load.c.peak), func.sum(gateway_load.c.served_per_s))
         .where(fresh).group_by(gateway_load.c.model))
    return {r[0]: ModelLoad(r[0], int(r[1]), int(r[2]), int(r[3]), float(r[4])) for r in (await conn.execute(q)).all()}
