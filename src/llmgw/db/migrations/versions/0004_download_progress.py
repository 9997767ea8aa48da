"""Merge the api-keys and fleet branches; a shard's download progress.

Revision ID: 0004_download_progress
Revises: 0002_api_keys, 0003_fleet
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0004_download_progress"
down_revision = ("0002_api_keys", "0003_fleet")
branch_labels = None
depends_on = None


def upgrade() -> None:
    # {"source", "bytes", "total" (absent when the server sent no length)}; null when not downloading.
    op.add_column("shards", sa.Column("progress", JSONB))


def downgrade() -> None:
    op.drop_column("shards", "progress")
