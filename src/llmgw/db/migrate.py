"""Run the Alembic migrations programmatically (`llmgw db upgrade`, and at `llmgw server` start).

Several processes may start together, so the upgrade holds a Postgres advisory lock. The target is
`heads`, so migrations developed on parallel branches apply before their merge revision exists.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import text

from llmgw.db.engine import sync_engine

MIGRATIONS = Path(__file__).parent / "migrations"
_LOCK_KEY = 0x6C6C6D67  # "llmg"


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
                command.upgrade(cfg, revision)
                conn.commit()
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _LOCK_KEY})
                conn.commit()
    finally:
        engine.dispose()
