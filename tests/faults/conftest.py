"""The fault suite's fleet: a real control plane (`llmgw server` + `llmgw worker`), its own PostgreSQL and
Temporal (which these tests stop and start, so never the session's shared ones), two simulated GPU nodes
(`llmgw agent --simulate`), each talking to the node API and to Temporal through a relay the test can
partition, sim engines, and steady client traffic. Timeouts are scaled down by settings, never slept out.

The suite shares one Postgres and one Temporal (cases that stop them start them again), and a module
shares one fleet between its cases where that stays honest: each case starts from a converged
fleet (`FaultFleet.steady()`), records the engines' pids and replicas, injects one fault, and checks
afterwards against what it recorded.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import psycopg
import pytest

from llmgw.db.migrate import upgrade
from llmgw.dev.postgres import EmbeddedPostgres
from llmgw.dev.procs import free_port
from llmgw.dev.temporal_server import TemporalDevServer
from tests.faults.netproxy import PartitionableRelay
from tests.fleet import sim_spec
from tests.helpers import ControlPlane, Proc, wait_until

UNREACHABLE_S = 4.0
LOST_S = 8.0
LONG_POLL_S = 2
SETTINGS = {
    "LLMGW_NODE_UNREACHABLE_AFTER_S": str(UNREACHABLE_S), "LLMGW_NODE_LOST_AFTER_S": str(LOST_S),
    "LLMGW_HEARTBEAT_INTERVAL_S": "0.5", "LLMGW_RECONCILE_INTERVAL_S": "1", "LLMGW_ROUTE_REFRESH_S": "1",
    "LLMGW_RECONNECT_MAX_S": "30", "LLMGW_POLLER_GRACE_S": str(LONG_POLL_S + 1),
}
NODES = ("node-a", "node-b")


def sim_model(name: str, priority: int = 0, **profile) -> dict:
    return {"name": name, "priority": priority, "scaling": {"min": 1, "max": 1},
            "profiles": [{"engine": "sim", "gpus_per_node": 1, "args": ["--tokens-per-second", "0"], **profile}]}


@dataclass
class Infra:
    """PostgreSQL and Temporal of this module alone: stoppable without touching anyone else's."""

    pg: EmbeddedPostgres
    temporal: TemporalDevServer
    root: Path

    def stop_postgres(self) -> None:
        self.pg.stop()

    def kill_postgres(self) -> None:
        """SIGKILL PostgreSQL and every backend (its process group): a crash, not a shutdown. Transactions in
        flight are neither committed nor rolled back; the next start recovers from the WAL."""
        proc = self.pg.proc
        assert proc is not None and proc.poll() is None, "PostgreSQL is not running"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not any(_in_group(p, proc.pid) for p in psutil.process_iter()), timeout_s=10,
                   what="every PostgreSQL backend gone")

    def start_postgres(self) -> None:
        self.pg.start()

    def stop_temporal(self) -> None:
        self.temporal.stop()

    def start_temporal(self) -> None:
        self.temporal.start()


def _in_group(p: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        return False


@pytest.fixture(scope="package")
def infra():
    # Not under pytest's tmp tree (see tests/conftest.py: PostgreSQL may run as another user).
    root = Path(tempfile.mkdtemp(prefix="llmgw-faults-"))
    pg = EmbeddedPostgres(root / "pg", free_port(), root / "postgres.log", database="llmgw", durable=False)
    temporal = TemporalDevServer(free_port(), None, root / "temporal.db", root / "temporal.log",
                                 dynamic_config={"matching.longPollExpirationInterval": f"{LONG_POLL_S}s"})
    try:
        pg.start()
        upgrade(pg.url)
        temporal.start()
        yield Infra(pg, temporal, root)
    finally:
        temporal.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Traffic:
    """Chat requests to each model, one after another per model, recorded as (monotonic time, status)."""

    gateway: str
    models: list[str]
    headers: dict[str, str] = field(default_factory=dict)
    results: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    paused: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def _run(self, model: str) -> None:
        out = self.results.setdefault(model, [])
        with httpx.Client(timeout=10) as c:
            while not self.done.is_set():
                if self.paused.is_set():
                    time.sleep(0.05)
                    continue
                try:
                    code = c.post(self.gateway + "/v1/chat/completions", headers=self.headers, json={
                        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code
                except httpx.HTTPError:
                    code = 0
                out.append((time.monotonic(), code))
                time.sleep(0.05)

    def failures(self, model: str, since: float = 0.0) -> list[tuple[float, int]]:
        return [(t, c) for t, c in self.results.get(model, []) if t >= since and c != 200]

    def count(self, model: str, since: float = 0.0) -> int:
        return sum(1 for t, _ in self.results.get(model, []) if t >= since)

    def answered(self) -> int:
        """Requests answered 200, every model together."""
        return sum(1 for out in self.results.values() for _, c in out if c == 200)


class FaultFleet:
    """The control plane, two agents behind partitionable relays, and helpers to look at what runs."""

    def __init__(self, tmp: Path, infra: Infra, database: str | None = None, **extra_env: str):
        """`database`: a database of this fleet's own on the module's PostgreSQL (created and migrated),
        for a fleet whose rows (API keys, tenants, usage) the suite's other fleets must not see; by
        default the one they share."""
        self.infra = infra
        self.db_url = infra.pg.url
        if database is not None:
            self.db_url = infra.pg.url_for(database)
            with psycopg.connect(infra.pg.url_for("postgres"), autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
                conn.execute(f'CREATE DATABASE "{database}"')
            upgrade(self.db_url)
        self.cp = ControlPlane(tmp, self.db_url, infra.temporal.address, **{**SETTINGS, **extra_env})
        self.relays: dict[str, dict[str, PartitionableRelay]] = {}

    def start(self, nodes=NODES, gpus: int = 2, **spec) -> "FaultFleet":
        """`spec`: more of each node's simulated inventory (`tests/fleet.py` `sim_spec`)."""
        self.simulate = sim_spec(gpus=gpus, **spec)
        self.cp.start()
        for n in nodes:
            api = PartitionableRelay(self.cp.ports["node_api"], f"{n}-node-api")
            tq = PartitionableRelay(self.infra.temporal.port, f"{n}-temporal")
            self.relays[n] = {"api": api, "temporal": tq}
            self.cp.agent(n, simulate=self.simulate, LLMGW_NODE_API_URL=f"https://127.0.0.1:{api.port}",
                          LLMGW_TEMPORAL_ADDRESS=f"127.0.0.1:{tq.port}")
        self.cp.wait_nodes(*nodes, timeout_s=60)
        return self

    def close(self) -> None:
        try:
            self.cp.stop()
        finally:
            for r in self.relays.values():
                for relay in r.values():
                    relay.close()

    # ---- faults ----------------------------------------------------------------------------------
    def partition(self, node: str) -> None:
        """Cut `node` off from the control plane: its heartbeats and its pollers both stop arriving."""
        for relay in self.relays[node].values():
            relay.block()

    def heal(self, node: str) -> None:
        for relay in self.relays[node].values():
            relay.heal()

    def proc(self, name: str) -> Proc:
        return next(p for p in reversed(self.cp.procs) if p.name == name and p.alive())

    def freeze(self, name: str) -> Proc:
        """SIGSTOP process `name` and its children (`llmgw server` runs the node API as its child)."""
        p = self.proc(name)
        for c in [psutil.Process(p.proc.pid), *psutil.Process(p.proc.pid).children(recursive=True)]:
            c.send_signal(signal.SIGSTOP)
        return p

    @staticmethod
    def thaw(p: Proc) -> None:
        for c in [psutil.Process(p.proc.pid), *psutil.Process(p.proc.pid).children(recursive=True)]:
            c.send_signal(signal.SIGCONT)

    def restart_agent(self, node: str, **env: str) -> Proc:
        """SIGKILL `node`'s agent (its engines run on) and start it again, through its relays, with `env`."""
        for p in self.cp.procs:
            if p.name == f"agent-{node}" and p.alive():
                p.kill()
        relays = self.relays[node]
        return self.cp.agent(node, simulate=self.simulate, LLMGW_NODE_API_URL=f"https://127.0.0.1:{relays['api'].port}",
                             LLMGW_TEMPORAL_ADDRESS=f"127.0.0.1:{relays['temporal'].port}", **env)

    def restart_worker(self, **env: str) -> Proc:
        for p in self.cp.procs:
            if p.name == "worker" and p.alive():
                p.stop()
        return self.cp.spawn("worker", "worker", env=env)

    # ---- looking -----------------------------------------------------------------------------------
    def replicas(self, model: str | None = None) -> list[dict]:
        return [r for r in self.cp.replicas() if model is None or r["model"] == model]

    def serving(self) -> dict[str, tuple[str, str, int]]:
        """model -> (replica id, node, engine pid) for every Ready replica, pids from the nodes' spec files."""
        out = {}
        for r in self.cp.replicas(all=False):
            if r["status"] == "ready":
                out[r["model"]] = (r["id"], r["node_id"], self.cp.shard_pid(r["node_id"], f"{r['id']}-r0"))
        return out

    def nodes(self) -> dict[str, dict]:
        return {n["id"]: n for n in httpx.get(self.cp.admin + "/admin/v1/nodes", timeout=10, headers=self.cp.admin_headers).json()}

    def launches(self, replica_id: str) -> int:
        """How many times any agent launched a shard of `replica_id` (its log line per launch)."""
        logs = {p.log_path for p in self.cp.procs if p.name.startswith("agent")}  # a restarted agent appends to its log
        return sum(path.read_text(errors="replace").count(f"launched shard {replica_id}-r") for path in logs)

    def db_now_and_last_pass(self):
        """Postgres's clock now, and when the reconciler last completed a pass (None: never)."""
        with psycopg.connect(self.db_url) as conn:
            now = conn.execute("SELECT now()").fetchone()[0]
            row = conn.execute("SELECT pass_at FROM reconciler_state WHERE id = 1").fetchone()
        return now, row[0] if row else None

    def steady(self, models: list[str], timeout_s: float = 90) -> dict[str, tuple[str, str, int]]:
        """Wait until every model has exactly one Ready replica that answers, every node is ready,
        nothing is starting or stopping, and the reconciler has completed a pass since this call began
        (after a fault that failed its `decide`, Temporal retries it with a backoff of up to 5 s: until
        then no pass reads the pollers, and the pollers witness starts a new run of sight when passes
        resume); return `serving()`."""
        began, _ = self.db_now_and_last_pass()

        def converged():
            _, last_pass = self.db_now_and_last_pass()
            if last_pass is None or last_pass <= began:
                return None
            reps = self.cp.replicas(all=False)
            if any(r["status"] != "ready" for r in reps):
                return None
            if sorted(r["model"] for r in reps) != sorted(models):
                return None
            if any(n["status"] != "ready" for n in self.nodes().values()):
                return None
            for m in models:
                try:
                    if httpx.post(self.cp.gateway + "/v1/chat/completions", timeout=10, json={
                            "model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code != 200:
                        return None
                except httpx.HTTPError:
                    return None
            return self.serving()
        return wait_until(converged, timeout_s=timeout_s, interval_s=0.5, what=f"a converged fleet serving {models}",
                          why=lambda: f"replicas {self.cp.replicas()}\nnodes {self.nodes()}\n"
                                      f"(db now, last pass) {self.db_now_and_last_pass()}\n{self.cp.logs()}")

    @contextmanager
    def traffic(self, models: list[str], headers: dict[str, str] | None = None):
        """Traffic to `models`, each request with `headers` (an API key)."""
        t = Traffic(self.cp.gateway, models, headers or {})
        threads = [threading.Thread(target=t._run, args=(m,), daemon=True) for m in models]
        for th in threads:
            th.start()
        try:
            yield t
        finally:
            t.done.set()
            for th in threads:
                th.join(15)
