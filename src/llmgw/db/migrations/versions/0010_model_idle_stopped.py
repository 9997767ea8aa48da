"""`model_state.idle_stopped_at`: when the reconciler last decided to stop the model's last replicas because
nothing asked for it (an on-demand model past its idle_timeout).

With nothing placed, an on-demand model used within its `idle_timeout` is started again: what a model whose
replica was lost or failed while in use needs. But a model already stopped for being idle was started
again by a larger `idle_timeout` (applied later, or read by the next start of the control plane) with no
request at all. A stop for idleness after the latest use and demand now means: wait for a request.

Revision ID: 0010_model_idle_stopped
Revises: 0009_model_replaced
"""
import sqlalchemy as sa
from alembic import op

revision = "0010_model_idle_stopped"
down_revision = "0009_model_replaced"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("model_state", sa.Column("idle_stopped_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("model_state", "idle_stopped_at")
