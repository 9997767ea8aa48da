"""`nodes.version`: the llmgw version of the node's worker, as it registered (issue 38).

Shown by `llmgw ctl nodes` (VERSION), so an operator sees which nodes an upgrade has reached. NULL for a
node that has not registered since, or whose worker predates it.

Revision ID: 0014_node_version
Revises: 0013_usage_holds
"""
import sqlalchemy as sa
from alembic import op

revision = "0014_node_version"
down_revision = "0013_usage_holds"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("version", sa.Text()))


def downgrade() -> None:
    op.drop_column("nodes", "version")
