"""A run that died, and every compile step of a cell (issue 50).

runs: measuring_cell_id (nullable; NULL for every run written before this revision): the cell whose decoder the run's
process was measuring (set when a decoder starts on a prompt group, cleared when its outcome is stored). A run whose
process died with its status still ``running`` is marked ``crashed`` by the next ``dtbench run --resume`` or
``dtbench report`` (its owner pid gone: ``harness/store/runs.py``), and that cell ``failed``, so ``--resume
--skip-failed`` goes past a cell that crashes its process every time.

cells: compile_runs (JSON list of ``[seconds, graphs]``, one per compile step, nullable): a resumed run compiles a
compiled cell again in its new process; the first compile step stays in compile_s/compile_graphs and every one is
listed here. NULL for every cell written before this revision. No value changes, so an upgraded run reports the same.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("measuring_cell_id", sa.Integer(), nullable=True))
    with op.batch_alter_table("cells") as batch:
        batch.add_column(sa.Column("compile_runs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("cells") as batch:
        batch.drop_column("compile_runs")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("measuring_cell_id")
