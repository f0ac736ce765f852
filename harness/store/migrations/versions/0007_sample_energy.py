"""Energy per sample (issue 24): samples.energy_j, energy_status, energy_source.

Joules over the sample as an energy counter measured it (NVML on CUDA, RAPL on CPU, through Zeus); the status says
measured, unavailable (no counter readable), too_short (the sample was shorter than the counter's update period) or
counter_reset. Rows written before this revision keep NULL in all three (energy was not measured); J/token and
tokens/J are derived from energy_j and new_tokens (harness/metrics.py).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("energy_j", sa.Float(), nullable=True))
        batch.add_column(sa.Column("energy_status", sa.String(length=20), nullable=True))
        batch.add_column(sa.Column("energy_source", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("energy_source")
        batch.drop_column("energy_status")
        batch.drop_column("energy_j")
