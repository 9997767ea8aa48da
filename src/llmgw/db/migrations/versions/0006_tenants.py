"""Merge the five 0005 branches; tenants, limits on keys, and token usage (issue 15).

- `tenants`: a team that API keys belong to, with its limits (`schemas/tenants.py` `Limits`, as JSON:
  rpm, tpm, tokens per day and per month, the models it may use).
- `api_keys.tenant` (null: a key of no tenant) and `api_keys.limits` (the key's own limits, on top of its
  tenant's). Changes to `tenants` notify the gateways like changes to `api_keys`.
- `usage`: what the engines reported, per minute, tenant, key and model, added to by every gateway each
  second (`db/usage_repo.py`). `tenant` is '' for a key of no tenant.
- `usage_periods`: the same tokens summed per day and per month, per tenant and key, so each gateway reads
  the fleet's budgets in use with one small query a second instead of summing a month of minutes.

Revision ID: 0006_tenants
Revises: 0005_engine_keys, 0005_exit_reason, 0005_gateway_load, 0005_liveness_fencing, 0005_reconciler
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0006_tenants"
down_revision = ("0005_engine_keys", "0005_exit_reason", "0005_gateway_load", "0005_liveness_fencing",
                 "0005_reconciler")
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("limits", JSONB, nullable=False, server_default="{}"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    )
    op.add_column("api_keys", sa.Column("tenant", sa.Text, sa.ForeignKey("tenants.name"), nullable=True))
    op.add_column("api_keys", sa.Column("limits", JSONB, nullable=False, server_default="{}"))
    op.create_index("ix_api_keys_tenant", "api_keys", ["tenant"])
    op.execute(
        "CREATE TRIGGER tenants_notify_routes AFTER INSERT OR UPDATE OR DELETE ON tenants "
        "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify_routes()"
    )
    op.create_table(
        "usage",
        sa.Column("minute", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("tenant", sa.Text, primary_key=True),
        sa.Column("key_id", sa.Text, primary_key=True),
        sa.Column("model", sa.Text, primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.create_index("ix_usage_tenant_minute", "usage", ["tenant", "minute"])
    op.create_table(
        "usage_periods",
        sa.Column("period", sa.Text, primary_key=True),  # 'day' or 'month'
        sa.Column("starts_at", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("tenant", sa.Text, primary_key=True),
        sa.Column("key_id", sa.Text, primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.CheckConstraint("period IN ('day', 'month')", name="usage_periods_period"),
    )


def downgrade() -> None:
    op.drop_table("usage_periods")
    op.drop_index("ix_usage_tenant_minute", "usage")
    op.drop_table("usage")
    op.execute("DROP TRIGGER IF EXISTS tenants_notify_routes ON tenants")
    op.drop_index("ix_api_keys_tenant", "api_keys")
    op.drop_column("api_keys", "limits")
    op.drop_column("api_keys", "tenant")
    op.drop_table("tenants")
