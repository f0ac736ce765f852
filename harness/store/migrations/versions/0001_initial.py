"""The schema of dtbench before migrations existed (what ``Base.metadata.create_all`` made at commit 02deb54).

Databases written then have no ``alembic_version`` table; :mod:`dtbench.harness.store.schema` recognises them by their
tables and columns and stamps them with this revision before upgrading.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("suite_name", sa.String(length=200), nullable=False),
        sa.Column("suite_path", sa.String(length=1000), nullable=True),
        sa.Column("suite_text", sa.Text(), nullable=False),
        sa.Column("suite_hash", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("environment", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "cells",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("dataset", sa.String(length=200), nullable=False),
        sa.Column("prompt_cap", sa.Integer(), nullable=False),
        sa.Column("gen_length", sa.Integer(), nullable=False),
        sa.Column("decoder", sa.String(length=200), nullable=False),
        sa.Column("label", sa.String(length=300), nullable=False),
        sa.Column("decoder_version", sa.String(length=100), nullable=False),
        sa.Column("decoder_distribution", sa.String(length=200), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("lossless_expected", sa.Boolean(), nullable=False),
        sa.Column("reference_label", sa.String(length=300), nullable=True),
        sa.Column("target_model", sa.String(length=500), nullable=False),
        sa.Column("draft_model", sa.String(length=500), nullable=True),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "dataset", "prompt_cap", "gen_length", "label"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
    )
    op.create_index("ix_cells_run_id", "cells", ["run_id"], unique=False)
    op.create_table(
        "samples",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cell_id", sa.Integer(), nullable=False),
        sa.Column("prompt_index", sa.Integer(), nullable=False),
        sa.Column("document", sa.String(length=500), nullable=False),
        sa.Column("warmup", sa.Boolean(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("new_tokens", sa.Integer(), nullable=False),
        sa.Column("total_s", sa.Float(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=False),
        sa.Column("tpot_s", sa.Float(), nullable=True),
        sa.Column("throughput", sa.Float(), nullable=False),
        sa.Column("iterations", sa.Integer(), nullable=False),
        sa.Column("tokens_per_iteration", sa.Float(), nullable=False),
        sa.Column("drafted", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("draft_depth", sa.Integer(), nullable=False),
        sa.Column("acceptance_rate", sa.Float(), nullable=True),
        sa.Column("mean_path_length", sa.Float(), nullable=True),
        sa.Column("target_forwards", sa.Integer(), nullable=False),
        sa.Column("step_tokens", sa.JSON(), nullable=False),
        sa.Column("step_stats", sa.JSON(), nullable=False),
        sa.Column("step_times_s", sa.JSON(), nullable=False),
        sa.Column("peak_rss_bytes", sa.Integer(), nullable=True),
        sa.Column("peak_allocated_bytes", sa.Integer(), nullable=True),
        sa.Column("peak_nvml_bytes", sa.Integer(), nullable=True),
        sa.Column("output_hash", sa.String(length=64), nullable=False),
        sa.Column("output_tokens", sa.JSON(), nullable=False),
        sa.Column("lossless", sa.Boolean(), nullable=True),
        sa.Column("first_divergence", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("cell_id", "prompt_index"),
        sa.ForeignKeyConstraint(["cell_id"], ["cells.id"], ondelete="CASCADE"),
    )
    op.create_index("ix_samples_cell_id", "samples", ["cell_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_samples_cell_id", table_name="samples")
    op.drop_table("samples")
    op.drop_index("ix_cells_run_id", table_name="cells")
    op.drop_table("cells")
    op.drop_table("runs")
