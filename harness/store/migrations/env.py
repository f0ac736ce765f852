"""Alembic environment for dtbench's results database.

dtbench runs its migrations itself (``dtbench db upgrade``, or ``dtbench run`` on an older database) through
:mod:`dtbench.harness.store.schema`, which opens the connection, takes the cross-process schema lock and hands the
connection over in ``config.attributes["connection"]``; the migrations then run inside that transaction.
"""

from alembic import context

from dtbench.harness.store.db import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "dtbench's migrations run through dtbench.harness.store.schema: use `dtbench db upgrade --db URL`"
    )

context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True, compare_type=True)
with context.begin_transaction():
    context.run_migrations()
