"""Token usage (issue 15). All SQL for `usage` and `usage_periods` lives here.

Every gateway adds its counts of the last second, additively (INSERT ... ON CONFLICT DO UPDATE SET n = n +
excluded.n), to one `usage` row per minute, tenant, key and model and to one `usage_periods` row per budget
period and key, then reads the fleet's totals back in the same transaction (gateway/quotas.py). Rows are
written in sorted order, so two gateways adding to the same rows lock them in the same order and never
deadlock. A key of no tenant is stored with tenant ''.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import func, or_, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.db.tables import usage, usage_periods

RowKey = tuple[str, str, str]  # (tenant or '', key id, model)


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


def _ts(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, timezone.utc)


async def db_now(conn: AsyncConnection) -> float:
    """The database clock (the transaction's start), in epoch seconds."""
    return float((await conn.execute(select(func.extract("epoch", func.now())))).scalar_one())


def _upsert_usage():
    ins = insert(usage)
    return ins.on_conflict_do_update(
        index_elements=[usage.c.minute, usage.c.tenant, usage.c.key_id, usage.c.model],
        set_={"requests": usage.c.requests + ins.excluded.requests,
              "prompt_tokens": usage.c.prompt_tokens + ins.excluded.prompt_tokens,
              "completion_tokens": usage.c.completion_tokens + ins.excluded.completion_tokens})


def _upsert_periods():
    ins = insert(usage_periods)
    return ins.on_conflict_do_update(
        index_elements=[usage_periods.c.period, usage_periods.c.starts_at, usage_periods.c.tenant,
                        usage_periods.c.key_id],
        set_={"requests": usage_periods.c.requests + ins.excluded.requests,
              "tokens": usage_periods.c.tokens + ins.excluded.tokens})


# Built once: executed with a list of parameter sets (executemany), so SQLAlchemy compiles each once.
_UPSERT_USAGE = _upsert_usage()
_UPSERT_PERIODS = _upsert_periods()


async def add(conn: AsyncConnection, minute: float, periods: dict[str, float],
              rows: dict[RowKey, list[int]]) -> None:
    """Add `rows` ((tenant, key, model) -> [requests, prompt tokens, completion tokens]) to the minute
    starting at `minute` and to each budget period in `periods` ('day'/'month' -> its start)."""
    if not rows:
        return
    at = _ts(minute)
    await conn.execute(_UPSERT_USAGE, [dict(minute=at, tenant=t, key_id=k, model=m, requests=r, prompt_tokens=p,
                                            completion_tokens=c) for (t, k, m), (r, p, c) in sorted(rows.items())])
    per_key: dict[tuple[str, str], list[int]] = {}
    for (t, k, _), (r, p, c) in rows.items():
        acc = per_key.setdefault((t, k), [0, 0])
        acc[0] += r
        acc[1] += p + c
    await conn.execute(_UPSERT_PERIODS, [dict(period=period, starts_at=_ts(start), tenant=t, key_id=k, requests=r,
                                              tokens=n) for period, start in sorted(periods.items())
                                         for (t, k), (r, n) in sorted(per_key.items())])


async def totals(conn: AsyncConnection, since_minute: float,
                 periods: dict[str, float]) -> tuple[list[MinuteTotal], list[PeriodTotal]]:
    """The fleet's requests and tokens per tenant and key in each minute from `since_minute` on, and its
    tokens in each budget period of `periods` ('day'/'month' -> its start)."""
    q = (select(usage.c.tenant, usage.c.key_id, func.extract("epoch", usage.c.minute), func.sum(usage.c.requests),
                func.sum(usage.c.prompt_tokens + usage.c.completion_tokens))
         .where(usage.c.minute >= _ts(since_minute))
         .group_by(usage.c.tenant, usage.c.key_id, usage.c.minute))
    minutes = [MinuteTotal(t, k, float(m), int(r), int(n)) for t, k, m, r, n in (await conn.execute(q)).all()]
    out: list[PeriodTotal] = []
    if periods:
        q = (select(usage_periods.c.tenant, usage_periods.c.key_id, usage_periods.c.period, usage_periods.c.tokens)
             .where(or_(*((usage_periods.c.period == p) & (usage_periods.c.starts_at == _ts(s))
                          for p, s in periods.items()))))
        out = [PeriodTotal(t, k, p, int(n)) for t, k, p, n in (await conn.execute(q)).all()]
    return minutes, out


async def report(conn: AsyncConnection, since: float, by: str, tenant: str | None = None) -> list[dict]:
    """Use since `since` (epoch seconds) summed per tenant and, by `by`: 'model', 'key' (key_id), 'day'
    (UTC, as YYYY-MM-DD) or 'tenant' (nothing more). Rows: tenant, group, requests, prompt_tokens,
    completion_tokens, last_at; ordered by tenant, then group."""
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
        out.append({"tenant": names[0], "group": names[1] if len(names) > 1 else None, "requests": int(r),
                    "prompt_tokens": int(p), "completion_tokens": int(c), "last_at": last})
    return out
