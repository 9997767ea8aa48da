"""Fleet: settled replicas, why a replica ended, when a model's decisions were made.

- `replicas.settled_at`: set once every shard of an ended replica was asked to stop and its failure (if
  any) counted against the model. Until then the reconciler keeps the replica in its snapshot and stops
  its shards: a failed shard fails the whole replica, whose other shards would otherwise keep their GPUs.
- `replicas.ended_reason`: why it stopped (idle, evicted for another model, node lost, ...).
- `model_state.decided_at`: when the reconcile pass that wrote `model_state.decisions` ran.

Revision ID: 0003_fleet
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0003_fleet"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("replicas", sa.Column("settled_at", sa.DateTime(timezone=True)))
    op.add_column("replicas", sa.Column("ended_reason", sa.Text))
    op.add_column("model_state", sa.Column("decided_at", sa.DateTime(timezone=True)))
    # Replicas that ended before this revision were cleaned up the old way; do not revisit them.
    op.execute("UPDATE replicas SET settled_at = coalesce(ended_at, updated_at) "
               "WHERE status IN ('stopped', 'failed', 'lost')")


def downgrade() -> None:
    op.drop_column("model_state", "decided_at")
    op.drop_column("replicas", "ended_reason")
    op.drop_column("replicas", "settled_at")
