"""`usage_holds`: the tokens each gateway's requests in flight hold, per tenant and key (issue 37).

A request of an accounted key holds what it may use from its admission to its end (gateway/quotas.py), but
only the gateway that admitted it knew: N gateways could each admit requests holding all that was left of
a budget. Each gateway now replaces its one row here in every usage sync (the scopes it holds tokens for,
as parallel arrays, and when the row stops counting), and reads the others' fresh rows back in the same
statement as the fleet's totals (`db/usage_repo.py`). A gateway that dies stops refreshing its row, and its
holds stop counting at `expires_at` (ten sync intervals after its last sync); rows an hour past it are
pruned by the writers.

Revision ID: 0013_usage_holds
Revises: 0012_node_cert_revocations
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

revision = "0013_usage_holds"
down_revision = "0012_node_cert_revocations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_holds",
        sa.Column("gateway_id", sa.Text, primary_key=True),
        sa.Column("scopes", ARRAY(sa.Text), nullable=False, server_default="{}"),
        sa.Column("names", ARRAY(sa.Text), nullable=False, server_default="{}"),
        sa.Column("held", ARRAY(sa.BigInteger), nullable=False, server_default="{}"),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
    )


def downgrade() -> None:
    op.drop_table("usage_holds")
