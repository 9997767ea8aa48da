"""`nodes.poll_read_at`: when the control worker last read the node's pollers on `node/<id>` (issue 42).

The second liveness witness reads a bounded slice of the fleet each pass, oldest read first
(control/liveness.py), so a node's `polled_at` is only as fresh as its last read: the planner and the
gateway count no poller silence past it (placement/liveness.py). NULL: never read.

Revision ID: 0017_poll_read
Revises: 0016_batches
"""
import sqlalchemy as sa
from alembic import op

revision = "0017_poll_read"
down_revision = "0016_batches"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("poll_read_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("nodes", "poll_read_at")
