"""The results database (issue 40 item 3): the storage layer, apart from the serving engines of
:mod:`dtbench.decoders.engines` and the servers of :mod:`dtbench.harness.serving`.

- :mod:`~dtbench.harness.store.db`: the SQLAlchemy 2.0 typed models (``runs``, ``cells``, ``samples``,
  ``calibrations``) and ``connect`` (a writer creates or upgrades the schema, a reader opens read-only).
- :mod:`~dtbench.harness.store.engines`: database URLs and SQLAlchemy engines: resolving ``--db`` /
  ``$DTBENCH_DB``, showing a URL with its password masked, the writer engine and the read-only reader engine.
- :mod:`~dtbench.harness.store.schema`: schema versions: runs the Alembic migrations under a cross-process lock
  (``ensure_current``), refuses a database at another revision (``require_current``), recognises one written before
  migrations existed.
- :mod:`~dtbench.harness.store.runs`: run rows: the owning process (host, pid, heartbeat), whether a run may be
  resumed, opening it.
- ``migrations/``: the Alembic environment and revisions (``versions/``, loaded by path), and
  :mod:`~dtbench.harness.store.migrations.baseline`, the frozen columns of revision 0001 and of the interim schema.

Nothing is re-exported here: import the module you need (``from dtbench.harness.store import db``).
"""
