"""The cost model's calibrations: forward-latency curves of the target and draft (``dtbench calibrate``).

One row per calibrated point (model role, cache length, n new tokens, mask kind), grouped by ``batch``, linked to
the run it was made for (``run_id``) or standalone (NULL). A new table only: nothing older changes.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=True),
        sa.Column("batch", sa.String(length=32), nullable=False),
        sa.Column("suite_name", sa.String(length=200), nullable=False),
        sa.Column("suite_hash", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=10), nullable=False),
        sa.Column("model", sa.String(length=500), nullable=False),
        sa.Column("dtype", sa.String(length=20), nullable=False),
        sa.Column("device", sa.String(length=50), nullable=False),
        sa.Column("device_name", sa.String(length=300), nullable=False),
        sa.Column("prompt_len", sa.Integer(), nullable=False),
        sa.Column("cache_len", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("tree_mask", sa.Boolean(), nullable=False),
        sa.Column("last_only", sa.Boolean(), nullable=False),
        sa.Column("median_s", sa.Float(), nullable=False),
        sa.Column("iqr_s", sa.Float(), nullable=False),
        sa.Column("repeats", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_calibrations_run_id", "calibrations", ["run_id"])
    op.create_index("ix_calibrations_batch", "calibrations", ["batch"])


def downgrade() -> None:
    op.drop_index("ix_calibrations_batch", table_name="calibrations")
    op.drop_index("ix_calibrations_run_id", table_name="calibrations")
    op.drop_table("calibrations")
