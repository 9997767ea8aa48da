"""Crash faults (issue 38, item 7): a process killed outright, in the middle of what it was doing. Real server,
worker, PostgreSQL, Temporal, two simulated nodes, sim engines and client traffic. Each case asserts what must
not happen: no healthy engine killed (pids), no replica rebuilt, no client request failed, nothing written
half or twice.

The fleet has a database of its own: it creates a tenant and an API key, which the suite's other fleets must
not see (a key makes their gateways want keys)."""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import psycopg
import pytest

from tests.faults.conftest import FaultFleet, sim_model
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

ALPHA, BETA = sim_model("alpha", priority=1), sim_model("beta")
MODELS = ["alpha", "beta"]


@pytest.fixture(scope="module")
def fleet(infra, tmp_path_factory):
    # Keys are not required (the other modules' steady() sends none), but an accounted key is counted.
    f = FaultFleet(tmp_path_factory.mktemp("crash"), infra, database="crash_faults", LLMGW_REQUIRE_API_KEY="false",
                   LLMGW_USAGE_SYNC_S="0.5").start()
    try:
        assert f.cp.apply({"models": [ALPHA, BETA]}).status_code == 200
        f.steady(MODELS)
        yield f
    finally:
        f.close()


def admin(fleet: FaultFleet, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, fleet.cp.admin + path, json=body, timeout=30, headers=fleet.cp.admin_headers)


def waiting_on_locks(fleet: FaultFleet) -> list[str]:
    """The statements of every backend now waiting for a lock."""
    with psycopg.connect(fleet.db_url) as conn:
        return [q for (q,) in conn.execute("SELECT query FROM pg_stat_activity WHERE wait_event_type = 'Lock'")]


def test_postgres_killed_mid_write_recovers_with_nothing_half_written_or_counted_twice(fleet):
    """PostgreSQL is SIGKILLed (with every backend: a crash, not a shutdown) while three writers are each in
    the middle of their transaction: a catalog apply (one model inserted, blocked on the next), the
    reconciler saving a pass (its decisions written, blocked on the pass record) and a gateway's usage sync
    (its batch claimed and its minute rows added, blocked on the period rows). The test holds the rows they
    wait for, so each is caught between two of its writes. Then it is started again on the same data.

    Meanwhile the gateway serves every request from the route table and keys it holds (zero failures,
    docs/architecture.md's fault table); the apply is answered with an error, not a 200, and none of it is
    stored; the pass is done again; the usage the sync could not write is written once: the stored requests
    equal the answered ones. No engine is killed or replica rebuilt, and the control plane works again: the
    same apply then succeeds and its new model serves."""
    before = fleet.steady(MODELS)
    assert admin(fleet, "POST", "/admin/v1/tenants", {"name": "acme", "limits": {}}).status_code == 200
    created = admin(fleet, "POST", "/admin/v1/keys", {"name": "acme-1", "tenant": "acme", "limits": {}})
    assert created.status_code == 200, created.text
    key_id, key = created.json()["id"], {"Authorization": f"Bearer {created.json()['key']}"}

    def usage() -> tuple[int, int]:  # requests stored for the key: per minute, and in its day's period
        with psycopg.connect(fleet.db_url) as conn:
            [(minutes,)] = conn.execute("SELECT coalesce(sum(requests), 0) FROM usage WHERE key_id = %s", (key_id,))
            [(day,)] = conn.execute("SELECT coalesce(sum(requests), 0) FROM usage_periods "
                                    "WHERE key_id = %s AND period = 'day'", (key_id,))
        return int(minutes), int(day)

    new_catalog = {"models": [sim_model("gamma"), ALPHA, BETA]}  # gamma is written first, then alpha's row
    applied: dict[str, object] = {}
    with fleet.traffic(MODELS, headers=key) as t:  # only these requests are the key's (steady() sends none)
        wait_until(lambda: usage()[1] > 0, timeout_s=30, what="the key's usage synced once", why=fleet.cp.logs)
        locker = psycopg.connect(fleet.db_url)
        locker.execute("SELECT 1 FROM catalog_models WHERE name = 'alpha' FOR UPDATE")
        locker.execute("SELECT 1 FROM reconciler_state WHERE id = 1 FOR UPDATE")
        locker.execute("SELECT 1 FROM usage_periods WHERE key_id = %s FOR UPDATE", (key_id,))

        def apply():
            try:
                applied["response"] = fleet.cp.apply(new_catalog)
            except httpx.HTTPError as exc:
                applied["response"] = exc
        applier = threading.Thread(target=apply, daemon=True)
        applier.start()

        def caught() -> list[str] | None:
            queries = waiting_on_locks(fleet)
            writers = [w for w in ("INSERT INTO catalog_models", "INSERT INTO reconciler_state", "INSERT INTO usage_periods")
                       if any(w in q for q in queries)]
            return queries if len(writers) == 3 else None
        wait_until(caught, timeout_s=30, what="the three writers each waiting inside its transaction",
                   why=lambda: waiting_on_locks(fleet))
        killed = time.monotonic()
        fleet.infra.kill_postgres()
        time.sleep(2)  # down a while: requests keep coming
        fleet.infra.start_postgres()
        applier.join(30)
        answer = applied.get("response")
        assert isinstance(answer, httpx.Response) and answer.status_code == 503, answer
        assert "database" in answer.json()["error"]["message"].lower(), answer.text

        with psycopg.connect(fleet.db_url) as conn:  # nothing of the apply was kept
            names = [n for (n,) in conn.execute("SELECT name FROM catalog_models ORDER BY position")]
            states = {n for (n,) in conn.execute("SELECT name FROM model_state")}
        assert names == MODELS and "gamma" not in states, (names, states)
        after = fleet.steady(MODELS, timeout_s=60)  # passes complete again on the recovered database
    assert t.failures("alpha") == [] and t.failures("beta") == [], (t.failures("alpha"), t.failures("beta"))
    assert t.count("alpha", since=killed) > 5 and t.count("beta", since=killed) > 5
    assert after == before, f"replicas or engines changed: {before} -> {after}"
    assert all(psutil.pid_exists(pid) for _, _, pid in after.values())
    assert sorted(r["model"] for r in fleet.replicas()) == MODELS  # nothing rebuilt
    answered = t.answered()
    wait_until(lambda: usage() == (answered, answered), timeout_s=15, what=f"usage of {answered} requests",
               why=lambda: f"stored (minutes, day) {usage()}\n{fleet.cp.logs()}")
    time.sleep(1.5)  # a few more syncs: nothing is added again
    assert usage() == (answered, answered)

    assert fleet.cp.apply(new_catalog).status_code == 200
    assert fleet.steady(["gamma", *MODELS])["alpha"] == before["alpha"]
    assert fleet.cp.apply({"models": [ALPHA, BETA]}).status_code == 200
