"""API keys for the gateway: only a hash of each key is stored; revocation notifies the gateways.

Revision ID: 0002_api_keys
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002_api_keys"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("name", sa.Text, nullable=False, server_default=""),
        sa.Column("prefix", sa.Text, nullable=False),
        sa.Column("key_hash", sa.Text, nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
    )
    # Gateways reload their keys on this notification (payload: the table name), so a revoked key stops
    # working at once rather than at the next periodic refresh. The function comes from 0001.
    op.execute(
        "CREATE TRIGGER api_keys_notify_routes AFTER INSERT OR UPDATE OR DELETE ON api_keys "
        "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify_routes()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS api_keys_notify_routes ON api_keys")
    op.drop_table("api_keys")
