"""Batch sizes (issue 29): a cell is (dataset, L_max, T, batch size B, decoder); batched samples record their group.

cells: batch_size (NOT NULL, default 1: every cell written before this revision was decoded one prompt at a time, so
it reports as B = 1); the unique constraint becomes (run_id, dataset, l_max, gen_length, batch_size, label), named
``uq_cells_point_label``. samples: batch_group (the prompt group's first prompt index), batch_rows (prompts decoded
together) and batch_total_s (the group's wall time, seconds), NULL for B = 1. No value changes, so an upgraded run
reports the same numbers.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

OLD = {"run_id", "dataset", "l_max", "gen_length", "label"}
# Names an unnamed UNIQUE constraint (SQLite reflects it without a name) so batch mode can drop it.
CONVENTION = {"uq": "uq_%(table_name)s_%(column_0_name)s_%(column_1_name)s"}


def _old_unique(bind: sa.Connection) -> str | None:
    for uq in sa.inspect(bind).get_unique_constraints("cells"):
        if set(uq["column_names"]) in (OLD, {*OLD - {"l_max"}, "prompt_cap"}):
            return uq["name"]
    return None


def upgrade() -> None:
    bind = op.get_bind()
    name = _old_unique(bind) or "uq_cells_run_id_dataset"
    with op.batch_alter_table("cells", naming_convention=CONVENTION) as batch:
        batch.add_column(sa.Column("batch_size", sa.Integer(), nullable=False, server_default="1"))
        batch.drop_constraint(name, type_="unique")
        batch.create_unique_constraint("uq_cells_point_label",
                                       ["run_id", "dataset", "l_max", "gen_length", "batch_size", "label"])
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("batch_group", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("batch_rows", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("batch_total_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("batch_total_s")
        batch.drop_column("batch_rows")
        batch.drop_column("batch_group")
    with op.batch_alter_table("cells") as batch:
        batch.drop_constraint("uq_cells_point_label", type_="unique")
        batch.create_unique_constraint("uq_cells_run_id_dataset", ["run_id", "dataset", "l_max", "gen_length",
                                                                   "label"])
        batch.drop_column("batch_size")
