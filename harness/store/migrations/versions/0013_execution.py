"""Compiled execution (issue 37): a cell is eager or compiled; compile time and each sample's roofline fraction.

cells: execution (NOT NULL, default 'eager': every cell written before this revision ran eager transformers, so it
reports as eager), compile_s (seconds of the cell's compile step, before its warmup; NULL for eager cells) and
compile_graphs (graphs torch.compile made in that step). samples: roofline (memory-bandwidth-limit seconds of the
sample's forwards over its total_s; NULL before this revision). No value changes, so an upgraded run reports the same
numbers. Compiled cells carry a distinct label ('<label> [compiled]'), so the unique constraint stays.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("cells") as batch:
        batch.add_column(sa.Column("execution", sa.String(20), nullable=False, server_default="eager"))
        batch.add_column(sa.Column("compile_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("compile_graphs", sa.Integer(), nullable=True))
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("roofline", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("roofline")
    with op.batch_alter_table("cells") as batch:
        batch.drop_column("compile_graphs")
        batch.drop_column("compile_s")
        batch.drop_column("execution")
