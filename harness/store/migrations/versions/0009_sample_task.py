"""Which task each sample belongs to (issue 21, question datasets such as Spec-Bench).

samples: task_group (a Spec-Bench group such as mt_bench, or the raw category a suite selected), category (the
question's raw category), turn (1-based turn of a multi-turn question) and question_id, all nullable; raw-text
samples and rows written before this revision keep NULL, so old runs report exactly what they did.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("task_group", sa.String(length=100), nullable=True))
        batch.add_column(sa.Column("category", sa.String(length=100), nullable=True))
        batch.add_column(sa.Column("turn", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("question_id", sa.String(length=100), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("question_id")
        batch.drop_column("turn")
        batch.drop_column("category")
        batch.drop_column("task_group")
