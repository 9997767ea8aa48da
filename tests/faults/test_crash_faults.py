"""Crash faults (issue 38, item 7): a process killed outright, in the middle of what it was doing. Real server,
worker, PostgreSQL, Temporal, two simulated nodes, sim engines and client traffic. Each case asserts what must
not happen: no healthy engine killed (pids), no replica rebuilt, no client request failed, nothing written
half or twice.

The fleet has a database of its own: it creates a tenant and an API key, which the suite's other fleets must
not see (a key makes their gateways want keys)."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import psycopg
import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from tests.faults.conftest import NODES, FaultFleet, sim_model
from tests.faults.slow_source import SlowSource
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

ALPHA, BETA = sim_model("alpha", priority=1), sim_model("beta")
MODELS = ["alpha", "beta"]


@pytest.fixture(scope="module")
def fleet(infra, tmp_path_factory):
    # Keys are not required (the other modules' steady() sends none), but an accounted key is counted.
    # Nodes are Unreachable after 20 s here, not 4: an agent restarted on a loaded machine may take 15 s to
    # register, and these cases assert that the replicas beside the fault serve every request meanwhile.
    f = FaultFleet(tmp_path_factory.mktemp("crash"), infra, database="crash_faults", LLMGW_REQUIRE_API_KEY="false",
                   LLMGW_USAGE_SYNC_S="0.5", LLMGW_NODE_UNREACHABLE_AFTER_S="20",
                   LLMGW_NODE_LOST_AFTER_S="40", LLMGW_START_BACKOFF_BASE_S="1").start()
    try:
        assert f.cp.apply({"models": [ALPHA, BETA]}).status_code == 200
        f.steady(MODELS)
        yield f
    finally:
        f.close()


def admin(fleet: FaultFleet, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, fleet.cp.admin + path, json=body, timeout=30, headers=fleet.cp.admin_headers)


def workflow_status(fleet: FaultFleet, workflow_id: str) -> WorkflowExecutionStatus | None:
    async def ask():
        client = await Client.connect(fleet.infra.temporal.address)
        return (await client.get_workflow_handle(workflow_id).describe()).status
    try:
        return asyncio.run(ask())
    except Exception:  # noqa: BLE001 - not started yet, or Temporal not answering: no status
        return None


def agent_log(fleet: FaultFleet, node: str) -> str:
    return "\n".join(p.log() for p in fleet.cp.procs if p.name == f"agent-{node}")


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


def test_an_agent_killed_between_sigterm_and_sigkill_its_next_boot_finishes_the_stop(fleet):
    """A replica whose engine ignores SIGTERM (a wedged engine: `--ignore-sigterm`) is stopped (its model
    leaves the catalog), and its node's agent is SIGKILLed once the engine got the stop's SIGTERM, before
    the SIGKILL that would follow `grace_s` later. The engine runs on, unsupervised. The next boot ends the
    `stop_shard` attempt its predecessor left (node/attempts.py), so the stop is retried at once rather
    than after the activity's 120 s timeout: the engine is SIGKILLed (no orphan), the stop workflow
    completes, the replica ends `stopped` and nothing launches it again; the other replicas keep their
    engines and serve every request."""
    before = fleet.steady(MODELS)
    sigma = sim_model("sigma", args=["--tokens-per-second", "0", "--ignore-sigterm"])
    assert fleet.cp.apply({"models": [ALPHA, BETA, sigma]}).status_code == 200
    rep = fleet.steady([*MODELS, "sigma"])["sigma"]
    rid, node, pid = rep
    engine_log = fleet.cp.state / "logs" / node / f"{rid}-r0.log"
    with fleet.traffic(MODELS) as t:
        assert fleet.cp.apply({"models": [ALPHA, BETA]}).status_code == 200
        attempts = fleet.cp.state / "shards" / node / "attempts"

        def stopping() -> bool:  # the stop's stop_shard attempt runs, and the engine has had a SIGTERM
            noted = [f.read_text() for f in attempts.glob("*.json")] if attempts.is_dir() else []
            return (any('"stop_shard"' in n and f"replica/{rid}/stop" in n for n in noted)
                    and "sim: ignoring SIGTERM" in engine_log.read_text(errors="replace"))
        wait_until(stopping, timeout_s=30, what="the stop's SIGTERM at the engine", why=fleet.cp.logs)
        again = fleet.restart_agent(node)
        killed = time.monotonic()
        assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # runs on
        wait_until(lambda: f"ended the stop_shard of replica/{rid}/stop attempt" in again.log(), timeout_s=30,
                   what="the new boot ending the stop's attempt", why=again.log)
        wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                   timeout_s=40, what="the engine that ignores SIGTERM killed", why=fleet.cp.logs)
        wait_until(lambda: workflow_status(fleet, f"replica/{rid}/stop") == WorkflowExecutionStatus.COMPLETED,
                   timeout_s=40, what="the stop workflow completed", why=fleet.cp.logs)
        assert time.monotonic() - killed < 60, "the stop waited for its attempt's timeout"
        after = fleet.steady(MODELS)
    assert [(r["id"], r["status"]) for r in fleet.replicas("sigma")] == [(rid, "stopped")]
    assert fleet.launches(rid) == 1
    assert not (fleet.cp.state / "shards" / node / f"{rid}-r0.json").exists()
    assert (fleet.cp.state / "shards" / node / "fences" / rid).exists()
    assert after == before, f"replicas or engines changed: {before} -> {after}"
    assert t.failures("alpha") == [] and t.failures("beta") == [], (t.failures("alpha"), t.failures("beta"))


@pytest.fixture
def small_disks():
    """A 6 MiB tmpfs per node, for its weight cache (mounting one needs root; CI runs as root)."""
    root = Path(tempfile.mkdtemp(prefix="llmgw-small-disk-"))
    mounts = {n: root / n for n in NODES}
    mounted = []
    try:
        for n, m in mounts.items():
            m.mkdir()
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(m)], capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot mount a small tmpfs for a full disk (needs root): {r.stderr.strip()}")
            mounted.append(m)
        yield mounts
    finally:
        for m in mounted:
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
        subprocess.run(["rm", "-rf", str(root)], capture_output=True)


def test_a_disk_that_fills_during_a_download_fails_the_start_cleanly_and_the_planner_goes_elsewhere(fleet, small_disks):
    """Each node's weight cache is a 6 MiB disk. A replica's 4 MiB download (its profile says it takes
    5 MiB of disk) is held after its first MiB, and meanwhile something else fills that node's disk. The
    fetch fails with the cause named (the disk is full), not retried into the same wall; the partial file is
    removed (kept, it would hold the disk full for every other fetch); the replica fails, and the planner,
    which reads each node's free disk from its inventory, places the next one on the other node, where it
    serves. The models already serving keep their engines."""
    before = fleet.steady(MODELS)
    for n, m in small_disks.items():
        fleet.restart_agent(n, LLMGW_CACHE_DIR=str(m))
    fleet.cp.wait_nodes(*NODES, timeout_s=60)
    source = SlowSource()
    try:
        omega = sim_model("omega", source=source.url("omega.bin"), disk_gb=0.005)
        assert fleet.cp.apply({"models": [ALPHA, BETA, omega]}).status_code == 200
        assert source.served_head.wait(60), "the download never started"
        [first] = fleet.replicas("omega")
        full = first["shards"][0]["node_id"]
        disk = small_disks[full]
        wait_until(lambda: any(f.stat().st_size >= source.head for f in disk.rglob("*") if f.is_file()),
                   timeout_s=30, what="the first MiB on the node's disk")
        with open(disk / "filler", "wb") as f:  # what else fills the disk: 1 MiB is left, 3 MiB still to come
            f.write(b"\0" * (4 << 20))
        source.release()
        failed = wait_until(lambda: next((r for r in fleet.replicas("omega") if r["id"] == first["id"]
                                          and r["status"] == "failed"), None),
                            timeout_s=60, what="the start failed for the full disk", why=fleet.cp.logs)
        assert "is full" in (failed["failure"] or ""), failed
        left = {f.name: f.stat().st_size for f in disk.rglob("*") if f.is_file() and f.name != "filler"}
        assert not any("part" in name or size for name, size in left.items()), left  # the partial is gone
        [placed] = fleet.cp.wait_replicas("omega", exclude={first["id"]}, timeout_s=60)
        assert placed["shards"][0]["node_id"] != full, placed
        fleet.steady([*MODELS, "omega"])
        tried = [(r["shards"][0]["node_id"], r["status"], (r.get("failure") or "")[:300]) for r in fleet.replicas("omega")]
        assert len(tried) == 2, tried  # placed once more, not again and again
    finally:
        source.close()
    after = fleet.steady([*MODELS, "omega"])
    assert {m: after[m] for m in MODELS} == before
    assert fleet.cp.apply({"models": [ALPHA, BETA]}).status_code == 200
