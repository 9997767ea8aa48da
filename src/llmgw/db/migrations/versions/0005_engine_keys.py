"""Each shard's engine key (issue 11: engines only the gateway can reach).

Revision ID: 0005_engine_keys
Revises: 0004_download_progress
"""
import sqlalchemy as sa
from alembic import op

revision = "0005_engine_keys"
down_revision = "0004_download_progress"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The key a serving shard's engine requires, as its node reported it over the node API; null for a
    # worker shard and for engines started before keys (they require none, and the gateway sends none).
    op.add_column("shards", sa.Column("api_key", sa.Text))


def downgrade() -> None:
    op.drop_column("shards", "api_key")
