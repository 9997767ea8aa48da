"""`nodes.left_at`: when the node's agent said it was leaving (it stops its engines on exit).

Set by `POST /node/v1/leave` (the agent, on its way out with `--stop-engines-on-exit`), cleared by the
node's next registration. A node that has left is Unreachable at once (nothing is placed on it) instead of
only once both witnesses fall silent, which the pollers' long-poll grace makes a minute or more.

Revision ID: 0007_node_left
Revises: 0006_tenants
"""
import sqlalchemy as sa
from alembic import op

revision = "0007_node_left"
down_revision = "0006_tenants"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("left_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("nodes", "left_at")
