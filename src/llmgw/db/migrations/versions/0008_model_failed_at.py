"""`model_state.failed_at`: when the model's latest failed start was counted.

Set with each failed start (`record_failure`), cleared with the count (a start reached Ready, or `ctl
retry`). An on-demand model whose last start failed and that nobody has asked for since is not started
again (placement/scale.py): before, the demand that preceded the failure kept it wanted for its whole
`idle_timeout`, so a broken model nobody was waiting for was retried, backoff after backoff, unasked.

Revision ID: 0008_model_failed_at
Revises: 0007_node_left
"""
import sqlalchemy as sa
from alembic import op

revision = "0008_model_failed_at"
down_revision = "0007_node_left"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("model_state", sa.Column("failed_at", sa.DateTime(timezone=True)))
    # A model failing at upgrade time: its failure counts from now, so it too waits for a request.
    op.execute("UPDATE model_state SET failed_at = now() WHERE failures > 0")


def downgrade() -> None:
    op.drop_column("model_state", "failed_at")
