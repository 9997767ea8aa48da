"""Token usage (issue 15). All SQL for `usage` and `usage_periods` lives here.

Every gateway adds its counts of the last second, additively (INSERT ... ON CONFLICT DO UPDATE SET n = n +
excluded.n), to one `usage` row per minute, tenant, key and model and to one `usage_periods` row per budget
period and key, then reads the fleet's totals back in the same transaction (gateway/quotas.py). Rows are
written in sorted order, so two gateways adding to the same rows lock them in the same order and never
deadlock. A key of no tenant is stored with tenant ''.

The write is additive, so each batch carries an id (`claim`), recorded in the same transaction: a sync
whose COMMIT reached Postgres but whose answer was lost is retried with the same id, and adds nothing
again (issue 37).

What each gateway's requests in flight hold (tokens reserved at admission, released at their end) is
shared the same way: the totals' statement also replaces this gateway's row of `usage_holds` and reads the
other gateways' holds per tenant and key, from rows not past their `expires_at` (a dead gateway's holds
stop counting there) (issue 37).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import usage

RowKey = tuple[str, str, str]  # (tenant or '', key id, model)
KEEP_BATCHES_S = 3 * 86400  # a batch id is kept this long: far longer than a gateway retries one
FORGET_HOLDS_S = 3600.0  # a gateway's row of holds is deleted this long after it stopped counting


@dataclass(frozen=True)
class MinuteTotal:
    tenant: str
    key_id: str
    minute: float  # epoch seconds
    requests: int
    tokens: int


@dataclass(frozen=True)
class PeriodTotal:
    tenant: str
    key_id: str
    period: str  # 'day' or 'month'
    tokens: int


@dataclass(frozen=True)
class HeldTotal:
    """Tokens held by requests in flight on the other gateways, for one tenant or key."""

    scope: str  # 'tenant' or 'key'
    name: str  # the tenant's name or the key's id
    tokens: int


@dataclass(frozen=True)
class Holds:
    """What this gateway publishes with its totals: its id, the tokens its requests in flight hold per
    (scope, name), and how long the row counts for the others (`fresh_s`, from this sync). `write` False:
    the row is not written (nothing held now, and nothing was in the row already written)."""

    gateway_id: str
    held: dict[tuple[str, str], int]
    fresh_s: float
    write: bool = True


@dataclass(frozen=True)
class UsageTotal:
    """Use summed per tenant ('' for keys of no tenant) and `group`: a model, a key id, a UTC day
    (YYYY-MM-DD), or None when summed per tenant only. `last_at`: the latest minute with use."""

    tenant: str
    group: str | None
    requests: int
    prompt_tokens: int
    completion_tokens: int
    last_at: datetime


def _ts(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, timezone.utc)


async def db_now(conn: AsyncConnection) -> float:
    """The database clock (the transaction's start), in epoch seconds."""
    return (await conn.exec_driver_sql("SELECT extract(epoch FROM now())::float8")).scalar_one()


# The sync's three statements (gateway/quotas.py, every second on every gateway) are plain SQL run through
# the driver: measured (bench/overhead.py's idle line), the same work through compiled Core statements and
# executemany cost four times the CPU, which every request of an accounted key paid a share of.
# Each upsert takes its rows as arrays (one statement, whatever the count), in the order given: sorted.
_ADD_USAGE = """
INSERT INTO usage (minute, tenant, key_id, model, requests, prompt_tokens, completion_tokens)
SELECT to_timestamp(%s), t, k, m, r, p, c
FROM unnest(%s::text[], %s::text[], %s::text[], %s::bigint[], %s::bigint[], %s::bigint[]) AS x(t, k, m, r, p, c)
ON CONFLICT (minute, tenant, key_id, model) DO UPDATE SET
    requests = usage.requests + excluded.requests,
    prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens,
    completion_tokens = usage.completion_tokens + excluded.completion_tokens
"""
_ADD_PERIODS = """
INSERT INTO usage_periods (period, starts_at, tenant, key_id, requests, tokens)
SELECT p, to_timestamp(s), t, k, r, n
FROM unnest(%s::text[], %s::float8[], %s::text[], %s::text[], %s::bigint[], %s::bigint[]) AS x(p, s, t, k, r, n)
ON CONFLICT (period, starts_at, tenant, key_id) DO UPDATE SET
    requests = usage_periods.requests + excluded.requests,
    tokens = usage_periods.tokens + excluded.tokens
"""
# One statement: the ids not recorded yet are recorded, and returned (those already there conflict).
_CLAIM = """
INSERT INTO usage_batches (id) SELECT unnest(%s::uuid[]) ON CONFLICT (id) DO NOTHING RETURNING id::text
"""
_PRUNE = "DELETE FROM usage_batches WHERE written_at < now() - make_interval(secs => %s)"
# Minute rows carry their minute; period rows carry NULL there and their period's name first; the other
# gateways' holds carry 'held' there, then the scope and name. The data-modifying CTE replaces this
# gateway's own row of holds first (when the last parameter of its SELECT is true): one statement, so
# sharing holds adds no round trip to the sync (bench/README.md measures its cost).
_TOTALS = """
WITH mine AS (
    INSERT INTO usage_holds (gateway_id, scopes, names, held, updated_at, expires_at)
    SELECT %s, %s::text[], %s::text[], %s::bigint[], now(), now() + make_interval(secs => %s) WHERE %s
    ON CONFLICT (gateway_id) DO UPDATE SET scopes = excluded.scopes, names = excluded.names,
        held = excluded.held, updated_at = excluded.updated_at, expires_at = excluded.expires_at
)
SELECT NULL, tenant, key_id, extract(epoch FROM minute)::float8, sum(requests)::bigint,
       sum(prompt_tokens + completion_tokens)::bigint
FROM usage WHERE minute >= to_timestamp(%s) GROUP BY tenant, key_id, minute
UNION ALL
SELECT u.period, u.tenant, u.key_id, NULL, NULL, u.tokens
FROM usage_periods u JOIN unnest(%s::text[], %s::float8[]) AS x(p, s)
    ON u.period = x.p AND u.starts_at = to_timestamp(x.s)
UNION ALL
SELECT 'held', x.s, x.n, NULL, NULL, sum(x.t)::bigint
FROM usage_holds g, unnest(g.scopes, g.names, g.held) AS x(s, n, t)
WHERE g.gateway_id <> %s AND g.expires_at > now()
GROUP BY x.s, x.n
"""
_PRUNE_HOLDS = "DELETE FROM usage_holds WHERE expires_at < now() - make_interval(secs => %s)"
_FORGET_HOLDS = "DELETE FROM usage_holds WHERE gateway_id = %s"


async def claim(conn: AsyncConnection, ids: list[str]) -> set[str]:
    """Record the batch ids `ids` (uuids, as text) in the caller's transaction; returns those not recorded
    before, whose rows the caller adds now. An id already there is a batch already written: its rows are
    not added again. Now and then, ids older than `KEEP_BATCHES_S` go."""
    if not ids:
        return set()
    new = {r[0] for r in (await conn.exec_driver_sql(_CLAIM, (ids,))).all()}
    if random.random() < 0.01:  # keep the table small without a job of its own (like idempotency_repo)
        await conn.exec_driver_sql(_PRUNE, (float(KEEP_BATCHES_S),))
    return new


async def add(conn: AsyncConnection, minute: float, periods: dict[str, float],
              rows: dict[RowKey, list[int]]) -> None:
    """Add `rows` ((tenant, key, model) -> [requests, prompt tokens, completion tokens]) to the minute
    starting at `minute` and to each budget period in `periods` ('day'/'month' -> its start)."""
    if not rows:
        return
    ordered = sorted(rows.items())
    await conn.exec_driver_sql(_ADD_USAGE, (minute, *map(list, zip(*((t, k, m, r, p, c)
                                                                   for (t, k, m), (r, p, c) in ordered)))))
    per_key: dict[tuple[str, str], list[int]] = {}
    for (t, k, _), (r, p, c) in ordered:
        acc = per_key.setdefault((t, k), [0, 0])
        acc[0] += r
        acc[1] += p + c
    cols = list(zip(*((period, start, t, k, r, n) for period, start in sorted(periods.items())
                      for (t, k), (r, n) in sorted(per_key.items()))))
    if cols:
        await conn.exec_driver_sql(_ADD_PERIODS, tuple(map(list, cols)))


async def totals(conn: AsyncConnection, since_minute: float, periods: dict[str, float],
                 holds: Holds | None = None) -> tuple[list[MinuteTotal], list[PeriodTotal], list[HeldTotal]]:
    """The fleet's requests and tokens per tenant and key in each minute from `since_minute` on, its tokens
    in each budget period of `periods` ('day'/'month' -> its start), and the tokens held by requests in
    flight on the gateways other than `holds.gateway_id`, as their rows not expired say. `holds.held`
    replaces this gateway's own row first, counting for `holds.fresh_s` (unless `holds.write` is False).
    Now and then, rows expired for `FORGET_HOLDS_S` go."""
    minutes: list[MinuteTotal] = []
    out: list[PeriodTotal] = []
    held: list[HeldTotal] = []
    names = list(periods)
    h = holds or Holds("", {}, 0.0, write=False)
    ordered = sorted(h.held.items())
    for period, t, k, m, r, n in (await conn.exec_driver_sql(_TOTALS, (
            h.gateway_id, [s for (s, _), _ in ordered], [name for (_, name), _ in ordered],
            [v for _, v in ordered], h.fresh_s, h.write,
            since_minute, names, [periods[p] for p in names], h.gateway_id))).all():
        if period is None:
            minutes.append(MinuteTotal(t, k, m, int(r), int(n)))
        elif period == "held":
            held.append(HeldTotal(t, k, int(n)))
        else:
            out.append(PeriodTotal(t, k, period, int(n)))
    if h.write and random.random() < 0.01:  # keep the table small without a job of its own (as `claim`)
        await conn.exec_driver_sql(_PRUNE_HOLDS, (FORGET_HOLDS_S,))
    return minutes, out, held


async def forget_holds(conn: AsyncConnection, gateway_id: str) -> None:
    """A gateway stopping cleanly takes its row of holds with it."""
    await conn.exec_driver_sql(_FORGET_HOLDS, (gateway_id,))


async def report(conn: AsyncConnection, since: float, by: str, tenant: str | None = None) -> list[UsageTotal]:
    """Use since `since` (epoch seconds) summed per tenant and, by `by`: 'model', 'key' (key_id), 'day'
    (UTC, as YYYY-MM-DD) or 'tenant' (nothing more); ordered by tenant, then group."""
    group = {"model": usage.c.model, "key": usage.c.key_id,
             "day": func.to_char(func.timezone("UTC", usage.c.minute), "YYYY-MM-DD"), "tenant": None}[by]
    keys = [usage.c.tenant] + ([group] if group is not None else [])
    q = (select(*keys, func.sum(usage.c.requests), func.sum(usage.c.prompt_tokens),
                func.sum(usage.c.completion_tokens), func.max(usage.c.minute))
         .where(usage.c.minute >= _ts(since)).group_by(*keys).order_by(*keys))
    if tenant is not None:
        q = q.where(usage.c.tenant == tenant)
    out = []
    for row in (await conn.execute(q)).all():
        *names, r, p, c, last = row
        out.append(UsageTotal(names[0], names[1] if len(names) > 1 else None, int(r), int(p), int(c), last))
    return out


async def add_now(conn: AsyncConnection, rows: dict[RowKey, list[int]]) -> None:
    """`add` at the database clock's minute, day and month (UTC): what a batch's request used, written in
    the transaction that records its answer (db/batches_repo.py), so it is counted exactly once."""
    now = await db_now(conn)
    d = datetime.fromtimestamp(now, timezone.utc)
    month = datetime(d.year, d.month, 1, tzinfo=timezone.utc).timestamp()
    await add(conn, now // 60 * 60, {"day": now // 86400 * 86400, "month": month}, rows)
