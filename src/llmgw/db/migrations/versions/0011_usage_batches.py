"""`usage_batches`: the id of every batch of usage a gateway has written (issue 37).

Each gateway adds its counts to `usage` and `usage_periods` every second; the write is additive. A sync
whose COMMIT reached Postgres but whose answer was lost (the connection dropped after it) looked to the
gateway like a failed one, and its counts were added again at the next sync: a bill counted twice. Each
batch now carries an id, made once and kept with the batch until it is known written; the write records
the id in the same transaction, and a retry of an id already recorded adds nothing (`db/usage_repo.py`).
Rows older than a few days are pruned by the writers.

Revision ID: 0011_usage_batches
Revises: 0010_model_idle_stopped
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0011_usage_batches"
down_revision = "0010_model_idle_stopped"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_batches",
        sa.Column("id", UUID(as_uuid=False), primary_key=True),
        sa.Column("written_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
    )
    op.create_index("ix_usage_batches_written_at", "usage_batches", ["written_at"])


def downgrade() -> None:
    op.drop_index("ix_usage_batches_written_at", "usage_batches")
    op.drop_table("usage_batches")
