"""Two versions side by side, for real (issue 38): the previous release (tests/releases.py: llmgw 0.1.0 from
this repository's history, in a venv of its own) and this checkout, as the real processes of one fleet
during an upgrade, on one Postgres and one Temporal dev server, with sim engines, under a client loop that
sends streamed and plain chat completions without pause.

- the previous release's node worker driven by this version's control plane (control worker, gateway, node
  API); then the node worker upgraded in place;
- this version's node worker driven by the previous release's control plane; then the control plane
  upgraded (the database migrated under the running gateway, the control worker replaced);
- control workers of both versions polling one task queue at once, then each left alone with the other's
  histories, while replicas are started and stopped.

Each asserts: every replica placed, started, drained and stopped across the versions; not one failed
request; every engine that ran before an upgrade still runs after it under the same pid; and no workflow
task failed in any workflow of the namespace (Temporal's own histories).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest
from alembic.script import ScriptDirectory
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from llmgw.db.migrate import alembic_config
from llmgw.dev.procs import free_port, wait_port
from tests.helpers import ControlPlane, wait_until
from tests.releases import previous_release

pytestmark = pytest.mark.integration

MODEL = "m"
PROFILE = {"engine": "sim", "args": ["--tokens-per-second", "200"]}
PAUSE_S = 0.05  # between one client's requests: steady traffic that leaves CPU to the processes under test


def catalog(replicas: int) -> dict:
    return {"models": [{"name": MODEL, "scaling": {"min": replicas, "max": replicas}, "profiles": [PROFILE]}]}


@pytest.fixture(scope="module")
def old_python() -> str:
    t0 = time.monotonic()
    python = str(previous_release())
    print(f"\nprevious release ready in {time.monotonic() - t0:.1f} s: {python}")
    return python


class Traffic:
    """Two clients, one streaming and one not, each sending the next chat completion as soon as the last
    ended. A failure is any answer but a 200 whose body (or stream, up to `[DONE]`) is whole."""

    def __init__(self, gateway: str):
        self.gateway = gateway
        self.ok = {"stream": 0, "plain": 0}
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(s,), daemon=True) for s in (True, False)]

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _loop(self, stream: bool) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                try:
                    failure = self._stream(client, body) if stream else self._plain(client, body)
                except httpx.HTTPError as exc:
                    failure = f"{type(exc).__name__}: {exc}"
                if failure:
                    self.failures.append(f"{time.strftime('%H:%M:%S')} {'stream' if stream else 'plain'}: {failure}")
                else:
                    self.ok["stream" if stream else "plain"] += 1
                self._stop.wait(PAUSE_S)

    def _plain(self, client: httpx.Client, body: dict) -> str | None:
        r = client.post(self.gateway + "/v1/chat/completions", json=body)
        if r.status_code != 200:
            return f"{r.status_code} {r.text[:200]}"
        return None if r.json()["choices"][0]["message"]["content"] else f"empty answer {r.text[:200]}"

    def _stream(self, client: httpx.Client, body: dict) -> str | None:
        with client.stream("POST", self.gateway + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"{r.status_code} {r.read()[:200]!r}"
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        errors = [e for e in events if '"error"' in e[:12]]
        if errors or not events or events[-1] != "[DONE]":
            return f"stream cut or failed: {events[-3:]}"
        return None

    def served(self) -> int:
        return sum(self.ok.values())

    def wait_served(self, more: int = 10, timeout_s: float = 20) -> None:
        """Until `more` answers beyond those so far were whole (the fleet is serving, not only up)."""
        target = self.served() + more
        wait_until(lambda: self.served() >= target, timeout_s=timeout_s, what=f"{more} more answers",
                   why=lambda: f"served {self.ok}, failures {self.failures[-3:]}")


_T0 = [time.monotonic()]


def step(what: str) -> None:
    """A line in the test's output: how long each step of an upgrade took (run with -s)."""
    now = time.monotonic()
    print(f"  {now - _T0[0]:6.1f} s  {what}")
    _T0[0] = now


def polling(worker):
    """`worker` (a control worker's Proc), once it polls the control task queue (both versions log it)."""
    wait_until(lambda: "control worker polling" in worker.log(), timeout_s=60, what=f"{worker.name} polling",
               why=lambda: worker.log()[-2000:])
    step(f"{worker.name} polling")
    return worker


def active(cp: ControlPlane) -> list[dict]:
    return [r for r in cp.replicas() if r["model"] == MODEL and r["status"] in ("starting", "ready", "draining")]


def scale(cp: ControlPlane, replicas: int, traffic: Traffic, timeout_s: float = 60) -> list[dict]:
    """Apply `replicas` and wait until exactly that many are ready and no other is active (a scale-down
    drained and stopped the rest), then until the traffic was served on the result."""
    assert cp.apply(catalog(replicas)).status_code == 200

    def settled():
        reps = active(cp)
        return reps if len(reps) == replicas and all(r["status"] == "ready" for r in reps) else None
    reps = wait_until(settled, timeout_s=timeout_s, what=f"{replicas} ready replica(s) of {MODEL}",
                      why=lambda: json.dumps(cp.replicas(), default=str)[-2000:] + "\n" + cp.logs())
    traffic.wait_served()
    step(f"scaled to {replicas}")
    return reps


def engine_pids(cp: ControlPlane, node: str) -> dict[str, int]:
    """Every engine the node's agent recorded: shard id -> pid (its spec files)."""
    return {p.stem: json.loads(p.read_text())["pid"] for p in (cp.state / "shards" / node).glob("*.json")}


def assert_engines_kept(cp: ControlPlane, node: str, before: dict[str, int]) -> None:
    import psutil

    after = engine_pids(cp, node)
    for shard, pid in before.items():
        assert after.get(shard) == pid and psutil.pid_exists(pid), (
            f"engine {shard} (pid {pid}) restarted or gone across the upgrade: now {after.get(shard)}")


async def _workflow_task_outcomes(address: str, namespace: str) -> tuple[list[str], set[str]]:
    """Every failed workflow task in the namespace (workflow id, cause, message) and the identities of the
    workers that completed workflow tasks."""
    client = await Client.connect(address, namespace=namespace)
    failed: list[str] = []
    identities: set[str] = set()
    async for wf in client.list_workflows():
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                a = event.workflow_task_failed_event_attributes
                failed.append(f"{wf.id} ({wf.workflow_type}): {a.cause} {a.failure.message[:300]}")
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                identities.add(event.workflow_task_completed_event_attributes.identity)
    return failed, identities


def workflow_task_outcomes(cp: ControlPlane) -> tuple[list[str], set[str]]:
    return asyncio.run(_workflow_task_outcomes(cp.env["LLMGW_TEMPORAL_ADDRESS"], cp.env["LLMGW_TEMPORAL_NAMESPACE"]))


def versions(identities: set[str]) -> set[str]:
    """Which llmgw versions completed workflow tasks: this one names itself in its identity, 0.1.0 did not."""
    return {i.rsplit("llmgw/", 1)[1] if "llmgw/" in i else "0.1.0" for i in identities}


def _plane(tmp: Path, database_url: str, temporal, namespace: str) -> ControlPlane:
    return ControlPlane(tmp, database_url, temporal.address, LLMGW_TEMPORAL_NAMESPACE=namespace,
                        LLMGW_ROUTE_REFRESH_S="0.5", LLMGW_REPLICA_DRAIN_TIMEOUT_S="10")


@pytest.fixture
def empty_database_url(postgres):
    """A database with no schema, for a control plane of the previous release to migrate as its own."""
    name = "t_" + uuid.uuid4().hex[:12]
    admin = postgres.url_for("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield postgres.url_for(name)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_previous_node_worker_under_this_control_plane_then_upgraded(old_python, tmp_path, database_url,
                                                                      temporal, namespace):
    cp = _plane(tmp_path, database_url, temporal, namespace)
    try:
        step("start")
        cp.start()
        old = cp.agent("n1", stop_engines_on_exit=False, python=old_python)
        [n1] = cp.wait_nodes("n1")
        assert n1["version"] == ""  # 0.1.0 sends none
        assert cp.apply(catalog(1)).status_code == 200
        step("control plane and node up")
        cp.wait_replicas(MODEL, timeout_s=60)
        step("first replica ready")
        with Traffic(cp.gateway) as traffic:
            traffic.wait_served(timeout_s=30)
            scale(cp, 2, traffic)  # placed and started on the 0.1.0 node worker by 0.2.0
            scale(cp, 1, traffic)  # one drained and stopped there
            before = engine_pids(cp, "n1")
            assert len(before) == 1
            # The upgrade: the node worker stops (its engines stay) and this version's starts and adopts them.
            old.stop()
            cp.agent("n1", name="agent-n1-new", stop_engines_on_exit=False)
            wait_until(lambda: any(n["id"] == "n1" and n.get("version") == "0.2.0" for n in httpx.get(
                cp.admin + "/admin/v1/nodes", headers=cp.admin_headers, timeout=10).json()),
                timeout_s=30, what="n1 registered by 0.2.0")
            traffic.wait_served()
            scale(cp, 2, traffic)  # the node worker of this version starts one beside the adopted engine
        assert traffic.failures == [], traffic.failures
        assert_engines_kept(cp, "n1", before)
        step("traffic stopped")
        failed, _ = workflow_task_outcomes(cp)
        step("histories read")
        assert failed == []
        print(f"answers: {traffic.ok}")
    finally:
        cp.stop()


def test_this_node_worker_under_previous_control_plane_then_upgraded(old_python, tmp_path, empty_database_url,
                                                                      temporal, namespace):
    cp = _plane(tmp_path, empty_database_url, temporal, namespace)
    try:
        step("start")
        cp.start(python=old_python)  # 0.1.0's server migrates its database as its own
        cp.agent("n1", stop_engines_on_exit=False)
        cp.wait_nodes("n1")
        assert cp.apply(catalog(1)).status_code == 200
        step("control plane and node up")
        cp.wait_replicas(MODEL, timeout_s=60)
        step("first replica ready")
        with Traffic(cp.gateway) as traffic:
            traffic.wait_served(timeout_s=30)
            scale(cp, 2, traffic)  # placed and started on this version's node worker by 0.1.0
            scale(cp, 1, traffic)
            before = engine_pids(cp, "n1")
            # The upgrade, in the documented order: the database first, under the running 0.1.0 gateway and
            # control worker; then the control worker.
            m = subprocess.run([sys.executable, "-m", "llmgw", "db", "upgrade"], env=cp.env, capture_output=True,
                               text=True, timeout=120)
            assert m.returncode == 0, m.stdout + m.stderr
            step("database upgraded")
            traffic.wait_served()
            # A 0.1.0 gateway (re)started now finds a schema newer than it knows: it refuses to start unless
            # told not to migrate (this version starts there: test_a_schema_newer_than_this_version_...).
            g2 = free_port()
            env2 = {"LLMGW_GATEWAY_PORT": str(g2), "LLMGW_ADMIN_PORT": str(free_port()), "LLMGW_NODE_API_PORT": "0"}
            refused = cp.spawn("server-old-2", "server", python=old_python, env=env2)
            assert refused.proc.wait(60) != 0
            heads = ScriptDirectory.from_config(alembic_config("postgresql://unused")).get_heads()
            assert any(f"Can't locate revision identified by '{h}'" in refused.log() for h in heads), heads
            second = cp.spawn("server-old-3", "server", "--no-migrate", python=old_python, env=env2)
            wait_port(g2, 60, second.proc, "a 0.1.0 gateway started on the migrated schema with --no-migrate")
            wait_until(lambda: httpx.post(f"http://127.0.0.1:{g2}/v1/chat/completions", timeout=10, json={
                "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).status_code == 200,
                timeout_s=20, what="the restarted 0.1.0 gateway serving")
            step("0.1.0 gateway restarted")
            old_worker = next(p for p in cp.procs if p.name == "worker")
            cp.spawn("worker-new", "worker")
            old_worker.stop()
            scale(cp, 2, traffic)  # started by this version's control worker
        assert traffic.failures == [], traffic.failures
        assert_engines_kept(cp, "n1", {k: v for k, v in before.items() if k in engine_pids(cp, "n1")})
        assert set(before) & set(engine_pids(cp, "n1")), "the replica that ran before the upgrade was stopped"
        step("traffic stopped")
        failed, _ = workflow_task_outcomes(cp)
        step("histories read")
        assert failed == []
        print(f"answers: {traffic.ok}")
    finally:
        cp.stop()


def test_control_workers_of_both_versions_on_one_task_queue(old_python, tmp_path, database_url, temporal, namespace):
    cp = _plane(tmp_path, database_url, temporal, namespace)
    try:
        step("start")
        cp.start(worker=False)
        old_worker = polling(cp.spawn("worker-old", "worker", python=old_python))
        cp.agent("n1", stop_engines_on_exit=False)
        cp.wait_nodes("n1")
        step("control plane and node up")
        assert cp.apply(catalog(1)).status_code == 200
        cp.wait_replicas(MODEL, timeout_s=60)  # the reconciler and this start: 0.1.0's histories
        step("first replica ready")
        with Traffic(cp.gateway) as traffic:
            traffic.wait_served(timeout_s=30)
            new_worker = polling(cp.spawn("worker-new", "worker"))
            scale(cp, 2, traffic)  # both poll: workflow tasks go to either
            scale(cp, 1, traffic)
            old_worker.stop()  # 0.2.0 alone replays what 0.1.0 wrote
            scale(cp, 2, traffic)
            old_worker = polling(cp.spawn("worker-old-again", "worker", python=old_python))
            new_worker.stop()  # 0.1.0 alone replays what 0.2.0 wrote
            scale(cp, 1, traffic)
        assert traffic.failures == [], traffic.failures
        step("traffic stopped")
        failed, identities = workflow_task_outcomes(cp)
        step("histories read")
        assert failed == [], failed
        assert versions(identities) == {"0.1.0", "0.2.0"}, identities
        print(f"answers: {traffic.ok}; workflow tasks completed by {sorted(identities)}")
    finally:
        cp.stop()


def test_a_schema_newer_than_this_version_is_left_as_it_is(database_url, caplog):
    """The database is upgraded first: a server of the version before then restarts on a schema it does not
    know. This version starts there (0.1.0 did not: above) and changes nothing."""
    from llmgw.db.migrate import upgrade

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0099_from_a_newer_llmgw'")
    with caplog.at_level("WARNING", logger="llmgw.db.migrate"):
        upgrade(database_url)
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [("0099_from_a_newer_llmgw",)]
    assert "0099_from_a_newer_llmgw, which a newer llmgw made" in caplog.text
