"""What requests in flight hold is shared fleet-wide (issue 37), on a real Postgres through the real
`Quotas.sync` of two gateways' quotas: before, each gateway judged the fleet's used tokens plus only what its
own requests held, so two gateways each admitted requests holding all that was left of a budget. Now each
publishes its holds in its sync, and the other judges by them from its next sync on, until they expire."""

from __future__ import annotations

import asyncio
import json

import psycopg
import pytest

from llmgw.db.engine import async_engine
from llmgw.db.keys_repo import ActiveKey
from llmgw.gateway.quotas import HOLDS_FRESH_SYNCS, Quotas
from llmgw.http.errors import APIError
from llmgw.schemas.catalog import Model
from llmgw.telemetry import GatewayMetrics

pytestmark = pytest.mark.integration

MODEL = Model(name="m", endpoints=["http://127.0.0.1:9"])


def req(max_tokens: int) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}


@pytest.fixture
async def engine(database_url):
    e = async_engine(database_url)
    try:
        yield e
    finally:
        await e.dispose()


def gateway(engine, sync_s: float = 1.0) -> tuple[Quotas, object]:
    q = Quotas(engine, GatewayMetrics(), sync_s=sync_s)
    acct = q.rebuild({"team": {"tokens_per_month": 1000}}, [ActiveKey("k1", "h1", "team", {})])["k1"]
    return q, acct


def holds_rows(database_url: str) -> dict[str, dict]:
    with psycopg.connect(database_url) as conn:
        return {g: dict(zip((f"{s}:{n}" for s, n in zip(scopes, names)), held))
                for g, scopes, names, held in conn.execute("SELECT gateway_id, scopes, names, held FROM usage_holds")}


async def test_a_gateway_judges_by_what_the_others_requests_hold_from_its_next_sync(database_url, engine):
    a, acct_a = gateway(engine)
    b, acct_b = gateway(engine)
    await a.sync()
    await b.sync()
    m1, _, _ = a.admit(acct_a, MODEL, req(600), b"{}", prompt_chars=4)  # holds 1 + 600
    assert m1.held == 601
    await a.sync()
    assert holds_rows(database_url) == {a.gateway_id: {"tenant:team": 601}}
    await b.sync()
    tenant_b = b.scopes[("tenant", "team")]
    assert tenant_b.others == 601 and tenant_b.held == 0
    # b cuts its next request to what both leave (1000 - 601 - its prompt's 1 = 398), not to 999
    _, sent, _ = b.admit(acct_b, MODEL, req(900), b"{}", prompt_chars=4)
    assert sent["max_tokens"] == 398
    with pytest.raises(APIError) as e:  # and then the budget is held in full across the two
        b.admit(acct_b, MODEL, req(10), b"{}", prompt_chars=4)
    assert e.value.code == "rate_limit_exceeded" and "601 of them on other gateways" in e.value.message, e.value.message

    # a's request ends having used 50: the same sync writes its 51 tokens and drops its hold
    m1.body(json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 50}}).encode())
    a.settle(m1)
    await a.sync()
    assert holds_rows(database_url)[a.gateway_id] == {}  # emptied once, then no longer written
    await b.sync()
    assert tenant_b.others == 0 and tenant_b.month.used == 51
    await b.sync()
    assert holds_rows(database_url)[b.gateway_id] == {"tenant:team": 399}
    await b.close()  # a clean stop takes its row with it
    assert b.gateway_id not in holds_rows(database_url)


async def test_a_gateway_that_stops_syncing_holds_nothing_once_its_row_expires(database_url, engine):
    """A gateway killed with requests in flight never releases their holds: the others count them only
    until `expires_at`, `HOLDS_FRESH_SYNCS` of its sync intervals after its last sync."""
    dead, acct_dead = gateway(engine, sync_s=0.1)  # its holds count for 1 s after each sync
    live, acct_live = gateway(engine)
    dead.admit(acct_dead, MODEL, req(999), b"{}", prompt_chars=4)  # holds the whole budget
    await dead.sync()
    await live.sync()
    with pytest.raises(APIError) as e:
        live.admit(acct_live, MODEL, req(10), b"{}", prompt_chars=4)
    assert "1000 held by requests in flight" in e.value.message, e.value.message
    await asyncio.sleep(HOLDS_FRESH_SYNCS * 0.1 + 0.2)  # `dead` never syncs again
    await live.sync()
    assert live.scopes[("tenant", "team")].others == 0
    _, sent, _ = live.admit(acct_live, MODEL, req(10), b"{}", prompt_chars=4)
    assert sent == req(10)
