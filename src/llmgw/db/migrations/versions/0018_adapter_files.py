"""`shards.adapters`: rank 0's LoRA adapter files as its node fetched and verified them (issue 40).

`{name: {"path", "error", "id"}}` from the node's shard report (`schemas/inventory.AdapterFile`): the gateway
gives the engine the node-local verified `path`, and refuses an adapter whose file failed verification
(`error`) without sending its load. NULL: the shard has no fetched adapters.

Revision ID: 0018_adapter_files
Revises: 0017_poll_read
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0018_adapter_files"
down_revision = "0017_poll_read"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("shards", sa.Column("adapters", JSONB))


def downgrade() -> None:
    op.drop_column("shards", "adapters")
