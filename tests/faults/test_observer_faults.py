"""Faults on the control plane's side of liveness (issue 9): the observer fails, not the fleet. Real server,
worker, Postgres, Temporal, two simulated nodes and sim engines under client traffic. Each case asserts what
must not happen: no engine killed or restarted (pids), no replica rebuilt, no failed request where traffic
is meant to continue; and that the fleet converges when the fault ends.

Order matters only for speed: every case starts from a converged fleet, and the one that moves a replica
(one node partitioned) runs last."""

from __future__ import annotations

import time

import httpx
import psutil
import psycopg
import pytest

from tests.faults.conftest import LOST_S, NODES, UNREACHABLE_S, FaultFleet, sim_model
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

MODELS = ["alpha", "beta"]
# alpha is placed first (higher priority) on node-a, the first node by id; beta on the least loaded, node-b.
CATALOG = {"models": [sim_model("alpha", priority=1), sim_model("beta")]}


@pytest.fixture(scope="module")
def fleet(infra, tmp_path_factory):
    f = FaultFleet(tmp_path_factory.mktemp("observer"), infra).start()
    try:
        assert f.cp.apply(CATALOG).status_code == 200
        serving = f.steady(MODELS)
        assert {m: node for m, (_, node, _) in serving.items()} == {"alpha": "node-a", "beta": "node-b"}
        yield f
    finally:
        f.close()


def replica_statuses(fleet: FaultFleet) -> dict[str, str]:
    """Straight from Postgres: what the control plane has decided, even while its server is frozen."""
    with psycopg.connect(fleet.infra.pg.url) as conn:
        return dict(conn.execute("SELECT id, status FROM replicas").fetchall())


def assert_untouched(fleet: FaultFleet, before: dict) -> None:
    after = fleet.serving()
    assert after == before, f"replicas or engines changed: {before} -> {after}"
    for _, _, pid in after.values():
        assert psutil.pid_exists(pid)
    assert set(replica_statuses(fleet).values()) == {"ready"}, replica_statuses(fleet)


def test_node_api_frozen_for_twice_lost_after_tears_nothing_down(fleet):
    """The `llmgw server` process and its node API child are frozen (SIGSTOP) for 2 × node_lost_after_s: no
    heartbeat arrives. Its pollers still show every node alive, and the node API's own ticks stop, so the
    missing heartbeats are the observer's fault: no node is declared lost, no engine is touched."""
    before = fleet.steady(MODELS)
    with fleet.traffic(MODELS) as t:
        t.paused.set()  # the frozen process is the gateway too: clients cannot be served meanwhile
        time.sleep(0.5)
        server = fleet.freeze("server")
        try:
            time.sleep(2 * LOST_S)
            assert set(replica_statuses(fleet).values()) == {"ready"}  # decided nothing while frozen
        finally:
            fleet.thaw(server)
        resumed = time.monotonic()
        t.paused.clear()
        wait_until(lambda: all(n["status"] == "ready" for n in fleet.nodes().values()), timeout_s=30,
                   what="nodes ready after the server resumed")
        time.sleep(LOST_S / 2)  # several reconcile passes with the heartbeats catching up
    assert_untouched(fleet, before)
    for m in MODELS:
        assert t.count(m, since=resumed) > 5 and t.failures(m, since=resumed) == [], t.failures(m, since=resumed)
    shown = fleet.cp.ctl("nodes")
    lines = shown.stdout.splitlines()
    assert shown.returncode == 0 and "LAST SEEN" in lines[0] and "POLLERS" in lines[0], shown.stdout
    rows = [line for line in lines[1:] if line.split()[:1] and line.split()[0] in NODES]
    assert len(rows) == len(NODES) and all("heartbeats " in r and "pollers " in r for r in rows), shown.stdout
    assert all("polling, read " in r for r in rows), shown.stdout  # POLLERS: what the witness last read


def test_postgres_stopped_for_twice_lost_after_traffic_continues(fleet):
    """Postgres is stopped for 2 × node_lost_after_s, then started again. The gateway keeps serving from
    the route table it holds (zero failed requests), nothing decides anything while the database is away,
    and after it returns no node is taken for lost: the node API could not record heartbeats meanwhile."""
    before = fleet.steady(MODELS)
    with fleet.traffic(MODELS) as t:
        started = time.monotonic()
        time.sleep(1)
        fleet.infra.stop_postgres()
        try:
            time.sleep(2 * LOST_S)
        finally:
            fleet.infra.start_postgres()
        wait_until(lambda: all(n["status"] == "ready" for n in fleet.nodes().values()), timeout_s=30,
                   what="nodes ready after Postgres returned")
        time.sleep(LOST_S / 2)
    assert_untouched(fleet, before)
    for m in MODELS:
        assert t.count(m, since=started) > 20 and t.failures(m, since=started) == [], t.failures(m, since=started)


def test_every_node_partitioned_the_observer_is_doubted(fleet):
    """Both nodes are cut off (heartbeats and pollers) for 2 × node_lost_after_s. Every node silent at once
    is likelier the control plane's own fault: they are Unreachable (not routed to; the gateway says so)
    but none is declared lost, `ctl explain` says why, and when the partition heals, one node after the
    other, the same engines serve."""
    before = fleet.steady(MODELS)
    cut = time.monotonic()
    for n in NODES:
        fleet.partition(n)
    try:
        wait_until(lambda: all(n["status"] == "unreachable" for n in fleet.nodes().values()),
                   timeout_s=UNREACHABLE_S + 15, what="both nodes unreachable")

        def refused():  # the gateway's route table follows within its refresh interval
            r = httpx.post(fleet.cp.gateway + "/v1/chat/completions", timeout=30, json={
                "model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            return r if r.status_code != 200 else None
        r = wait_until(refused, timeout_s=10, what="the gateway to stop routing to unreachable nodes")
        assert r.status_code == 503 and "node-a, which the control plane cannot reach" in r.json()["error"]["message"], r.text
        time.sleep(max(0.0, cut + 2 * LOST_S - time.monotonic()))
        assert set(replica_statuses(fleet).values()) == {"ready"}

        def held():  # the latest pass's explanation; a pass on a loaded machine may lag a little
            assert set(replica_statuses(fleet).values()) == {"ready"}  # nothing declared lost meanwhile
            explained = "\n".join(fleet.cp.explain("alpha")["decisions"])
            return explained if "2 of 2 nodes are silent together" in explained else None
        explained = wait_until(held, timeout_s=15, what="ctl explain alpha to say why node-a is held",
                               why=lambda: f"{fleet.cp.explain('alpha')}\n{fleet.cp.ctl('nodes').stdout}")
        assert "replica " in explained and "on silent node node-a" in explained, explained
        assert "nothing is torn down" in explained, explained
        shown = fleet.cp.ctl("nodes").stdout
        assert "not declared lost" in shown, shown
        listed = fleet.cp.ctl("replicas").stdout
        assert "node node-a unreachable: not routed to" in listed and "node node-b unreachable" in listed, listed
        # The partition heals one node at a time, as nodes come back on their own backoff: node-b first.
        # node-a, silent far longer than node_lost_after_s, is now one silent node of two, but it gets
        # node_lost_after_s afresh from the end of the doubt: it is not lost for being the last back.
        fleet.heal("node-b")
        wait_until(lambda: fleet.nodes()["node-b"]["status"] == "ready", timeout_s=30, what="node-b back")
        time.sleep(LOST_S / 2)
        assert set(replica_statuses(fleet).values()) == {"ready"}
        assert "the observer was in doubt" in fleet.cp.ctl("nodes").stdout
    finally:
        for n in NODES:
            fleet.heal(n)
    assert fleet.steady(MODELS) == before
    assert_untouched(fleet, before)


def test_one_node_partitioned_only_its_replicas_move(fleet):
    """node-b alone is cut off past node_lost_after_s: it is lost, its replica is rebuilt on node-a, and
    node-a's replica is untouched and serves every request throughout. When the partition heals, node-b
    comes back and the engine of its lost replica is stopped."""
    before = fleet.steady(MODELS)
    (alpha_id, _, alpha_pid), (beta_id, beta_node, beta_pid) = before["alpha"], before["beta"]
    assert beta_node == "node-b"
    with fleet.traffic(["alpha"]) as t:
        cut = time.monotonic()
        fleet.partition("node-b")
        try:
            [moved] = fleet.cp.wait_replicas("beta", exclude={beta_id}, timeout_s=LOST_S + 60)
            assert time.monotonic() - cut >= LOST_S
            assert moved["node_id"] == "node-a"
            # The replacement's start and the lost replica's stop run side by side: either may land first.
            wait_until(lambda: replica_statuses(fleet)[beta_id] == "lost", timeout_s=15,
                       what="the replica on node-b marked lost", why=lambda: replica_statuses(fleet))
        finally:
            fleet.heal("node-b")
        wait_until(lambda: fleet.nodes()["node-b"]["status"] == "ready", timeout_s=30, what="node-b back")
        wait_until(lambda: not psutil.pid_exists(beta_pid) or psutil.Process(beta_pid).status() == psutil.STATUS_ZOMBIE,
                   timeout_s=60, what="the lost replica's engine stopped on node-b")
    assert t.count("alpha") > 20 and t.failures("alpha") == [], t.failures("alpha")
    after = fleet.steady(MODELS)
    assert after["alpha"] == (alpha_id, "node-a", alpha_pid) and psutil.pid_exists(alpha_pid)
    assert after["beta"][0] == moved["id"]
    assert [r["id"] for r in fleet.replicas("alpha")] == [alpha_id]
