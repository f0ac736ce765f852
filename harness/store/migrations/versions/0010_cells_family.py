"""Cells record their decoder's family (issue 18): reports and the cost model read capabilities, never names.

cells: family (``ar`` / ``chain`` / ``tree`` / ``external``: :attr:`dtbench.decoders.base.Decoder.family`, stored
by the runner with every new cell). Cells written before this revision get the family their decoder declares in
the dtbench installed at upgrade time (built-ins and installed plugins); a decoder that is not installed then
leaves NULL, which reports read as ``external`` (nothing assumed). No other column changes, so an upgraded run
reports the same numbers.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def _family(name: str) -> str | None:
    """The family the installed decoder ``name`` declares, or None if it is not installed or fails to load."""
    from dtbench.harness import registry
    from dtbench.harness.errors import DtbenchError

    try:
        return registry.get(name).family
    except (DtbenchError, Exception):  # an uninstalled or broken plugin: leave NULL (read as external)
        return None


def upgrade() -> None:
    with op.batch_alter_table("cells") as batch:
        batch.add_column(sa.Column("family", sa.String(length=20), nullable=True))
    bind = op.get_bind()
    cells = sa.table("cells", sa.column("decoder", sa.String()), sa.column("family", sa.String()))
    for (name,) in bind.execute(sa.select(cells.c.decoder).distinct()).all():
        family = _family(name)
        if family is not None:
            bind.execute(cells.update().where(cells.c.decoder == name).values(family=family))


def downgrade() -> None:
    with op.batch_alter_table("cells") as batch:
        batch.drop_column("family")
