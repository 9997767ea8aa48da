"""Files and batches (issue 41): `batch_files` (uploaded JSONL and the output and error files a batch
writes), `batches` (one row per `POST /v1/batches`), and `batch_results` (one row per request a batch
answered, keyed by (batch_id, custom_id): a request whose row is committed is never sent again, and its
usage is added in the same transaction, so it is counted once).

Revision ID: 0016_batches
Revises: 0015_lora_adapters
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0016_batches"
down_revision = "0015_lora_adapters"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batch_files",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("purpose", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_index("batch_files_owner", "batch_files", ["owner", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False, server_default=""),
        sa.Column("tenant", sa.Text(), nullable=False, server_default=""),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("input_file_id", sa.Text(), nullable=False),
        sa.Column("completion_window", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("metadata", JSONB),
        sa.Column("errors", JSONB),
        sa.Column("output_file_id", sa.Text()),
        sa.Column("error_file_id", sa.Text()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("in_progress_at", sa.DateTime(timezone=True)),
        sa.Column("finalizing_at", sa.DateTime(timezone=True)),
        sa.Column("completed_at", sa.DateTime(timezone=True)),
        sa.Column("expired_at", sa.DateTime(timezone=True)),
        sa.Column("cancelling_at", sa.DateTime(timezone=True)),
        sa.Column("cancelled_at", sa.DateTime(timezone=True)),
        sa.Column("failed_at", sa.DateTime(timezone=True)),
    )
    op.create_index("batches_owner", "batches", ["owner", "id"])
    op.create_table(
        "batch_results",
        sa.Column("batch_id", sa.Text(), sa.ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("custom_id", sa.Text(), primary_key=True),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("body", JSONB, nullable=False),
        sa.Column("answered_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )


def downgrade() -> None:
    op.drop_table("batch_results")
    op.drop_table("batches")
    op.drop_table("batch_files")
