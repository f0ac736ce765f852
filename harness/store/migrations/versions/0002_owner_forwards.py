"""Run ownership (host, pid, heartbeat), counted forward passes and more per-sample measurements.

runs: owner_host, owner_pid, heartbeat_at (the process writing a run, so `--resume` can refuse a live one).
samples: draft_forwards (count), acceptance_incl_bonus (ratio), mean_path_length_all (tokens), nvml_scope
(what the NVML peak covers); target_forwards becomes nullable; the peak-memory byte columns become BIGINT
(PostgreSQL's INTEGER stops at 2 GiB; SQLite's integers are 64-bit either way). All new columns are nullable: rows
written before this revision keep NULL there. SQLite cannot alter a column in place: ``samples`` is rebuilt (batch
mode). A column that already exists is not added again: dtbench between commits 3c3e168 and the migrations created
these columns with ``create_all`` (such a database is stamped 0001 and upgraded here like any other).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BYTES = ("peak_rss_bytes", "peak_allocated_bytes", "peak_nvml_bytes")


NEW_COLUMNS: dict[str, list[sa.Column[Any]]] = {
    "runs": [
        sa.Column("owner_host", sa.String(length=255), nullable=True),
        sa.Column("owner_pid", sa.Integer(), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
    ],
    "samples": [
        sa.Column("draft_forwards", sa.Integer(), nullable=True),
        sa.Column("acceptance_incl_bonus", sa.Float(), nullable=True),
        sa.Column("mean_path_length_all", sa.Float(), nullable=True),
        sa.Column("nvml_scope", sa.String(length=20), nullable=True),
    ],
}


def upgrade() -> None:
    insp = sa.inspect(op.get_bind())
    have = {t: {c["name"] for c in insp.get_columns(t)} for t in NEW_COLUMNS}
    with op.batch_alter_table("runs") as batch:
        for column in NEW_COLUMNS["runs"]:
            if column.name not in have["runs"]:
                batch.add_column(column)
    with op.batch_alter_table("samples") as batch:
        batch.alter_column("target_forwards", existing_type=sa.Integer(), nullable=True)
        for name in BYTES:
            batch.alter_column(name, existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=True)
        for column in NEW_COLUMNS["samples"]:
            if column.name not in have["samples"]:
                batch.add_column(column)


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
