"""What sharing holds fleet-wide adds to the usage sync (issue 37): the real `Quotas.sync` against an
embedded PostgreSQL, three ways alternated in blocks within the same minutes.

- `before`: the totals statement as it was (no `usage_holds`: the minute and period totals only);
- `read`: the statement now, this gateway holding nothing (its row not written; the others' read);
- `write`: the statement now, this gateway holding tokens for its tenant and key (its row replaced each sync).

Another gateway's row of holds is there throughout, so `read` and `write` read one back. One tenant and
one key with token limits, a request counted between syncs (as an active gateway's sync writes usage). It
prints the CPU per sync of this process (the gateway's side) and of PostgreSQL's processes, and wall time.

Run: `.venv/bin/python bench/holds_sync.py [--syncs 50 --rounds 8]` (about half a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import psutil

from llmgw.db import usage_repo
from llmgw.db.engine import async_engine
from llmgw.db.keys_repo import ActiveKey
from llmgw.db.migrate import upgrade
from llmgw.dev.postgres import EmbeddedPostgres
from llmgw.dev.procs import free_port
from llmgw.gateway.quotas import Quotas
from llmgw.schemas.catalog import Model
from llmgw.telemetry import GatewayMetrics

MODEL = Model(name="m", endpoints=["http://127.0.0.1:9"])
REQ = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
_BEFORE = """
SELECT NULL, tenant, key_id, extract(epoch FROM minute)::float8, sum(requests)::bigint,
       sum(prompt_tokens + completion_tokens)::bigint
FROM usage WHERE minute >= to_timestamp(%s) GROUP BY tenant, key_id, minute
UNION ALL
SELECT u.period, u.tenant, u.key_id, NULL, NULL, u.tokens
FROM usage_periods u JOIN unnest(%s::text[], %s::float8[]) AS x(p, s)
    ON u.period = x.p AND u.starts_at = to_timestamp(x.s)
"""
_now = usage_repo.totals


async def _before(conn, since_minute, periods, holds=None):
    minutes, out = [], []
    names = list(periods)
    for period, t, k, m, r, n in (await conn.exec_driver_sql(
            _BEFORE, (since_minute, names, [periods[p] for p in names]))).all():
        if period is None:
            minutes.append(usage_repo.MinuteTotal(t, k, m, int(r), int(n)))
        else:
            out.append(usage_repo.PeriodTotal(t, k, period, int(n)))
    return minutes, out, []


def pg_cpu(pg: psutil.Process) -> float:
    total = 0.0
    for p in [pg, *pg.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def quotas(engine, limits: dict) -> tuple[Quotas, object]:
    q = Quotas(engine, GatewayMetrics())
    acct = q.rebuild({"team": limits}, [ActiveKey("k1", "h1", "team", {"tpm": 10**9})])["k1"]
    return q, acct


def serve_one(q: Quotas, acct) -> None:
    meter, _, _ = q.admit(acct, MODEL, REQ, b"{}", prompt_chars=8)
    meter.body(json.dumps({"usage": {"prompt_tokens": 2, "completion_tokens": 5}}).encode())
    q.settle(meter)


async def run(url: str, pg: psutil.Process, syncs: int, rounds: int) -> None:
    engine = async_engine(url)
    limits = {"tokens_per_month": 10**12, "tpm": 10**9}
    other, other_acct = quotas(engine, limits)
    other.admit(other_acct, MODEL, REQ, b"{}", prompt_chars=8)  # in flight throughout: its row is read back
    await other.sync()
    q, acct = quotas(engine, limits)
    holding = None
    results: dict[str, list[tuple[float, float, float]]] = {"before": [], "read": [], "write": []}
    for _ in range(3):
        await q.sync()  # warm: connected, statements prepared
    for _ in range(rounds):
        for mode in results:
            usage_repo.totals = _before if mode == "before" else _now  # type: ignore[assignment]
            if mode == "write" and holding is None:
                holding, _, _ = q.admit(acct, MODEL, REQ, b"{}", prompt_chars=8)
            if mode != "write" and holding is not None:
                q.settle(holding)
                holding = None
                await q.sync()  # the row written empty once
            cpu0, pg0, t0 = time.process_time(), pg_cpu(pg), time.perf_counter()
            for _ in range(syncs):
                serve_one(q, acct)
                await q.sync()
            results[mode].append(((time.process_time() - cpu0) / syncs * 1e3, (pg_cpu(pg) - pg0) / syncs * 1e3,
                                  (time.perf_counter() - t0) / syncs * 1e3))
    usage_repo.totals = _now  # type: ignore[assignment]
    await engine.dispose()
    base = [sum(x[i] for x in results["before"]) / rounds for i in range(3)]
    print(f"{syncs} syncs x {rounds} rounds per mode, alternated; per sync (ms), and / before:")
    print(f"{'':8} {'gateway CPU':>18} {'PostgreSQL CPU':>18} {'wall':>18}")
    for mode, xs in results.items():
        avg = [sum(x[i] for x in xs) / rounds for i in range(3)]
        print(f"{mode:8} " + " ".join(f"{a:8.3f} ({a / b:5.3f})".rjust(18) for a, b in zip(avg, base)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncs", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-holds-"))
    pg = EmbeddedPostgres(root / "data", free_port(), root / "postgres.log", database="bench", durable=False)
    try:
        pg.start()
        upgrade(pg.url)
        asyncio.run(run(pg.url, psutil.Process(pg.proc.pid), args.syncs, args.rounds))
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
