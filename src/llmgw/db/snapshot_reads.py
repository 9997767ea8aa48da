"""What the reconcile snapshot reads of replicas and model states every pass, kept between passes (issue 42).

At 10k nodes x 5k models a pass reads 15k replicas with their shards and 5k model states, and building their
models again every pass was the largest part of the read. `SnapshotMemo` keeps each as it was last built,
with the row it came from: a row unchanged since is not built again (a replica's `updated_at` moves with
every change to it). A replica's shards are inserted with it, in one transaction, and their node, rank and
GPUs (its placement) are never updated, so they are read only for replicas the memo has not seen.

The holder treats what it gets as read-only, as it does the inventories of `fleet_repo.InventoryMemo`.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db import load_repo
from llmgw.db.fleet_repo import BY_ID_MAX, unsettled
from llmgw.db.tables import model_state, replicas, shards
from llmgw.schemas.payloads import ModelState, ReplicaSnap, ShardPlacement

# (BY_ID_MAX: shards of at most this many new replicas are asked for by id; more, the first pass, by the
# replicas' query.)
# The model_state columns a ModelState holds (never `decisions`: 5k lists of lines parsed every pass).
_STATE_COLUMNS = [c for c in model_state.c if c.name in ModelState.model_fields]


class SnapshotMemo:
    """Replicas and model states as last built, each with the row it was built from."""

    def __init__(self) -> None:
        self.replicas: dict[str, tuple[tuple, ReplicaSnap]] = {}
        self.states: dict[str, tuple[tuple, ModelState]] = {}


async def snapshot_replicas(conn: AsyncConnection, memo: SnapshotMemo | None = None) -> list[ReplicaSnap]:
    """Every replica that is not ended, and every ended one not yet settled, with only what a reconcile
    snapshot holds of them and their shards (never a shard's output tail or progress)."""
    memo = memo if memo is not None else SnapshotMemo()
    rows = (await conn.execute(select(replicas.c.id, replicas.c.model, replicas.c.profile, replicas.c.status,
                                      replicas.c.created_at, replicas.c.updated_at, replicas.c.settled_at,
                                      replicas.c.profile_hash).where(unsettled()))).all()
    kept_before = memo.replicas
    unseen = [r[0] for r in rows if r[0] not in kept_before]
    placed: dict[str, list[ShardPlacement]] = {}
    if unseen:
        which = (shards.c.replica_id.in_(unseen) if len(unseen) <= BY_ID_MAX
                 else shards.c.replica_id.in_(select(replicas.c.id).where(unsettled()).scalar_subquery()))
        q = select(shards.c.replica_id, shards.c.node_id, shards.c.rank, shards.c.gpus).where(which)
        for replica_id, node_id, rank, gpus in (await conn.execute(q.order_by(shards.c.rank))).all():
            placed.setdefault(replica_id, []).append(ShardPlacement(node_id=node_id, rank=rank, gpus=list(gpus or [])))
    out: list[ReplicaSnap] = []
    kept: dict[str, tuple[tuple, ReplicaSnap]] = {}
    for r in rows:  # (by position, as fleet_repo.list_nodes reads its rows)
        row = tuple(r)
        replica_id = row[0]
        known = kept_before.get(replica_id)
        if known is not None and known[0] == row:
            snap = known[1]
        else:
            _, model, profile, status, created_at, updated_at, settled_at, profile_hash = row
            snap = ReplicaSnap(id=replica_id, model=model, profile=profile, status=status, created_at=created_at,
                               updated_at=updated_at, settled=settled_at is not None, profile_hash=profile_hash,
                               shards=known[1].shards if known is not None else placed.get(replica_id, []))
        kept[replica_id] = (row, snap)
        out.append(snap)
    memo.replicas = kept  # (replicas gone from the read are forgotten)
    return out


async def snapshot_model_states(conn: AsyncConnection, memo: SnapshotMemo | None = None) -> list[ModelState]:
    """Every model's state, with its load summed over the live gateways (db/load_repo.py)."""
    memo = memo if memo is not None else SnapshotMemo()
    rows = (await conn.execute(select(*_STATE_COLUMNS))).all()
    loads = await load_repo.totals(conn)
    out: list[ModelState] = []
    kept: dict[str, tuple[tuple, ModelState]] = {}
    for r in rows:
        row = tuple(r)
        known = memo.states.get(r.name)
        st = known[1] if known is not None and known[0] == row else ModelState.model_validate(r._asdict())
        kept[r.name] = (row, st)
        ld = loads.get(st.name)
        if ld is not None:  # (a copy: the memo's stays as the row built it)
            st = st.model_copy(update=dict(in_flight=ld.in_flight, queued=ld.queued, peak=ld.peak,
                                           served_per_s=ld.served_per_s))
        out.append(st)
    memo.states = kept
    return out
