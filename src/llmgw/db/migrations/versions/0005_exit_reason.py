"""A shard's exit in words ("killed by SIGILL (illegal instruction): ..."), kept beside its exit code and
output tail so every failed replica keeps its decoded cause (issue 14).

Revision ID: 0005_exit_reason
Revises: 0004_download_progress
"""
import sqlalchemy as sa
from alembic import op

revision = "0005_exit_reason"
down_revision = "0004_download_progress"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("shards", sa.Column("exit_reason", sa.Text))
    # The latest failed replica of a model (its cause, for `ctl models` and the gateway's 503).
    op.create_index("ix_replicas_model_ended_at", "replicas", ["model", "ended_at"])


def downgrade() -> None:
    op.drop_index("ix_replicas_model_ended_at", "replicas")
    op.drop_column("shards", "exit_reason")
