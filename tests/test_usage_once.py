"""Usage is counted once when a sync's COMMIT reaches Postgres but its answer does not (issue 37), on a real
Postgres through the real `Quotas.sync`: a TCP relay between the gateway and Postgres forwards the COMMIT
and drops the connection instead of passing Postgres's answer on. Before, the gateway took the error for
"not written" and added the same counts again at the next sync: the tenant was billed twice."""

from __future__ import annotations

import asyncio
import json
import struct
from urllib.parse import urlsplit

import psycopg
import pytest

from llmgw.db.engine import async_engine
from llmgw.db.keys_repo import ActiveKey
from llmgw.gateway.quotas import Quotas
from llmgw.schemas.catalog import Model
from llmgw.telemetry import GatewayMetrics

pytestmark = pytest.mark.integration

MODEL = Model(name="m", endpoints=["http://127.0.0.1:9"])
REQ = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class CommitCutter:
    """A TCP relay to Postgres. Armed (`cut`), at the next COMMIT it either forwards it and drops the
    client's connection in place of Postgres's answer ("after": committed, the client sees an error), or
    drops the connection without forwarding it ("before": not committed, the same error)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.cut: str | None = None
        self.cuts = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.server.close()

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        sreader, swriter = await asyncio.open_connection(self.host, self.port)
        dropping = asyncio.Event()  # the COMMIT went on: Postgres's next bytes are its answer, not relayed

        def drop() -> None:
            self.cuts += 1
            cwriter.transport.abort()
            swriter.transport.abort()

        async def to_server() -> None:
            first = True  # the startup message has no type byte
            while True:
                kind = b"" if first else await creader.readexactly(1)
                first = False
                head = await creader.readexactly(4)
                body = await creader.readexactly(struct.unpack("!i", head)[0] - 4)
                if self.cut and kind == b"Q" and body.lstrip().upper().startswith(b"COMMIT"):
                    mode, self.cut = self.cut, None
                    if mode == "before":
                        drop()
                        return
                    dropping.set()
                swriter.write(kind + head + body)
                await swriter.drain()

        async def to_client() -> None:
            while data := await sreader.read(65536):
                if dropping.is_set():
                    drop()  # Postgres committed and answered; the client never hears it
                    return
                cwriter.write(data)
                await cwriter.drain()

        tasks = [asyncio.ensure_future(to_server()), asyncio.ensure_future(to_client())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        cwriter.transport.abort()
        swriter.transport.abort()


def serve(q: Quotas, acct, n: int, prompt: int, completion: int) -> None:
    for _ in range(n):
        meter, _, _ = q.admit(acct, MODEL, REQ, b"{}")
        meter.body(json.dumps({"usage": {"prompt_tokens": prompt, "completion_tokens": completion}}).encode())
        q.settle(meter)


def stored(database_url: str) -> tuple[int, int, int]:
    """(requests, tokens) in `usage`, and the day's tokens in `usage_periods`."""
    with psycopg.connect(database_url) as conn:
        r, t = conn.execute("SELECT coalesce(sum(requests), 0), coalesce(sum(prompt_tokens + completion_tokens), 0) "
                            "FROM usage").fetchone()
        d = conn.execute("SELECT coalesce(sum(tokens), 0) FROM usage_periods WHERE period = 'day'").fetchone()[0]
    return int(r), int(t), int(d)


@pytest.fixture
async def relayed(database_url):
    u = urlsplit(database_url)
    cutter = CommitCutter(u.hostname, u.port)
    port = await cutter.start()
    auth = u.username + (f":{u.password}" if u.password else "")  # the test Postgres wants its password
    engine = async_engine(f"postgresql://{auth}@127.0.0.1:{port}{u.path}?sslmode=disable&gssencmode=disable")
    try:
        yield cutter, engine
    finally:
        await engine.dispose()
        await cutter.close()


@pytest.mark.parametrize("mode", ["after", "before"])
async def test_a_commit_whose_answer_is_lost_is_counted_once(database_url, relayed, mode):
    cutter, engine = relayed
    q = Quotas(engine, GatewayMetrics())
    acct = q.rebuild({"team": {"tokens_per_day": 10**6}}, [ActiveKey("k1", "h1", "team", {})])["k1"]
    await q.sync()  # connected, and the clock offset known
    serve(q, acct, 5, 3, 7)
    cutter.cut = mode
    with pytest.raises(Exception):
        await q.sync()
    assert cutter.cuts == 1
    # "after": Postgres has the five requests although the gateway saw an error; "before": it has none.
    assert stored(database_url) == ((5, 50, 50) if mode == "after" else (0, 0, 0))
    serve(q, acct, 2, 3, 7)
    await q.sync()  # the retry: the lost batch again (same id) and the two served since
    assert stored(database_url) == (7, 70, 70)  # what was served, once
    assert q.backlog == []
    await q.sync()
    assert stored(database_url) == (7, 70, 70)
    tenant = q.scopes[("tenant", "team")]
    assert tenant.day.used_now(q.now()) == 70  # the budget the gateway judges by, too
