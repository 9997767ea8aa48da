"""Run the Alembic migrations programmatically (`llmgw db upgrade`, and at `llmgw server` start).

Several processes may start together, so the upgrade holds a Postgres advisory lock. The target is
`heads`, so migrations developed on parallel branches apply before their merge revision exists.

A schema already migrated by a newer llmgw (a revision this version does not know) is left as it is: during
an upgrade the database goes first, and a server of the version before that restarts then still starts
(migrations only add, so it runs on the newer schema). llmgw 0.1.0 did not: it refused to start there
(tests/test_side_by_side.py), and needs `--no-migrate` once the database is newer.
"""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import text

from llmgw.db.engine import sync_engine

MIGRATIONS = Path(__file__).parent / "migrations"
_LOCK_KEY = 0x6C6C6D67  # "llmg"
log = logging.getLogger(__name__)


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "heads") -> None:
    """Bring the schema at `url` to `revision`, serialised across processes by an advisory lock."""
    engine = sync_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _LOCK_KEY})
            try:
                cfg = alembic_config(url)
                cfg.attributes["connection"] = conn
                newer = _unknown_revisions(conn, cfg)
                if newer:
                    log.warning("the database schema is at %s, which a newer llmgw made: left as it is (this "
                                "version runs on it; migrations only add)", ", ".join(newer))
                else:
                    command.upgrade(cfg, revision)
                conn.commit()
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _LOCK_KEY})
                conn.commit()
    finally:
        engine.dispose()


def _unknown_revisions(conn, cfg: Config) -> list[str]:
    """The revisions the database is at that this version's migrations do not hold (a newer version's)."""
    exists = conn.execute(text("SELECT to_regclass('alembic_version') IS NOT NULL")).scalar()
    if not exists:
        return []
    script = ScriptDirectory.from_config(cfg)
    unknown = []
    for (rev,) in conn.execute(text("SELECT version_num FROM alembic_version")):
        try:
            script.get_revision(rev)
        except CommandError:
            unknown.append(rev)
    return unknown
