"""Postgres: tables, repositories (all SQL lives here), Alembic migrations."""
