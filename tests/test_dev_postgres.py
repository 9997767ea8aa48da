"""`llmgw dev`'s embedded PostgreSQL wants a password (issue 36): it ran `trust` as the superuser, so any
local user of a shared GPU box could connect, administer the fleet and read engine keys."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest

from llmgw.dev.postgres import EmbeddedPostgres, _bin
from llmgw.dev.procs import free_port


@pytest.fixture
def root():
    # Not under pytest's tmp tree (tests/conftest.py: as root, PostgreSQL runs as another user).
    path = Path(tempfile.mkdtemp(prefix="llmgw-test-devpg-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def refused_without_password(port: int) -> bool:
    try:
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        return "password" in str(exc)
    return False


def test_a_new_cluster_wants_the_password_kept_0600_in_the_state_dir(root):
    pg = EmbeddedPostgres(root / "pg", free_port(), root / "postgres.log", durable=False)
    try:
        pg.start()
        assert refused_without_password(pg.port)
        wrong = f"postgresql://postgres:not-it@127.0.0.1:{pg.port}/postgres"
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(wrong, connect_timeout=5).close()
        assert pg.password_path == root / "postgres.password"
        assert pg.password_path.stat().st_mode & 0o077 == 0 and len(pg.password()) >= 24
        with psycopg.connect(pg.url, connect_timeout=5) as conn:  # what every llmgw process is given
            assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
        assert not (root / ".initdb-password").exists()
        text = (root / "pg" / "pg_hba.conf").read_text()
        assert " trust" not in "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    finally:
        pg.stop()


def test_a_cluster_initialised_with_trust_wants_the_password_after_its_next_start(root):
    pg = EmbeddedPostgres(root / "pg", free_port(), root / "postgres.log", durable=False)
    pg._prepare_user()
    subprocess.run([_bin("initdb"), "-D", str(pg.data_dir), "--auth=trust", "-U", "postgres", "--no-sync"],
                   check=True, user=pg.user, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pg.start()
        assert refused_without_password(pg.port)
        with psycopg.connect(pg.url, connect_timeout=5) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        pg.stop()
