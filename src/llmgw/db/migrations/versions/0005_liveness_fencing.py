"""Liveness from two witnesses, fenced starts, idempotent control activities (issue 9).

- `nodes.polled_at`: the last time the node's worker was seen polling its task queue `node/<id>`
  (Temporal's task-queue description, read by the control worker each pass): the second witness beside
  `last_heartbeat`.
- `observers`: one row per node-API process, ticked while it runs. A node's silent heartbeats count only
  from when the node API was last continuously able to receive them (a frozen or stopped server, or
  Postgres down, is the observer's fault, not the nodes').
- `replicas.generation`: the fencing generation, bumped on every step towards stopping (draining,
  stopped, failed, lost). Starts launch with the generation they read; stops tell nodes the one after.
- `activity_results`: the stored result of a control activity whose transaction committed, keyed by the
  workflow run and activity id, so a retry after a lost completion returns the same answer.

Revision ID: 0005_liveness_fencing
Revises: 0004_download_progress
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005_liveness_fencing"
down_revision = "0004_download_progress"
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.add_column("nodes", sa.Column("polled_at", sa.DateTime(timezone=True)))
    op.add_column("replicas", sa.Column("generation", sa.Integer, nullable=False, server_default="1"))
    op.create_table(
        "observers",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    )
    op.create_table(
        "activity_results",
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("activity", sa.Text, nullable=False),
        sa.Column("result", JSONB),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW, index=True),
    )


def downgrade() -> None:
    op.drop_table("activity_results")
    op.drop_table("observers")
    op.drop_column("replicas", "generation")
    op.drop_column("nodes", "polled_at")
