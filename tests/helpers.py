"""Test helpers: real llmgw processes on free ports, stopped even when a test fails."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from llmgw.dev.procs import free_port, stop_process, wait_port

REPO = Path(__file__).resolve().parent.parent
# Test Temporal servers end idle long polls after LONG_POLL_S (60 s in Temporal's default), so the poller
# witness of node liveness is fresh within seconds; control planes allow that much age (POLLER_GRACE_S).
LONG_POLL_S = 3
POLLER_GRACE_S = 4
TEMPORAL_DYNAMIC_CONFIG = {"matching.longPollExpirationInterval": f"{LONG_POLL_S}s"}


class Proc:
    """An `llmgw ...` subprocess in its own process group, logging to a file. `python`: another
    installation's interpreter (a previous release's venv, tests/releases.py) instead of this one."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path, python: str | None = None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen([python or sys.executable, "-m", "llmgw", *args], env=env, stdout=logf,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 15) -> int | None:
        return stop_process(self.proc, grace_s=grace_s, sig=sig)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)


class ControlPlane:
    """`llmgw server` + `llmgw worker` (+ agents) against a test database and Temporal, on free ports."""

    def __init__(self, tmp: Path, database_url: str, temporal_address: str, **extra_env: str):
        self.tmp = tmp
        self.state = tmp / "state"
        self.ports: dict[str, int] = {}
        for k in ("gateway", "admin", "mirror", "node_api"):  # distinct: free_port picks each at random
            while (port := free_port()) in self.ports.values():
                pass
            self.ports[k] = port
        self.env = dict(os.environ)
        self.env.update({
            "LLMGW_STATE_DIR": str(self.state), "LLMGW_DATABASE_URL": database_url,
            "LLMGW_TEMPORAL_ADDRESS": temporal_address, "LLMGW_GATEWAY_PORT": str(self.ports["gateway"]),
            "LLMGW_ADMIN_PORT": str(self.ports["admin"]), "LLMGW_MIRROR_PORT": str(self.ports["mirror"]),
            "LLMGW_NODE_API_PORT": str(self.ports["node_api"]), "LLMGW_RECONCILE_INTERVAL_S": "2",
            "LLMGW_HEARTBEAT_INTERVAL_S": "1", "LLMGW_AGENT_METRICS_PORT": "0", "LLMGW_CONTROL_METRICS_PORT": "0",
            "PYTHONUNBUFFERED": "1", "LLMGW_POLLER_GRACE_S": str(POLLER_GRACE_S), "LLMGW_RECONNECT_MAX_S": "5",
        })
        self.pki = tmp / "pki"
        self._make_pki()
        self.env.update(extra_env)
        self.procs: list[Proc] = []
        self.log_dir = tmp / "logs"

    def _make_pki(self) -> None:
        """Mutual TLS on the node API, as in production: every test's agents prove who they are."""
        from llmgw.security.pki import create_ca, issue_server

        create_ca(self.pki)
        issue_server(self.pki, ["127.0.0.1"])
        self.env.update({"LLMGW_CA_CERT": str(self.pki / "ca.crt"), "LLMGW_NODE_API_CERT": str(self.pki / "server.crt"),
                         "LLMGW_NODE_API_KEY": str(self.pki / "server.key"),
                         "LLMGW_NODE_API_URL": f"https://127.0.0.1:{self.ports['node_api']}"})

    def node_env(self, node_id: str) -> dict[str, str]:
        from llmgw.security.pki import issue_node

        if not (self.pki / f"node-{node_id}.crt").exists():
            issue_node(self.pki, node_id)
        return {"LLMGW_NODE_CERT": str(self.pki / f"node-{node_id}.crt"),
                "LLMGW_NODE_KEY": str(self.pki / f"node-{node_id}.key")}

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    @property
    def admin_headers(self) -> dict[str, str]:
        """The admin API's bearer token (its file, created at the server's first start), as a header."""
        return {"authorization": "Bearer " + (self.state / "admin.token").read_text().strip()}

    @property
    def mirror_dir(self) -> Path:
        return self.state / "mirror"

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None, python: str | None = None) -> Proc:
        """`python`: another installation's interpreter, which runs its own llmgw (not this checkout's, so
        not with this process's PYTHONPATH)."""
        env = {**self.env, **(env or {})}
        if python is not None:
            env.pop("PYTHONPATH", None)
        p = Proc(name, list(args), env, self.log_dir, python=python)
        self.procs.append(p)
        return p

    def start(self, mirror: bool = False, worker: bool = True, python: str | None = None) -> "ControlPlane":
        server = self.spawn("server", "server", python=python)
        if worker:
            self.spawn("worker", "worker", python=python)
        if mirror:
            m = self.spawn("mirror", "mirror", "serve")
            wait_port(self.ports["mirror"], 30, m.proc, "mirror")
        wait_port(self.ports["admin"], 60, server.proc, "admin API")
        wait_port(self.ports["node_api"], 60, server.proc, "node API")
        wait_port(self.ports["gateway"], 60, server.proc, "gateway")
        return self

    def agent(self, node_id: str, name: str | None = None, stop_engines_on_exit: bool = True,
              simulate: str | None = None, python: str | None = None, **env: str) -> Proc:
        """An `llmgw agent` for `node_id`, with a weight cache of its own (as a separate machine has), and
        with `simulate`, a declared inventory (`--simulate SPEC`)."""
        args = ["agent", "--node-id", node_id]
        if stop_engines_on_exit:
            args.append("--stop-engines-on-exit")
        if simulate is not None:
            args += ["--simulate", simulate]
        env.setdefault("LLMGW_CACHE_DIR", str(self.state / "cache" / node_id))  # one cache per node, like machines
        return self.spawn(name or f"agent-{node_id}", *args, env={**self.node_env(node_id), **env}, python=python)

    def kill_node(self, node_id: str) -> None:
        """The machine dies: its agent and every engine it ran, at once (SIGKILL, no goodbye)."""
        for p in self.procs:
            if p.name == f"agent-{node_id}" and p.alive():
                p.kill()
        sweep_engines(self.state, node_id)

    def wait_nodes(self, *node_ids: str, status: str = "ready", timeout_s: float = 60) -> list[dict]:
        """Wait until every node in `node_ids` is registered with `status`; returns the admin API's nodes."""
        def ready():
            nodes = httpx.get(self.admin + "/admin/v1/nodes", timeout=10, headers=self.admin_headers).json()
            have = {n["id"] for n in nodes if n["status"] == status}
            return nodes if set(node_ids) <= have else None
        try:
            return wait_until(ready, timeout_s=timeout_s, what=f"nodes {', '.join(node_ids)} {status}")
        except AssertionError:
            raise AssertionError(f"nodes {node_ids} not {status}\n" + self.logs()) from None

    def explain(self, model: str) -> dict:
        return httpx.get(self.admin + f"/admin/v1/explain/{model}", timeout=10, headers=self.admin_headers).json()

    def ctl(self, *args: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
        """Run `llmgw ctl ...` as an operator would, against this control plane."""
        return subprocess.run([sys.executable, "-m", "llmgw", "ctl", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout_s)

    def shard_pid(self, node_id: str, shard_id: str) -> int:
        import json

        return json.loads((self.state / "shards" / node_id / f"{shard_id}.json").read_text())["pid"]

    def apply(self, catalog: dict) -> httpx.Response:
        return httpx.post(self.admin + "/admin/v1/catalog", json={"catalog": catalog}, timeout=30, headers=self.admin_headers)

    def replicas(self, all: bool = True) -> list[dict]:
        return httpx.get(self.admin + f"/admin/v1/replicas?all={str(all).lower()}", timeout=10, headers=self.admin_headers).json()

    def wait_replicas(self, model: str, status: str = "ready", count: int = 1, timeout_s: float = 60,
                      exclude: set[str] | None = None) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        last: list[dict] = []
        while time.monotonic() < deadline:
            last = [r for r in self.replicas() if r["model"] == model and r["status"] == status
                    and r["id"] not in (exclude or set())]
            if len(last) >= count:
                return last
            time.sleep(0.3)
        raise AssertionError(f"{model}: wanted {count} {status} replica(s), have {self.replicas()}\n" + self.logs())

    def logs(self) -> str:
        return "\n".join(f"---- {p.name}\n{p.log()[-3000:]}" for p in self.procs)

    def stop(self) -> None:
        for p in sorted(self.procs, key=lambda p: not p.name.startswith(("agent", "sim-fleet"))):  # nodes first
            try:
                p.stop()
            except Exception:  # noqa: BLE001 - keep stopping the others
                p.kill()
        sweep_engines(self.state)


def sweep_engines(state: Path, node_id: str = "*") -> None:
    """Kill any engine a test left behind (spec files under the state dir), on one node or all."""
    from llmgw.node.supervisor import kill_leftover_engines

    kill_leftover_engines(state / "shards", node_id)


def wait_until(fn, timeout_s: float = 30, interval_s: float = 0.2, what: str = "condition", why=None):
    """Poll `fn` until it returns something true. On timeout the error carries `why()` (when given): what
    the system says went wrong, so a CI log shows the cause and not only the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(interval_s)
    detail = ""
    if why is not None:
        try:
            detail = f"\n{why()}"
        except Exception as exc:  # noqa: BLE001 - the timeout is the failure; the detail is a courtesy
            detail = f"\n(could not say why: {exc})"
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}{detail}")


async def await_until(fn, timeout_s: float = 30, interval_s: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = await fn()
        if v:
            return v
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def parse_source(text: str, name: str):
    """`ast.parse` with the cyclic collector held off: on CPython 3.11 a finalizer the collector runs in the
    middle of it (an asyncio task's "exception was never retrieved", left by an earlier test in the same
    worker) failed it with `SystemError: AST constructor recursion depth mismatch`."""
    import ast
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(text, name)
    finally:
        if was:
            gc.enable()
