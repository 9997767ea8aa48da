"""`node_cert_revocations`: the deny-list of node certificates (issue 36).

Node certificates could not be revoked: one stolen from a node (or kept by a decommissioned one) spoke for
that node for its whole life. Each row refuses either one certificate (`serial`, lower-case hex), or every
certificate of `node_id` issued up to `issued_before` (`llmgw ctl cert revoke NODE`: a certificate issued
after it, `llmgw ctl cert node NODE --force`, lets the node back). Every node-API process reads the table
every `revocation_refresh_s` (control/revocations.py).

Revision ID: 0012_node_cert_revocations
Revises: 0011_usage_batches
"""
import sqlalchemy as sa
from alembic import op

revision = "0012_node_cert_revocations"
down_revision = "0011_usage_batches"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_cert_revocations",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("node_id", sa.Text, nullable=False),
        sa.Column("serial", sa.Text),
        sa.Column("issued_before", sa.DateTime(timezone=True)),
        sa.Column("reason", sa.Text, nullable=False, server_default=""),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.CheckConstraint("(serial IS NULL) <> (issued_before IS NULL)", name="ck_node_cert_revocations_one_key"),
    )
    op.create_index("ix_node_cert_revocations_serial", "node_cert_revocations", ["serial"], unique=True)
    op.create_index("ix_node_cert_revocations_node_id", "node_cert_revocations", ["node_id"])


def downgrade() -> None:
    op.drop_index("ix_node_cert_revocations_node_id", "node_cert_revocations")
    op.drop_index("ix_node_cert_revocations_serial", "node_cert_revocations")
    op.drop_table("node_cert_revocations")
