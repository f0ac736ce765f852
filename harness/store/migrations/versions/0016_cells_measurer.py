"""Cells record who measured them (issue 49 item 4): reports tell a served cell by what is stored, never by its params.

cells: measurer (``local``: dtbench's own decoding loop, timed Step by Step; ``served``: requests to a server, timed
by the request client), not null, server default ``local``; the runner stores it with every new cell (the decoder's
``requests`` capability: :func:`dtbench.harness.measurers.measurer_name`). Cells written before this revision get
``served`` exactly where the reports before it read a served cell: params naming an engine adapter (``engine``) or
where a server runs (``base_url``, ``launch``) as a string or a list; every other cell ``local``. So an upgraded run
reports the same numbers (tests/test_migrations.py).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

SERVER_PARAMS = ("engine", "base_url", "launch")  # what the reports before 0016 read a served cell by (frozen here)


def _served(params) -> bool:
    """The pre-0016 reports' test of a served cell, on a stored params value (a dict, or JSON text on some drivers)."""
    if isinstance(params, str):
        try:
            params = json.loads(params)
        except ValueError:
            return False
    return isinstance(params, dict) and any(isinstance(params.get(k), (str, list)) for k in SERVER_PARAMS)


def upgrade() -> None:
    with op.batch_alter_table("cells") as batch:
        batch.add_column(sa.Column("measurer", sa.String(length=10), nullable=False, server_default="local"))
    bind = op.get_bind()
    cells = sa.table("cells", sa.column("id", sa.Integer()), sa.column("params", sa.JSON()))
    served = [cid for cid, params in bind.execute(sa.select(cells.c.id, cells.c.params)).all() if _served(params)]
    measurer = sa.table("cells", sa.column("id", sa.Integer()), sa.column("measurer", sa.String()))
    for start in range(0, len(served), 500):
        chunk = served[start : start + 500]
        bind.execute(measurer.update().where(measurer.c.id.in_(chunk)).values(measurer="served"))


def downgrade() -> None:
    with op.batch_alter_table("cells") as batch:
        batch.drop_column("measurer")
