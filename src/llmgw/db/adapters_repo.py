"""Which LoRA adapters each replica holds loaded (`replica_adapters`, issue 40): all the SQL for them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Text, and_, delete, func, literal, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import replica_adapters, replicas, shards
from llmgw.schemas.status import ReplicaStatus


@dataclass(frozen=True)
class HeldAdapter:
    """One adapter loaded in one replica: `used_at` orders a replica's adapters, oldest first (its LRU)."""

    replica_id: str
    model: str
    adapter: str
    loaded_at: datetime
    used_at: datetime


async def held(conn: AsyncConnection, ready_only: bool = True) -> list[HeldAdapter]:
    """Every adapter loaded in a Ready replica (all replicas with `ready_only=False`), each replica's oldest
    used first."""
    q = select(replica_adapters).order_by(replica_adapters.c.replica_id, replica_adapters.c.used_at)
    if ready_only:
        q = q.join(replicas, replicas.c.id == replica_adapters.c.replica_id).where(
            replicas.c.status == ReplicaStatus.READY)
    return [HeldAdapter(r.replica_id, r.model, r.adapter, r.loaded_at, r.used_at)
            for r in (await conn.execute(q)).all()]


@dataclass(frozen=True)
class UnverifiedFile:
    """An adapter's file that a Ready replica's node could not fetch or verify (`shards.adapters`): never loaded."""

    replica_id: str
    node_id: str
    adapter: str
    error: str


async def unverified(conn: AsyncConnection) -> list[UnverifiedFile]:
    """Every adapter file that failed on a Ready replica's rank-0 node, with the node's words."""
    q = (select(shards.c.replica_id, shards.c.node_id, shards.c.adapters)
         .join(replicas, replicas.c.id == shards.c.replica_id)
         .where(and_(replicas.c.status == ReplicaStatus.READY, shards.c.rank == 0, shards.c.adapters.is_not(None)))
         .order_by(shards.c.replica_id))
    out = []
    for r in (await conn.execute(q)).all():
        for name, f in (r.adapters or {}).items():
            if isinstance(f, dict) and f.get("error"):
                out.append(UnverifiedFile(r.replica_id, r.node_id, str(name), str(f["error"])))
    return out


async def record_loaded(conn: AsyncConnection, replica_id: str, model: str, adapter: str) -> None:
    """`adapter` is loaded in `replica_id` now (again: its times are renewed). A replica that has gone from
    the table meanwhile records nothing."""
    stmt = insert(replica_adapters).from_select(
        ["replica_id", "adapter", "model"],
        select(replicas.c.id, literal(adapter, Text), literal(model, Text)).where(replicas.c.id == replica_id))
    await conn.execute(stmt.on_conflict_do_update(
        index_elements=[replica_adapters.c.replica_id, replica_adapters.c.adapter],
        set_={"loaded_at": func.now(), "used_at": func.now()}))


async def record_unloaded(conn: AsyncConnection, replica_id: str, adapter: str) -> None:
    await conn.execute(delete(replica_adapters).where(and_(replica_adapters.c.replica_id == replica_id,
                                                           replica_adapters.c.adapter == adapter)))
