"""Initial schema: catalog, model state, nodes, replicas, shards, and change notifications.

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.create_table(
        "catalog_models",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("position", sa.Integer, nullable=False, server_default="0"),
        sa.Column("spec", JSONB, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    )
    op.create_table(
        "model_state",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("failures", sa.Integer, nullable=False, server_default="0"),
        sa.Column("backoff_until", sa.DateTime(timezone=True)),
        sa.Column("demand_at", sa.DateTime(timezone=True)),
        sa.Column("last_used_at", sa.DateTime(timezone=True)),
        sa.Column("in_flight", sa.Integer, nullable=False, server_default="0"),
        sa.Column("decisions", JSONB),
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("boot_id", sa.Text),
        sa.Column("inventory", JSONB, nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    )
    op.create_table(
        "replicas",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("model", sa.Text, nullable=False, index=True),
        sa.Column("profile", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("endpoint", sa.Text),
        sa.Column("failure", sa.Text),
        sa.Column("reason", sa.Text),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("ready_at", sa.DateTime(timezone=True)),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
    )
    op.create_table(
        "shards",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("replica_id", sa.Text, sa.ForeignKey("replicas.id", ondelete="CASCADE"), nullable=False, index=True),
        sa.Column("rank", sa.Integer, nullable=False, server_default="0"),
        sa.Column("node_id", sa.Text, nullable=False, index=True),
        sa.Column("gpus", JSONB, nullable=False, server_default="[]"),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("pid", sa.Integer),
        sa.Column("endpoint", sa.Text),
        sa.Column("exit_code", sa.Integer),
        sa.Column("output_tail", sa.Text),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    )
    # Gateways LISTEN on llmgw_routes and reload their route table when replicas or the catalog change.
    op.execute(
        """
        CREATE FUNCTION llmgw_notify_routes() RETURNS trigger AS $$
        BEGIN
            PERFORM pg_notify('llmgw_routes', TG_TABLE_NAME);
            RETURN NULL;
        END;
        $$ LANGUAGE plpgsql;
        """
    )
    for table in ("replicas", "catalog_models"):
        op.execute(
            f"CREATE TRIGGER {table}_notify_routes AFTER INSERT OR UPDATE OR DELETE ON {table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify_routes()"
        )


def downgrade() -> None:
    for table in ("replicas", "catalog_models"):
        op.execute(f"DROP TRIGGER IF EXISTS {table}_notify_routes ON {table}")
    op.execute("DROP FUNCTION IF EXISTS llmgw_notify_routes()")
    for table in ("shards", "replicas", "nodes", "model_state", "catalog_models"):
        op.drop_table(table)
