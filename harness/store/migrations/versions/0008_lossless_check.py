"""The tie-aware lossless check (issue 20): per-sample counts of the teacher-forced check, the cell's rule.

samples: lossless_checked (output positions checked), lossless_ties, lossless_errors, lossless_first_error (output
position), lossless_error_margin and lossless_tie_margin (logits: the first error's margin, the largest tie margin),
lossless_noise (the largest |incremental - full| logit difference measured at a diagnosed position),
lossless_check_s (seconds the check took, outside the timed region), lossless_diagnoses (JSON: the diagnosed
positions). cells: lossless_check, the rule of the verdict (exact | tie_aware). All nullable: rows written before
this revision keep NULL, meaning "not checked, the exact rule", so an upgraded run reports exactly what it did.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25
"""

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

SAMPLE_COLUMNS: list[tuple[str, sa.types.TypeEngine[Any]]] = [
    ("lossless_checked", sa.Integer()), ("lossless_ties", sa.Integer()), ("lossless_errors", sa.Integer()),
    ("lossless_first_error", sa.Integer()), ("lossless_error_margin", sa.Float()), ("lossless_tie_margin", sa.Float()),
    ("lossless_noise", sa.Float()), ("lossless_check_s", sa.Float()), ("lossless_diagnoses", sa.JSON()),
]


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        for name, kind in SAMPLE_COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))
    with op.batch_alter_table("cells") as batch:
        batch.add_column(sa.Column("lossless_check", sa.String(length=20), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("cells") as batch:
        batch.drop_column("lossless_check")
    with op.batch_alter_table("samples") as batch:
        for name, _ in reversed(SAMPLE_COLUMNS):
            batch.drop_column(name)
