"""The machine's load with every cell, and repeats (issue 41).

cells (all nullable; NULL for every cell written before this revision, which reports with no load note), see
``harness/load.py`` for the definitions: cpu_count (logical CPUs), load_start and load_end (1-minute load average
before the cell's first sample and after its last), others_load_max (the largest 1-minute load less this process
tree's own share), others_cpu_s and capacity_cpu_s (CPU seconds other processes took during the cell's samples, and
the wall seconds x CPUs there were: their ratio is the others' CPU share), cpu_mhz_start and cpu_mhz_end (MHz, NULL
where unreadable).

samples: repeat (NOT NULL, default 0: the 0-based repeat of the prompt, suite key ``repeats``; every sample written
before this revision is repeat 0); the unique constraint becomes (cell_id, prompt_index, repeat), named
``uq_samples_prompt_repeat``. No value changes, so an upgraded run reports the same numbers.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# Names an unnamed UNIQUE constraint (SQLite reflects it without a name) so batch mode can drop it.
CONVENTION = {"uq": "uq_%(table_name)s_%(column_0_name)s_%(column_1_name)s"}
FLOATS = ("load_start", "load_end", "others_load_max", "others_cpu_s", "capacity_cpu_s", "cpu_mhz_start",
          "cpu_mhz_end")


def _old_unique(bind: sa.Connection) -> str | None:
    for uq in sa.inspect(bind).get_unique_constraints("samples"):
        if set(uq["column_names"]) == {"cell_id", "prompt_index"}:
            return uq["name"]
    return None


def upgrade() -> None:
    bind = op.get_bind()
    with op.batch_alter_table("cells") as batch:
        batch.add_column(sa.Column("cpu_count", sa.Integer(), nullable=True))
        for name in FLOATS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
    name = _old_unique(bind) or "uq_samples_cell_id_prompt_index"
    with op.batch_alter_table("samples", naming_convention=CONVENTION) as batch:
        batch.add_column(sa.Column("repeat", sa.Integer(), nullable=False, server_default="0"))
        batch.drop_constraint(name, type_="unique")
        batch.create_unique_constraint("uq_samples_prompt_repeat", ["cell_id", "prompt_index", "repeat"])


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_constraint("uq_samples_prompt_repeat", type_="unique")
        batch.create_unique_constraint("uq_samples_cell_id_prompt_index", ["cell_id", "prompt_index"])
        batch.drop_column("repeat")
    with op.batch_alter_table("cells") as batch:
        for name in reversed(FLOATS):
            batch.drop_column(name)
        batch.drop_column("cpu_count")
