"""`model_state.replaced`: how many of the model's replicas have ended failed or lost, ever.

`failures` counts failed starts in a row and goes back to 0 once a start reaches Ready (it drives the
backoff), so a model whose running engine was killed four times, and replaced each time, showed RESTARTS 0
in `ctl models`. `replaced` only grows: it is what RESTARTS shows, as Kubernetes' does. Counted in the
transaction that ends the replica (db/fleet_repo.py `transition_replica`), so a retried transition never
counts twice. Replicas already ended failed or lost at upgrade time are counted.

Revision ID: 0009_model_replaced
Revises: 0008_model_failed_at
"""
import sqlalchemy as sa
from alembic import op

revision = "0009_model_replaced"
down_revision = "0008_model_failed_at"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("model_state", sa.Column("replaced", sa.Integer, nullable=False, server_default="0"))
    op.execute("UPDATE model_state SET replaced = (SELECT count(*) FROM replicas "
               "WHERE replicas.model = model_state.name AND replicas.status IN ('failed', 'lost'))")


def downgrade() -> None:
    op.drop_column("model_state", "replaced")
