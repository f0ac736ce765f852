"""Where each sample was measured: the worker's host and device name (the Ray executor's workers).

samples: worker_host, device_name, both nullable; rows written before this revision keep NULL (they came from
the single process that wrote the run, described in runs.environment). A cell whose samples name more than one
device is flagged in reports: speedups across different GPUs are not comparable.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("worker_host", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("device_name", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("device_name")
        batch.drop_column("worker_host")
