"""The reconciler's own state: its latest pass, its latest planner failure, the reasons of the placements
that pass decided (read by record_placement, so refusal lists never travel through workflow history).

Revision ID: 0005_reconciler
Revises: 0004_download_progress
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005_reconciler"
down_revision = "0004_download_progress"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "reconciler_state",
        sa.Column("id", sa.Integer, primary_key=True),  # always 1: one reconciler
        sa.Column("pass_at", sa.DateTime(timezone=True)),
        sa.Column("failed_at", sa.DateTime(timezone=True)),
        sa.Column("failure", sa.Text),
        sa.Column("attempt", sa.Integer),
        sa.Column("placements", JSONB, nullable=False, server_default="{}"),
        sa.CheckConstraint("id = 1", name="reconciler_state_singleton"),
    )


def downgrade() -> None:
    op.drop_table("reconciler_state")
