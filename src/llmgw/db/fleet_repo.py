"""Nodes, replicas and shards. All SQL for the fleet lives here.

Replica statuses: `starting` (placed; its start workflow is running) → `ready` (routable) → `draining`
(no new requests) → `stopped`; or `failed` (a shard died or never became ready) and `lost` (its node was
lost or came back without it). The last three are final. An ended replica is *settled* once a workflow
has asked every one of its shards to stop and counted its failure; until then the reconciler sees it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from pydantic import ValidationError
from sqlalchemy import DateTime, String, Text, and_, case, cast, column, delete, func, select, text, update, values
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import model_state, nodes, observers, replicas, shards
from llmgw.schemas import problems_line
from llmgw.schemas.inventory import DownloadProgress, Inventory, ShardReport
from llmgw.schemas.payloads import ShardPlacement
from llmgw.schemas.status import ReplicaStatus, ShardStatus
from llmgw.workflows.ids import shard_id

log = logging.getLogger(__name__)

# The ended statuses as SQL IN / NOT IN lists take them, in the enum's order.
_ENDED = tuple(s for s in ReplicaStatus if s.is_ended)
# Rows asked for by id up to this many (`id IN (...)`); more are read with the query they came from.
BY_ID_MAX = 500


def unsettled():
    """A replica the reconciler still sees: not ended, or ended and not yet settled (its shards' stops unsure)."""
    return replicas.c.status.not_in(_ENDED) | replicas.c.settled_at.is_(None)
_NO_INVENTORY = Inventory()  # (poll_reads: rows that carry no inventory)
_EPOCH = datetime.fromtimestamp(0, timezone.utc)


# ---- nodes --------------------------------------------------------------------------------------

async def upsert_node(conn: AsyncConnection, node_id: str, boot_id: str, inventory: Inventory,
                      version: str | None = None) -> str | None:
    """Record a registration (`version`: the node worker's llmgw version; None: not sent). Returns the
    boot id the node had before (None if new)."""
    prev = (await conn.execute(select(nodes.c.boot_id).where(nodes.c.id == node_id))).first()
    inv = inventory.model_dump(mode="json")
    stmt = insert(nodes).values(id=node_id, boot_id=boot_id, inventory=inv, version=version)
    await conn.execute(stmt.on_conflict_do_update(
        index_elements=[nodes.c.id],
        set_={"boot_id": boot_id, "inventory": inv, "registered_at": func.now(), "last_heartbeat": func.now(),
              "left_at": None, "version": version},
    ))
    return prev.boot_id if prev else None


async def leave_node(conn: AsyncConnection, node_id: str, boot_id: str) -> list[str] | None:
    """The node's agent is leaving (it stops its engines as it exits): keep when (`left_at`, cleared by its
    next registration) and return the replicas with a shard on it that have not ended, for the caller to
    mark lost. None when this boot is not the node's registered one (a late goodbye from an old boot
    changes nothing)."""
    res = await conn.execute(update(nodes).where(and_(nodes.c.id == node_id, nodes.c.boot_id == boot_id))
                             .values(left_at=func.now()).returning(nodes.c.id))
    if res.first() is None:
        return None
    return sorted({row.replica_id for row in await shards_on_node(conn, node_id)})


async def heartbeat(conn: AsyncConnection, node_id: str, boot_id: str, inventory: Inventory | None = None,
                    downloads: list[DownloadProgress] | None = None) -> bool:
    """Refresh a node's heartbeat (and inventory, when sent). False when this boot never registered.

    With `downloads` (the heartbeat's), what the node downloads for its starting shards is recorded as
    `set_progress` does, the clearing of what it no longer reports in the same statement (a CTE): a
    heartbeat is one round trip to Postgres fewer (issue 42)."""
    values: dict = {"last_heartbeat": func.now()}
    if inventory is not None:
        values["inventory"] = inventory.model_dump(mode="json")
    beat = update(nodes).where(and_(nodes.c.id == node_id, nodes.c.boot_id == boot_id)).values(**values)
    if downloads is not None:
        this_boot = select(nodes.c.id).where(and_(nodes.c.id == node_id, nodes.c.boot_id == boot_id)).exists()
        beat = beat.add_cte(_clear_progress(node_id, downloads).where(this_boot).cte("cleared"))
    res = await conn.execute(beat.returning(nodes.c.id))
    known = res.first() is not None
    if known and downloads:
        await _record_progress(conn, node_id, downloads)
    return known


@dataclass
class NodeRow:
    id: str
    boot_id: str | None
    inventory: Inventory
    last_heartbeat: datetime
    age_s: float  # seconds since the last heartbeat, by the database clock
    polled_at: datetime | None = None  # its worker last seen polling node/<id> (the second witness)
    poll_age_s: float | None = None
    registered_at: datetime | None = None  # its latest registration (the node worker's start)
    left_at: datetime | None = None  # its agent said it was leaving, since its latest registration
    version: str | None = None  # its worker's llmgw version, as it last registered
    poll_read_at: datetime | None = None  # the control worker last read its pollers (None: never)


class InventoryMemo:
    """Each node's inventory as last read (the digest of its stored JSON and what it parsed to), so that a
    reader that reads every node often (the snapshot, every pass) fetches and parses only those that
    changed: at 10k nodes parsing them all was most of a pass, and fetching their text (~25 MB) a tenth of
    it (issue 42). Its holder treats the inventories as read-only."""

    def __init__(self) -> None:
        self.parsed: dict[str, tuple[str, Inventory]] = {}

    def known(self, node_id: str, digest: str) -> Inventory | None:
        kept = self.parsed.get(node_id)
        return kept[1] if kept is not None and kept[0] == digest else None

    def inventory(self, node_id: str, digest: str, text: str) -> Inventory:
        inv = _stored_inventory(node_id, json.loads(text))
        self.parsed[node_id] = (digest, inv)
        return inv


MAX_PEERS = 3  # peers named to a node about to fetch: enough to pass over one that fails, few to try


async def peers_holding(conn: AsyncConnection, cache_name: str, asker: str, fresh_s: float) -> list[tuple[str, str]]:
    """(node id, peer URL) of up to `MAX_PEERS` nodes other than `asker` whose last inventory lists
    `cache_name` on disk and advertises a peer listener, that beat within `fresh_s` and have not left:
    the most recently heard first (issue 39; a start's node fetches from them before the mirror)."""
    inv = nodes.c.inventory
    rows = await conn.execute(
        select(nodes.c.id, inv["peer_url"].astext)
        .where(nodes.c.id != asker, inv["cached_sources"].contains([cache_name]), inv.has_key("peer_url"),
               inv["peer_url"].astext.is_not(None), nodes.c.left_at.is_(None),
               nodes.c.last_heartbeat > func.now() - timedelta(seconds=fresh_s))
        .order_by(nodes.c.last_heartbeat.desc()).limit(MAX_PEERS))
    return [(r[0], r[1]) for r in rows]


async def list_nodes(conn: AsyncConnection, memo: InventoryMemo | None = None) -> list[NodeRow]:
    """Every registered node. With `memo`, an inventory unchanged since the memo's last read (the same md5 of
    its text, computed by Postgres) is neither fetched nor parsed again. Call it in a REPEATABLE READ
    transaction when the two statements must agree (the snapshot does)."""
    age = func.extract("epoch", func.now() - nodes.c.last_heartbeat)
    poll_age = func.extract("epoch", func.now() - nodes.c.polled_at)
    memo = memo if memo is not None else InventoryMemo()  # (one for this read alone: every inventory parsed)
    c = nodes.c
    digest = func.md5(cast(c.inventory, Text))
    rows = (await conn.execute(select(c.id, c.boot_id, digest, c.last_heartbeat, age, c.polled_at, poll_age,
                                      c.registered_at, c.left_at, c.version, c.poll_read_at)
                               .order_by(c.id))).all()
    known = memo.known
    held = {r[0]: known(r[0], r[2]) for r in rows}
    changed = [node_id for node_id, inv in held.items() if inv is None]
    if changed:
        q = select(c.id, digest, cast(c.inventory, Text))
        for node_id, d, inv_text in (await conn.execute(
                q.where(c.id.in_(changed)) if len(changed) <= BY_ID_MAX else q)).all():
            if held.get(node_id, False) is None:
                held[node_id] = memo.inventory(node_id, d, inv_text)
    # (by position: ten thousand rows' attributes read by name were half of this read)
    out = [NodeRow(node_id, boot, inv, beat, float(age_s), polled, None if poll_age_s is None else float(poll_age_s),
                   registered, left, version, poll_read)
           for node_id, boot, _, beat, age_s, polled, poll_age_s, registered, left, version, poll_read in rows
           if (inv := held[node_id]) is not None]
    if len(memo.parsed) > len(out):  # nodes removed since: forgotten
        ids = {n.id for n in out}
        memo.parsed = {k: v for k, v in memo.parsed.items() if k in ids}
    return out


async def poll_reads(conn: AsyncConnection) -> list[NodeRow]:
    """Every registered node with only what the liveness rotation orders them by (`id`, `poll_read_at`): the
    witness reads these each pass, and parsing every inventory for it cost as much as the snapshot's read."""
    rows = (await conn.execute(select(nodes.c.id, nodes.c.poll_read_at).order_by(nodes.c.id))).all()
    return [NodeRow(r.id, None, _NO_INVENTORY, _EPOCH, 0.0, poll_read_at=r.poll_read_at) for r in rows]


_told: set[tuple[str, str]] = set()  # (node, why) already logged: a pass every few seconds would repeat it


def _stored_inventory(node_id: str, raw: object) -> Inventory:
    """A node's stored inventory; one this version's rules refuse (stored by an older llmgw: two GPUs with
    one index, say) reads as an empty one with a note, so that nothing is placed there until the node
    registers again. It had been an exception in every reconcile pass (no placement, no stop anywhere in
    the fleet) and in `ctl nodes`. The node's replicas are judged by its heartbeats as ever."""
    try:
        return Inventory.model_validate(raw)
    except ValidationError as exc:
        why = problems_line(exc, "inventory", first=3, limit=300)
        if (node_id, why) not in _told and len(_told) < 10_000:
            _told.add((node_id, why))
            log.error("node %s: its stored inventory cannot be read (%s); nothing is placed there until it "
                      "registers again", node_id, why)
        return Inventory(notes=[f"its stored inventory cannot be read by this version ({why}); nothing is placed "
                                "here until the node registers again"])


async def set_polled(conn: AsyncConnection, polled: dict[str, datetime], read: list[str] | None = None,
                     read_at: datetime | None = None) -> None:
    """Record when each node's worker was last seen polling; never moves a time backwards (Temporal forgets
    its pollers when it restarts, and a node not seen since keeps the time it was last seen). The nodes in
    `read` had their pollers read at `read_at` (`poll_read_at`; polling or not): the witness's freshness."""
    if read and read_at is not None:
        await conn.execute(update(nodes).where(nodes.c.id.in_(read)).values(poll_read_at=read_at))
    if not polled:
        return
    # One statement for every node (a pass reads the pollers of the whole fleet): UPDATE ... FROM (VALUES ...).
    seen = values(column("id", String), column("at", DateTime(timezone=True)), name="seen").data(list(polled.items()))
    await conn.execute(update(nodes).where(and_(
        nodes.c.id == seen.c.id, (nodes.c.polled_at.is_(None)) | (nodes.c.polled_at < seen.c.at))).values(polled_at=seen.c.at))


# ---- the observer: when the node API could receive heartbeats ----------------------------------

async def observer_tick(conn: AsyncConnection, observer_id: str, gap_s: float) -> None:
    """One node-API process says it is running. A tick after a gap longer than `gap_s` starts a new
    continuous run (`started_at`): heartbeats missed in the gap were the observer's fault."""
    stmt = insert(observers).values(id=observer_id)
    gap = timedelta(seconds=gap_s)
    await conn.execute(stmt.on_conflict_do_update(index_elements=[observers.c.id], set_={
        "started_at": case((observers.c.seen_at < func.now() - gap, func.now()), else_=observers.c.started_at),
        "seen_at": func.now(),
    }))
    await conn.execute(delete(observers).where(and_(observers.c.seen_at < func.now() - timedelta(days=1),
                                                    observers.c.id != DOUBT)))


NODE_API = "node-api/"  # observer ids of node-API processes: node-api/<process>
POLLERS = "pollers"  # the observer id ticked when the control worker has read the pollers on node queues
DOUBT = "doubt"  # ticked by every snapshot that finds the observer doubtful (placement/liveness.py)


def _observer_since(fresh_s: float, kind: str):
    return select(func.min(observers.c.started_at)).where(and_(
        observers.c.id.startswith(kind), observers.c.seen_at >= func.now() - timedelta(seconds=fresh_s))).scalar_subquery()


def _observer_seen(observer_id: str):
    return select(observers.c.seen_at).where(observers.c.id == observer_id).scalar_subquery()


def _recent_lost(window_s: float):
    return select(func.count()).select_from(replicas).where(and_(
        replicas.c.status == ReplicaStatus.LOST, replicas.c.ended_at >= func.now() - timedelta(seconds=window_s))).scalar_subquery()


async def observer_since(conn: AsyncConnection, fresh_s: float, kind: str = NODE_API) -> datetime | None:
    """Since when a witness has been continuously observed: the earliest start among observers of `kind`
    (id prefix) that ticked within `fresh_s`. None when none did (that witness cannot see now)."""
    return (await conn.execute(select(_observer_since(fresh_s, kind)))).scalar_one_or_none()


async def observer_seen(conn: AsyncConnection, observer_id: str) -> datetime | None:
    """When observer `observer_id` last ticked, however long ago (None: never)."""
    return (await conn.execute(select(_observer_seen(observer_id)))).scalar_one_or_none()


async def liveness_reads(conn: AsyncConnection, fresh_s: float, window_s: float):
    """In one statement (issue 13: a pass is on the path from a request to its load): `observer_since` of
    the node API and of the pollers, `observer_seen` of the doubt, and `recent_lost`: replicas that ended
    `lost` within the last `window_s` (the teardown rate limit counts them)."""
    return (await conn.execute(select(
        _observer_since(fresh_s, NODE_API).label("node_api_since"), _observer_since(fresh_s, POLLERS).label("pollers_since"),
        _observer_seen(DOUBT).label("doubted_at"), _recent_lost(window_s).label("recent_lost")))).one()


def _observer_age(fresh_s: float, kind: str):
    """Seconds since `observer_since` as SQL (NULL when that witness cannot see now; GREATEST would
    turn that NULL into 0, so the caller clamps)."""
    return func.extract("epoch", func.now() - _observer_since(fresh_s, kind))


# ---- replicas and shards ------------------------------------------------------------------------

async def create_replica(
    conn: AsyncConnection, replica_id: str, model: str, profile: str, placement: list[ShardPlacement], reason: str = ""
) -> bool:
    """Insert a replica in `starting` with one shard row per placement. Idempotent on `replica_id`."""
    res = await conn.execute(
        insert(replicas).values(id=replica_id, model=model, profile=profile, status=ReplicaStatus.STARTING, reason=reason)
        .on_conflict_do_nothing().returning(replicas.c.id)
    )
    if res.first() is None:
        return False
    for p in placement:
        await conn.execute(insert(shards).values(
            id=shard_id(replica_id, p.rank), replica_id=replica_id, rank=p.rank, node_id=p.node_id,
            gpus=p.gpus, status=ShardStatus.STARTING,
        ).on_conflict_do_nothing())
    return True


async def adopt_replica(conn: AsyncConnection, node_id: str, report: ShardReport) -> bool:
    """Record a Ready single-shard replica a node runs that we had no record of (see fleet_service), with
    its engine key. Returns False, recording nothing, when the replica id is taken: a node may not add a
    shard to a replica it was not given."""
    res = await conn.execute(insert(replicas).values(
        id=report.replica_id, model=report.model, profile=report.profile, status=ReplicaStatus.READY, endpoint=report.endpoint,
        reason=f"adopted from node {node_id}", ready_at=func.now(), profile_hash=report.profile_hash,
    ).on_conflict_do_nothing().returning(replicas.c.id))
    if res.first() is None:
        return False
    await conn.execute(insert(shards).values(
        id=report.shard_id, replica_id=report.replica_id, rank=report.rank, node_id=node_id, status=report.state,
        pid=report.pid, endpoint=report.endpoint, gpus=report.gpus, api_key=report.api_key,
        adapters=_adapter_files(report),
    ))
    return True


@dataclass
class Transition:
    """The outcome of asking a replica to change status: whether this call changed it, the status after
    (None when the replica does not exist), and the fencing generation after (0 when it does not exist)."""

    applied: bool
    status: ReplicaStatus | None
    generation: int = 0


async def transition_replica(
    conn: AsyncConnection, replica_id: str, status: ReplicaStatus | str, endpoint: str | None = None,
    failure: str | None = None, reason: str | None = None, replaced: bool = True,
    sources: tuple[ReplicaStatus, ...] | None = None,
) -> Transition:
    """Move a replica to `status` if the transition is allowed (`ReplicaStatus.sources`); ValueError for
    a status no replica moves to (`starting`, or not a replica status).

    A replica that ends failed or lost counts in its model's `replaced` (`ctl models` RESTARTS), unless
    `replaced` is False: lost because its node's agent left on purpose and stopped its engines (an
    operator stopping `llmgw dev` or a node), which is no failure of the engine.

    `reason` is kept as `ended_reason` when `status` ends the replica (why it stopped). A step towards
    stopping (draining, stopped, failed, lost: `ReplicaStatus.fencing`) bumps the fencing generation.
    `sources` narrows the statuses it may move from (Ready from `starting` only, for a start's readiness)."""
    try:
        target = ReplicaStatus(status)
    except ValueError:
        raise ValueError(f"unknown replica status {status!r}") from None
    allowed = tuple(x for x in target.sources() if sources is None or x in sources)
    if not target.sources():
        raise ValueError(f"unknown replica status {status!r}")  # nothing moves to `starting`: it is created so
    values: dict = {"status": target, "updated_at": func.now()}
    if endpoint is not None:
        values["endpoint"] = endpoint
    if failure is not None:
        values["failure"] = failure
    if target is ReplicaStatus.READY:
        values["ready_at"] = func.now()
    if target.is_ended:
        values["ended_at"] = func.now()
        if reason or failure:
            values["ended_reason"] = (reason or failure or "")[:2000]
    if target in ReplicaStatus.fencing():
        values["generation"] = replicas.c.generation + 1
    res = await conn.execute(
        update(replicas).where(and_(replicas.c.id == replica_id, replicas.c.status.in_(allowed))).values(**values)
        .returning(replicas.c.status, replicas.c.generation, replicas.c.model)
    )
    row = res.first()
    if row is not None:
        if target.is_ended:  # its shards end with it, with the same status (a replica's lost is its shards' lost)
            await conn.execute(update(shards).where(and_(shards.c.replica_id == replica_id, shards.c.status.not_in(_ENDED)))
                               .values(status=ShardStatus(target), updated_at=func.now()))
        if target in (ReplicaStatus.FAILED, ReplicaStatus.LOST) and replaced:  # counted with the transition: a retry is not applied again
            stmt = insert(model_state).values(name=row.model, replaced=1)
            await conn.execute(stmt.on_conflict_do_update(index_elements=[model_state.c.name],
                                                          set_={"replaced": model_state.c.replaced + 1}))
        return Transition(True, ReplicaStatus(row.status), row.generation)
    cur = (await conn.execute(select(replicas.c.status, replicas.c.generation).where(replicas.c.id == replica_id))).first()
    return Transition(False, ReplicaStatus(cur.status) if cur else None, cur.generation if cur else 0)


async def record_ready(conn: AsyncConnection, replica_id: str, endpoint: str | None) -> Transition:
    """The one place a replica becomes Ready (routed), at `endpoint`. Two witnesses call it: its node,
    the moment every shard's engine answered (`ready_if_every_shard_is`, pushed through the node API, so
    it is routed at once), and its start workflow after its waits on the node succeeded (`mark_replica`,
    which carries on when the push was lost). Whichever comes second finds it Ready and is told so as if
    it had applied it: both mean the same start.

    The endpoint recorded is rank 0's as its node reported it over the node API, pinned there to the
    address verified (security/node_address.py), whenever there is one: `endpoint` (a start workflow's
    result, which may name a host) only when none was reported, and then it is not routed
    (`routable_replicas`) until a report of rank 0 records the verified one."""
    reported = (await conn.execute(select(shards.c.endpoint).where(and_(
        shards.c.replica_id == replica_id, shards.c.rank == 0)))).scalar_one_or_none()
    # From `starting` only: a sleeping replica's engine is awake only once its wake says so (`mark_sleep`).
    t = await transition_replica(conn, replica_id, ReplicaStatus.READY, endpoint=reported or endpoint,
                                 sources=(ReplicaStatus.STARTING,))
    if not t.applied and t.status is ReplicaStatus.READY:
        return Transition(True, t.status, t.generation)
    return t


async def mark_sleep(conn: AsyncConnection, replica_id: str, asleep: bool) -> Transition:
    """Ready -> sleeping (out of routing), or sleeping -> Ready (routed again, the same engine woken): the
    only writer of either (issue 39). The fencing generation is unchanged: neither is a step towards
    stopping."""
    if asleep:
        return await transition_replica(conn, replica_id, ReplicaStatus.SLEEPING)
    return await transition_replica(conn, replica_id, ReplicaStatus.READY, sources=(ReplicaStatus.SLEEPING,))


async def ready_if_every_shard_is(conn: AsyncConnection, replica_id: str) -> bool:
    """Mark a starting replica Ready, at rank 0's endpoint, once every one of its shards is reported ready by
    its node (readiness pushed by the node, issue 13). True when it is Ready after this call."""
    rows = (await conn.execute(select(shards.c.rank, shards.c.status, shards.c.endpoint)
                               .where(shards.c.replica_id == replica_id))).all()
    rank0 = next((r for r in rows if r.rank == 0), None)
    if rank0 is None or not rank0.endpoint or any(r.status != ShardStatus.READY for r in rows):
        return False
    return (await record_ready(conn, replica_id, rank0.endpoint)).applied


async def replica_state(conn: AsyncConnection, replica_id: str) -> tuple[ReplicaStatus | None, int]:
    """(status, fencing generation) of a replica; (None, 0) when there is no such replica."""
    cur = (await conn.execute(select(replicas.c.status, replicas.c.generation).where(replicas.c.id == replica_id))).first()
    return (ReplicaStatus(cur.status), cur.generation) if cur else (None, 0)


@dataclass
class Settled:
    """The outcome of `settle_replica`: whether this call settled it (False when it was settled already or
    has not ended, so exactly one caller counts it), and the replica's status and model (None: no such
    replica)."""

    applied: bool
    status: ReplicaStatus | None
    model: str | None


async def settle_replica(conn: AsyncConnection, replica_id: str, reason: str | None = None) -> Settled:
    """Record that every shard of an ended replica was asked to stop (`Settled`)."""
    values: dict = {"settled_at": func.now()}
    if reason:
        values["ended_reason"] = func.coalesce(replicas.c.ended_reason, reason[:2000])
    res = await conn.execute(
        update(replicas).where(and_(replicas.c.id == replica_id, replicas.c.status.in_(_ENDED),
                                    replicas.c.settled_at.is_(None)))
        .values(**values).returning(replicas.c.status, replicas.c.model)
    )
    row = res.first()
    if row is not None:
        return Settled(True, ReplicaStatus(row.status), row.model)
    cur = (await conn.execute(select(replicas.c.status, replicas.c.model).where(replicas.c.id == replica_id))).first()
    return Settled(False, ReplicaStatus(cur.status) if cur else None, cur.model if cur else None)


async def replica_shards(conn: AsyncConnection, replica_id: str) -> list[ShardPlacement]:
    rows = (await conn.execute(select(shards).where(shards.c.replica_id == replica_id).order_by(shards.c.rank))).all()
    return [ShardPlacement(node_id=r.node_id, rank=r.rank, gpus=list(r.gpus or [])) for r in rows]


@dataclass
class ShardRow:
    """A shard as stored: where it runs, its status as its node last reported it, a download in progress
    (`progress`: `DownloadProgress` as JSON), how its engine exited and the output it last reported. Never
    its engine key."""

    id: str
    replica_id: str
    node_id: str
    rank: int
    gpus: list[int]
    status: ShardStatus
    pid: int | None = None
    progress: dict | None = None
    exit_code: int | None = None
    exit_reason: str | None = None
    output_tail: str | None = None


def _shard(r) -> ShardRow:
    return ShardRow(r.id, r.replica_id, r.node_id, r.rank, list(r.gpus or []), ShardStatus(r.status), r.pid, r.progress,
                    r.exit_code, r.exit_reason, r.output_tail)


@dataclass
class ReplicaRow:
    """A replica as stored, with its shards by rank. `node_id` is rank 0's node (`list_replicas` only)."""

    id: str
    model: str
    profile: str
    status: ReplicaStatus
    endpoint: str | None
    failure: str | None
    reason: str | None
    created_at: datetime
    updated_at: datetime
    ready_at: datetime | None
    ended_at: datetime | None
    settled_at: datetime | None
    ended_reason: str | None
    generation: int
    profile_hash: str | None
    shards: list[ShardRow]
    node_id: str | None = None


async def _with_shards(conn: AsyncConnection, rows, among=None) -> list[ReplicaRow]:
    """`ReplicaRow`s of replica rows (with `node_id` when selected), each with its shards, in one more query:
    the shards of the replicas `among` selects (a subquery of their ids), else of these rows' ids."""
    ids = [r.id for r in rows]
    by_rep: dict[str, list[ShardRow]] = {}
    if ids:
        which = shards.c.replica_id.in_(among if among is not None else ids)  # (15k ids as literals cost 0.2 s)
        for sr in (await conn.execute(select(shards).where(which).order_by(shards.c.rank))).all():
            by_rep.setdefault(sr.replica_id, []).append(_shard(sr))
    has_node = bool(rows) and "node_id" in rows[0]._fields  # (getattr with a default costs an exception a row)
    return [ReplicaRow(r.id, r.model, r.profile, ReplicaStatus(r.status), r.endpoint, r.failure, r.reason, r.created_at,
                       r.updated_at, r.ready_at, r.ended_at, r.settled_at, r.ended_reason, r.generation, r.profile_hash,
                       by_rep.get(r.id, []), r.node_id if has_node else None)
            for r in rows]


async def list_replicas(conn: AsyncConnection, include_ended: bool = False, limit: int = 200, model: str | None = None,
                        ids: list[str] | None = None) -> list[ReplicaRow]:
    """Replicas, newest first, each with its rank-0 `node_id` and `shards`. `ids`: only these (ended or not)."""
    q = select(replicas, shards.c.node_id).join(shards, and_(shards.c.replica_id == replicas.c.id, shards.c.rank == 0), isouter=True)
    if ids is not None:
        q = q.where(replicas.c.id.in_(ids))
    elif not include_ended:
        q = q.where(replicas.c.status.not_in(_ENDED))
    if model is not None:
        q = q.where(replicas.c.model == model)
    q = q.order_by(replicas.c.created_at.desc()).limit(limit)
    return await _with_shards(conn, (await conn.execute(q)).all())


async def set_progress(conn: AsyncConnection, node_id: str, downloads: list[DownloadProgress]) -> None:
    """Record what `node_id` is downloading for its starting shards, and clear what it no longer reports.
    Not a state transition: the shard stays `starting` (seeds 001)."""
    await conn.execute(_clear_progress(node_id, downloads))
    await _record_progress(conn, node_id, downloads)


def _clear_progress(node_id: str, downloads: list[DownloadProgress]):
    """The statement that clears the progress of `node_id`'s shards it no longer reports downloading."""
    ids = [d.replica_id for d in downloads]
    clear = update(shards).where(and_(shards.c.node_id == node_id, shards.c.progress.is_not(None)))
    if ids:
        clear = clear.where(shards.c.replica_id.not_in(ids))
    return clear.values(progress=None)


async def _record_progress(conn: AsyncConnection, node_id: str, downloads: list[DownloadProgress]) -> None:
    for d in downloads:
        await conn.execute(update(shards).where(and_(
            shards.c.node_id == node_id, shards.c.replica_id == d.replica_id, shards.c.status == ShardStatus.STARTING))
            .values(progress=d.model_dump(mode="json")))


async def active_replicas_with_shards(conn: AsyncConnection) -> list[ReplicaRow]:
    """Every replica that is not ended, and every ended one not yet settled, each with its shards."""
    active = unsettled()
    reps = (await conn.execute(select(replicas).where(active))).all()
    return await _with_shards(conn, reps, select(replicas.c.id).where(active).scalar_subquery())


def _adapter_files(report: ShardReport) -> dict | None:
    return None if report.adapters is None else {k: v.model_dump(mode="json") for k, v in report.adapters.items()}


async def update_shard(conn: AsyncConnection, node_id: str, report: ShardReport) -> ReplicaStatus | None:
    """Apply a node's report about one of its shards (the caller has checked it is placed on `node_id`).
    Returns the replica's status (None if unknown). A shard's status only moves forward (`ShardStatus.step`):
    a late retry of an earlier report (`starting` after `ready`, `ready` after `stopped`) keeps the row where
    it is; its other facts (pid, exit code, output) are still kept."""
    step = ShardStatus(report.state).step
    current = case(*((shards.c.status == s, s.step) for s in ShardStatus), else_=0)
    values: dict = {"status": case((current < step, report.state), else_=shards.c.status),
                    "updated_at": func.now(), "progress": None}  # a transition ends a download
    for field in ("pid", "endpoint", "exit_code", "output_tail", "api_key", "exit_reason"):
        v = getattr(report, field)
        if v is not None:
            values[field] = v
    if report.adapters is not None:
        values["adapters"] = _adapter_files(report)
    res = await conn.execute(
        update(shards).where(and_(shards.c.id == report.shard_id, shards.c.node_id == node_id)).values(**values)
        .returning(shards.c.replica_id)
    )
    row = res.first()
    if row is None:
        return None
    if report.rank == 0 and report.endpoint:
        # Rank 0's endpoint, verified and pinned by the node API, is the replica's: a Ready replica whose
        # endpoint was recorded otherwise (a start workflow's result, a name stored before endpoints were
        # pinned) is routed at this one from now on.
        await conn.execute(update(replicas).where(and_(
            replicas.c.id == row.replica_id, replicas.c.status == ReplicaStatus.READY,
            replicas.c.endpoint.is_distinct_from(report.endpoint))).values(endpoint=report.endpoint))
    if report.rank == 0 and report.profile_hash:
        # What the node says it launched is the replica's profile (rolling replacement compares it with
        # the catalog's): recorded from the fleet, not from the decision that placed it.
        await conn.execute(update(replicas).where(and_(
            replicas.c.id == row.replica_id, replicas.c.profile_hash.is_distinct_from(report.profile_hash)))
            .values(profile_hash=report.profile_hash))
    rep = (await conn.execute(select(replicas.c.status).where(replicas.c.id == row.replica_id))).first()
    return ReplicaStatus(rep.status) if rep else None


@dataclass
class NodeShard:
    """A shard on a node, as a registration or heartbeat compares what the node runs with it: its status
    and pid (set by the node's launch report), and its replica's status."""

    id: str
    replica_id: str
    status: ShardStatus
    pid: int | None
    replica_status: ReplicaStatus

    @property
    def launched(self) -> bool:
        """Did the node say it launched this shard? Rows start as `starting` with no pid at placement; the
        node's launch report sets the pid, readiness `ready`."""
        return self.status in (ShardStatus.READY, ShardStatus.DRAINING) or self.pid is not None


async def shards_on_node(conn: AsyncConnection, node_id: str) -> list[NodeShard]:
    """The shards on `node_id` whose replica is not ended."""
    q = (select(shards.c.id, shards.c.replica_id, shards.c.status, shards.c.pid, replicas.c.status.label("replica_status"))
         .join(replicas, replicas.c.id == shards.c.replica_id)
         .where(and_(shards.c.node_id == node_id, replicas.c.status.not_in(_ENDED))))
    return [NodeShard(r.id, r.replica_id, ShardStatus(r.status), r.pid, ReplicaStatus(r.replica_status))
            for r in (await conn.execute(q)).all()]


# Many steady-state heartbeats (no inventory, no downloads) in one statement (issue 42): each node of this
# boot is stamped, the download progress of its shards cleared (as `heartbeat` does for an empty
# `downloads`), and its shards whose replica has not ended read back, one row per (node, shard), or one row
# with no shard for a node that has none; a node of another boot (or none) has no row. The text is the same
# for any batch (the beats travel as two arrays), so psycopg prepares it once per connection.
_HEARTBEAT_MANY = text(f"""
WITH v AS (SELECT * FROM unnest(CAST(:ids AS text[]), CAST(:boots AS text[])) AS v(id, boot_id)),
beat AS (UPDATE nodes SET last_heartbeat = now() FROM v WHERE nodes.id = v.id AND nodes.boot_id = v.boot_id
         RETURNING nodes.id, nodes.boot_id),
cleared AS (UPDATE shards SET progress = NULL WHERE shards.node_id IN (SELECT id FROM beat) AND shards.progress IS NOT NULL)
SELECT beat.id, beat.boot_id, s.id AS shard_id, s.replica_id, s.status, s.pid, s.replica_status FROM beat
LEFT JOIN (SELECT shards.id, shards.node_id, shards.replica_id, shards.status, shards.pid, replicas.status AS replica_status
           FROM shards JOIN replicas ON replicas.id = shards.replica_id
           WHERE replicas.status NOT IN ({", ".join(f"'{s.value}'" for s in _ENDED)})) AS s ON s.node_id = beat.id
""")


async def heartbeat_many(conn: AsyncConnection, beats: list[tuple[str, str]]) -> dict[tuple[str, str], list[NodeShard]]:
    """Refresh the heartbeats of `beats` ((node id, boot id) pairs; a pair may repeat) in one statement, as
    `heartbeat` with no inventory and no downloads followed by `shards_on_node` does for each. Returns, for
    each pair whose boot is its node's registered one, the shards on that node whose replica has not ended;
    a pair not in the result never registered this boot (the node is asked to register again)."""
    if not beats:
        return {}
    res = await conn.execute(_HEARTBEAT_MANY, {"ids": [b[0] for b in beats], "boots": [b[1] for b in beats]})
    out: dict[tuple[str, str], list[NodeShard]] = {}
    for r in res.all():
        live = out.setdefault((r.id, r.boot_id), [])
        if r.shard_id is not None:
            live.append(NodeShard(r.shard_id, r.replica_id, ShardStatus(r.status), r.pid, ReplicaStatus(r.replica_status)))
    return out


@dataclass
class KnownShard:
    """A shard row as a node's report is checked against it: where it is placed and whose it is."""

    id: str
    replica_id: str
    node_id: str
    replica_status: ReplicaStatus
    generation: int = 0  # the replica's fencing generation


async def known_shards(conn: AsyncConnection, ids: list[str]) -> dict[str, KnownShard]:
    """shard id -> `KnownShard`, for the ids that exist."""
    if not ids:
        return {}
    q = (select(shards.c.id, shards.c.replica_id, shards.c.node_id, replicas.c.status, replicas.c.generation)
         .join(replicas, replicas.c.id == shards.c.replica_id).where(shards.c.id.in_(ids)))
    return {r.id: KnownShard(r.id, r.replica_id, r.node_id, ReplicaStatus(r.status), r.generation)
            for r in (await conn.execute(q)).all()}


@dataclass
class RouteRow:
    model: str
    replica_id: str
    endpoint: str
    node_id: str
    node_age_s: float  # since the rank-0 node's last heartbeat
    poll_age_s: float | None = None  # since its worker was last seen polling (None: never)
    api_key: str | None = None  # the engine's key (rank 0's), which the gateway sends
    observer_age_s: float | None = None  # `observer_age_s` of the node API (the same on every row; None: blind)
    pollers_age_s: float | None = None  # and of the pollers
    profile: str = ""  # the catalog profile it runs (its engine: the gateway's cache isolation)
    poll_read_age_s: float | None = None  # since its pollers were last read (None: never)
    adapter_files: dict | None = None  # rank 0's adapter files by name, as its node reported them (issue 40)


async def routable_replicas(conn: AsyncConnection, fresh_s: float = 0.0) -> list[RouteRow]:
    """Ready replicas with the ages of their rank-0 node's two witnesses (the gateway drops silent nodes),
    the engine key rank 0's node reported, and, on every row, the observers' ages (`observer_age_s` with
    `fresh_s`, of the node API and of the pollers: one statement for all a route refresh reads but the
    catalog). Only where the replica's endpoint is the one rank 0's node reported over the node API, which
    checked it is at that node's own address (issue 11): an endpoint recorded from anywhere else (a start
    workflow's result) is not routed, and never gets the engine key."""
    age = func.extract("epoch", func.now() - nodes.c.last_heartbeat)
    poll_age = func.extract("epoch", func.now() - nodes.c.polled_at)
    q = (
        select(replicas.c.model, replicas.c.id, replicas.c.endpoint, shards.c.node_id, age.label("age"),
               poll_age.label("poll_age"), shards.c.api_key, _observer_age(fresh_s, NODE_API).label("observer_age"),
               _observer_age(fresh_s, POLLERS).label("pollers_age"), replicas.c.profile,
               func.extract("epoch", func.now() - nodes.c.poll_read_at).label("poll_read_age"), shards.c.adapters)
        .join(shards, and_(shards.c.replica_id == replicas.c.id, shards.c.rank == 0))
        .join(nodes, nodes.c.id == shards.c.node_id)
        .where(and_(replicas.c.status == ReplicaStatus.READY, replicas.c.endpoint.is_not(None),
                    replicas.c.endpoint == shards.c.endpoint))
    )
    def f(x) -> float | None:
        return None if x is None else float(x)

    def since(x) -> float | None:
        return None if x is None else max(0.0, float(x))
    return [RouteRow(r.model, r.id, r.endpoint, r.node_id, float(r.age), f(r.poll_age), r.api_key,
                     since(r.observer_age), since(r.pollers_age), r.profile, since(r.poll_read_age), r.adapters)
            for r in (await conn.execute(q)).all()]


async def db_now(conn: AsyncConnection) -> datetime:
    return (await conn.execute(select(func.now()))).scalar_one()


async def find_replicas(conn: AsyncConnection, prefix: str, limit: int = 5) -> list[str]:
    """Ids of replicas whose id starts with `prefix` (as `ctl replicas` prints the first 8 characters)."""
    q = select(replicas.c.id).where(replicas.c.id.startswith(prefix, autoescape=True)).order_by(
        replicas.c.created_at.desc()).limit(limit)
    return [r.id for r in (await conn.execute(q)).all()]


async def shard_row(conn: AsyncConnection, replica_id: str, rank: int) -> ShardRow | None:
    """The shard of `replica_id` with `rank` (its node, output tail, exit), or None."""
    q = select(shards).where(and_(shards.c.replica_id == replica_id, shards.c.rank == rank))
    r = (await conn.execute(q)).first()
    return _shard(r) if r else None


# ---- forgetting nodes ---------------------------------------------------------------------------

def _holds_live_shard():
    """A node still has a shard of a replica that is active, or ended but not yet settled."""
    return (select(shards.c.id).join(replicas, replicas.c.id == shards.c.replica_id)
            .where(and_(shards.c.node_id == nodes.c.id, unsettled()))
            .exists())


async def forget_lost_nodes(conn: AsyncConnection, after_s: float, among: list[str] | None = None) -> list[str]:
    """Delete nodes (of `among`, when given: those the planner judges Lost) whose heartbeats and pollers
    have both been silent for `after_s` seconds or more (by the database clock) and that hold no live shard.
    Returns their ids. A node that comes back registers again, as a new node would."""
    since = func.now() - timedelta(seconds=after_s)
    cond = and_(nodes.c.last_heartbeat < since, nodes.c.polled_at.is_(None) | (nodes.c.polled_at < since),
                ~_holds_live_shard())
    if among is not None:
        cond = and_(cond, nodes.c.id.in_(among))
    res = await conn.execute(delete(nodes).where(cond).returning(nodes.c.id))
    return sorted(r.id for r in res)


@dataclass
class LiveShard:
    replica_id: str
    model: str
    status: ReplicaStatus  # the replica's
    rank: int


async def live_shards_on(conn: AsyncConnection, node_id: str) -> list[LiveShard]:
    """Shards on `node_id` of replicas that are active or ended but not settled (what removing it strands)."""
    q = (select(replicas.c.id, replicas.c.model, replicas.c.status, shards.c.rank)
         .join(shards, shards.c.replica_id == replicas.c.id)
         .where(and_(shards.c.node_id == node_id, unsettled()))
         .order_by(replicas.c.model, replicas.c.id))
    return [LiveShard(r.id, r.model, ReplicaStatus(r.status), r.rank) for r in (await conn.execute(q)).all()]


async def remove_node(conn: AsyncConnection, node_id: str) -> bool:
    """Forget `node_id` now. False when there is no such node."""
    return (await conn.execute(delete(nodes).where(nodes.c.id == node_id).returning(nodes.c.id))).first() is not None
