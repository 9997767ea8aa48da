"""Database engines: async for the services, sync for Alembic."""

from __future__ import annotations

from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from llmgw.config import normalize_database_url


def async_engine(url: str, pool_size: int = 5) -> AsyncEngine:
    """An async engine on psycopg 3. `url` may be `postgresql://...`; the driver is filled in."""
    return create_async_engine(normalize_database_url(url), pool_size=pool_size, pool_pre_ping=True)


def sync_engine(url: str):
    return create_engine(normalize_database_url(url), pool_pre_ping=True)


def libpq_url(url: str) -> str:
    """The same URL as libpq/psycopg want it (no `+psycopg`)."""
    return normalize_database_url(url).replace("postgresql+psycopg://", "postgresql://", 1)
