"""Counts kept while Postgres cannot be reached are written, when it is back, to the minutes they were
counted in and to those minutes' budget periods, on a real Postgres (gateway/quotas.py `sync`). Before,
the whole backlog went into the minute Postgres came back in: a tenant that kept working through a
ten-minute outage at 60 requests a minute, under an rpm of 100, was then refused fleet-wide ("used 600")
for two minutes, and an outage across midnight charged yesterday's tokens to today's budget."""

from __future__ import annotations

import json

import psycopg
import pytest

from llmgw.db.engine import async_engine
from llmgw.db.keys_repo import ActiveKey
from llmgw.dev.procs import free_port
from llmgw.gateway.quotas import Quotas
from llmgw.schemas.catalog import Model
from llmgw.telemetry import GatewayMetrics

pytestmark = pytest.mark.integration

MODEL = Model(name="m", endpoints=["http://127.0.0.1:9"])
REQ = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_backlog_goes_to_the_minutes_and_days_it_was_counted_in(database_url):
    db = async_engine(database_url)
    away = async_engine(f"postgresql://postgres@127.0.0.1:{free_port()}/nothing")  # Postgres out of reach
    q = Quotas(away, GatewayMetrics(), day_s=3600.0)  # hour-long "days": an outage across one's turn
    acct = q.rebuild({"team": {"rpm": 100, "tokens_per_day": 10**6}}, [ActiveKey("k1", "h1", "team", {})])["k1"]
    with psycopg.connect(database_url) as conn:
        db_now = float(conn.execute("SELECT extract(epoch FROM now())").fetchone()[0])
    start = (db_now // 3600 - 2) * 3600 + 3000  # 50 minutes into an hour ("day"), two hours ago
    clock = [start]
    q.clock = lambda: clock[0]
    try:
        for minute in range(20):  # 20 minutes away, 60 requests a minute, across the "day"'s turn
            for i in range(60):
                clock[0] = start + minute * 60 + i
                meter, _, _ = q.admit(acct, MODEL, REQ, b"{}")
                meter.body(json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode())
                q.settle(meter)
            with pytest.raises(Exception):
                await q.sync()
        assert sum(r[0] for b in q.backlog for r in b.rows.values()) == 1200  # all kept
        assert len(q.backlog) == 20  # one batch a minute: nothing was sent to a COMMIT, so they merge
        q.engine = db  # Postgres is back (this host's clock was two hours behind the database's)
        await q.sync()
        assert q.backlog == []
        with psycopg.connect(database_url) as conn:
            minutes = conn.execute("SELECT extract(epoch FROM minute)::float8, requests FROM usage ORDER BY 1").fetchall()
            periods = conn.execute("SELECT extract(epoch FROM starts_at)::float8, tokens FROM usage_periods "
                                   "WHERE period = 'day' ORDER BY 1").fetchall()
        assert [r for _, r in minutes] == [60] * 20  # one row a minute, each in its own minute
        assert [m for m, _ in minutes] == [start // 60 * 60 + 60 * i for i in range(20)]
        turn = (start // 3600 + 1) * 3600  # 10 minutes in
        assert periods == [(turn - 3600, 10 * 60 * 2), (turn, 10 * 60 * 2)]  # each "day" its own tokens
        # And the tenant is not shut out: the windows read the last two minutes, which hold none of it.
        q.admit(acct, MODEL, REQ, b"{}")
    finally:
        await db.dispose()
        await away.dispose()
