"""Run ownership (host, pid, heartbeat), counted forward passes and more per-sample measurements.

runs: owner_host, owner_pid, heartbeat_at (the process writing a run, so `--resume` can refuse a live one).
samples: draft_forwards (count), acceptance_incl_bonus (fraction), mean_path_length_all (tokens), nvml_scope
(process|device); target_forwards becomes nullable; the peak-memory byte columns become BIGINT (PostgreSQL's
INTEGER stops at 2 GiB; SQLite's integers are 64-bit either way). All new columns are nullable: rows written
before this revision keep NULL there. SQLite cannot alter a column in place: ``samples`` is rebuilt (batch mode).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BYTES = ("peak_rss_bytes", "peak_allocated_bytes", "peak_nvml_bytes")


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("owner_host", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("owner_pid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("samples") as batch:
        batch.alter_column("target_forwards", existing_type=sa.Integer(), nullable=True)
        for name in BYTES:
            batch.alter_column(name, existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=True)
        batch.add_column(sa.Column("draft_forwards", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("acceptance_incl_bonus", sa.Float(), nullable=True))
        batch.add_column(sa.Column("mean_path_length_all", sa.Float(), nullable=True))
        batch.add_column(sa.Column("nvml_scope", sa.String(length=20), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        for name in ("nvml_scope", "mean_path_length_all", "acceptance_incl_bonus", "draft_forwards"):
            batch.drop_column(name)
        for name in BYTES:
            batch.alter_column(name, existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=True)
        batch.alter_column("target_forwards", existing_type=sa.Integer(), nullable=False)
    with op.batch_alter_table("runs") as batch:
        for name in ("heartbeat_at", "owner_pid", "owner_host"):
            batch.drop_column(name)
