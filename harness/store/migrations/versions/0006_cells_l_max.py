"""The prompt cap is called L_max everywhere: cells.prompt_cap becomes cells.l_max (same values, same type).

cells: prompt_cap renamed to l_max; the unique constraint (run_id, dataset, l_max, gen_length, label) follows the
column. Values and every other column are unchanged, so an upgraded run reports exactly what it did. SQLite
rebuilds ``cells`` (batch mode); PostgreSQL renames the column in place (its constraint keeps its old name).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("cells") as batch:
        batch.alter_column("prompt_cap", new_column_name="l_max", existing_type=sa.Integer(), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("cells") as batch:
        batch.alter_column("l_max", new_column_name="prompt_cap", existing_type=sa.Integer(), existing_nullable=False)
