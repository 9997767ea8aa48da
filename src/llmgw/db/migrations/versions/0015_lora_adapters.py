"""`replica_adapters`: which LoRA adapters each replica holds loaded (issue 40).

A gateway writes a row when it has loaded an adapter into a replica (the engine's runtime load call) and
deletes it when it unloads one; every gateway reads them on each route refresh, so a request for an adapter
goes to a replica that holds it. `used_at` is when a gateway last sent it a request (its LRU order, coarse:
written on load, read as a tie-break). Rows go with their replica.

Revision ID: 0015_lora_adapters
Revises: 0014_node_version
"""
import sqlalchemy as sa
from alembic import op

revision = "0015_lora_adapters"
down_revision = "0014_node_version"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replica_adapters",
        sa.Column("replica_id", sa.Text(), sa.ForeignKey("replicas.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("adapter", sa.Text(), primary_key=True),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("loaded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )


def downgrade() -> None:
    op.drop_table("replica_adapters")
