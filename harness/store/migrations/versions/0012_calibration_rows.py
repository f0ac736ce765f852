"""Batched calibration (issue 29): calibrations.rows, the sequences one calibrated forward decodes together.

calibrations: rows (nullable integer): B of a batched verification forward (``kind`` batched: B rows of n new tokens,
per-row 4D masks); NULL for every point written before this revision, read as 1. No other column changes.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calibrations") as batch:
        batch.add_column(sa.Column("rows", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calibrations") as batch:
        batch.drop_column("rows")
