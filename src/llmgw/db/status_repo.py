"""The facts a model's status is derived from (placement/model_status.py), read in a few queries for
every model at once, or for the models named."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import catalog_models, model_state, replicas, shards
from llmgw.placement.decisions import refusal
from llmgw.placement.model_status import ModelCondition, ModelFacts, failure_cause, model_condition
from llmgw.schemas.catalog import Catalog
from llmgw.schemas.status import ReplicaStatus

_HOLDING = tuple(s for s in ReplicaStatus if s in ReplicaStatus.holding())  # a model's active replicas, for SQL


async def model_conditions(conn: AsyncConnection, catalog: Catalog, names: list[str] | None = None
                           ) -> dict[str, ModelCondition]:
    """Model name -> its condition now (database clock), for the catalog's models (or those in `names`)."""
    now, facts = await model_facts(conn, names)
    return {m.name: model_condition(m, facts.get(m.name, ModelFacts()), now)
            for m in catalog.models if names is None or m.name in names}


async def model_facts(conn: AsyncConnection, names: list[str] | None = None) -> tuple[datetime, dict[str, ModelFacts]]:
    """(the database clock, model name -> its facts) for `names` (None: every model with any state)."""
    now = (await conn.execute(select(func.now()))).scalar_one()
    facts: dict[str, ModelFacts] = {}

    def of(name: str) -> ModelFacts:
        return facts.setdefault(name, ModelFacts())

    q = select(model_state.c.name, model_state.c.failures, model_state.c.backoff_until, model_state.c.decisions,
               model_state.c.failed_at, model_state.c.demand_at, model_state.c.last_used_at, model_state.c.replaced)
    if names is not None:
        q = q.where(model_state.c.name.in_(names))
    for r in (await conn.execute(q)).all():
        f = of(r.name)
        f.failures, f.backoff_until, f.replaced = r.failures, r.backoff_until, r.replaced
        f.failed_at, f.demand_at, f.last_used_at = r.failed_at, r.demand_at, r.last_used_at
        f.refused = refusal(r.decisions or [], r.name)

    q = (select(replicas.c.model, replicas.c.status, func.count().label("n"))
         .where(replicas.c.status.in_(_HOLDING)).group_by(replicas.c.model, replicas.c.status))
    if names is not None:
        q = q.where(replicas.c.model.in_(names))
    for r in (await conn.execute(q)).all():
        of(r.model).replicas[ReplicaStatus(r.status)] = r.n

    # The latest failed replica of each model, and its shards' decoded exits.
    q = (select(replicas.c.id, replicas.c.model, replicas.c.failure, replicas.c.ended_at)
         .where(replicas.c.status == ReplicaStatus.FAILED)
         .distinct(replicas.c.model)
         .order_by(replicas.c.model, replicas.c.ended_at.desc().nulls_last()))
    if names is not None:
        q = q.where(replicas.c.model.in_(names))
    last = (await conn.execute(q)).all()
    exits = await exit_reasons(conn, [r.id for r in last])
    for r in last:
        f = of(r.model)
        f.last_failure = failure_cause(r.failure, exits.get(r.id))
        f.last_failure_at = r.ended_at
        f.last_failed_replica = r.id
    return now, facts


async def exit_reasons(conn: AsyncConnection, replica_ids: list[str]) -> dict[str, list[tuple[int, str, str]]]:
    """replica id -> [(rank, node, decoded exit)] for its shards that exited on their own."""
    if not replica_ids:
        return {}
    rows = (await conn.execute(select(shards.c.replica_id, shards.c.rank, shards.c.node_id, shards.c.exit_reason)
                               .where(and_(shards.c.replica_id.in_(replica_ids), shards.c.exit_reason.is_not(None)))
                               )).all()
    out: dict[str, list[tuple[int, str, str]]] = {}
    for r in rows:
        out.setdefault(r.replica_id, []).append((r.rank, r.node_id, r.exit_reason))
    return out


@dataclass
class ReplicaTimes:
    model: str
    created_at: datetime
    time_to_ready_s: float | None  # placement to Ready; None when it never became Ready


async def replica_times(conn: AsyncConnection, replica_id: str) -> ReplicaTimes | None:
    ready = func.extract("epoch", replicas.c.ready_at - replicas.c.created_at)
    r = (await conn.execute(select(replicas.c.model, replicas.c.created_at, ready.label("ttr"))
                            .where(replicas.c.id == replica_id))).first()
    if r is None:
        return None
    return ReplicaTimes(r.model, r.created_at, float(r.ttr) if r.ttr is not None else None)


async def catalog_created(conn: AsyncConnection) -> dict[str, datetime]:
    """Model name -> when it was first applied (the AGE `ctl models` shows)."""
    rows = (await conn.execute(select(catalog_models.c.name, catalog_models.c.created_at))).all()
    return {r.name: r.created_at for r in rows}
