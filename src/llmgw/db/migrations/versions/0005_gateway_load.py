"""Load reported by each gateway (autoscaling); the profile hash each replica runs (rolling replacement).

Revision ID: 0005_gateway_load
Revises: 0004_download_progress
"""
import sqlalchemy as sa
from alembic import op

revision = "0005_gateway_load"
down_revision = "0004_download_progress"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # One row per gateway and model, refreshed every second while the gateway lives: a dead gateway's load
    # expires with its `updated_at` instead of holding replicas up.
    op.create_table(
        "gateway_load",
        sa.Column("gateway_id", sa.Text, primary_key=True),
        sa.Column("model", sa.Text, primary_key=True),
        sa.Column("in_flight", sa.Integer, nullable=False, server_default="0"),
        sa.Column("queued", sa.Integer, nullable=False, server_default="0"),
        sa.Column("peak", sa.Integer, nullable=False, server_default="0"),
        sa.Column("served_per_s", sa.Float, nullable=False, server_default="0"),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    # Never written: gateway_load replaces it.
    op.drop_column("model_state", "in_flight")
    op.add_column("replicas", sa.Column("profile_hash", sa.Text))


def downgrade() -> None:
    op.drop_column("replicas", "profile_hash")
    op.add_column("model_state", sa.Column("in_flight", sa.Integer, nullable=False, server_default="0"))
    op.drop_table("gateway_load")
