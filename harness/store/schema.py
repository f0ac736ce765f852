"""Schema versions of the results database: Alembic migrations (``harness/store/migrations``), run by dtbench itself.

* :func:`ensure_current` (writers: ``dtbench run``, ``dtbench db upgrade``) creates a new database at the newest
  revision or upgrades an older one, holding a cross-process lock while it looks and changes: on SQLite an
  exclusive write transaction (``BEGIN EXCLUSIVE``, waiting up to 30 s for another process's), on PostgreSQL a
  transaction-scoped advisory lock (``pg_advisory_xact_lock``), so several processes starting at once on a new
  database never race into "table already exists". Everything happens in one transaction: on PostgreSQL an
  upgrade that fails leaves the database as it was.
* :func:`require_current` (readers: ``dtbench report``, ``dtbench db current``) refuses a database that is not at
  this code's revision, with the one-line instruction to upgrade it.
* A database written before migrations existed has no ``alembic_version`` table: one whose ``runs``, ``cells``
  and ``samples`` tables have revision 0001's columns (plus, at most, the ones that dtbench between commit 3c3e168
  and the migrations added with ``create_all``) is stamped 0001, then upgraded.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from dtbench.harness.errors import DtbenchError
from dtbench.harness.store.engines import display_url, driver_hint, one_line, sqlite_path, writer_engine
from dtbench.harness.store.migrations.baseline import BASELINE_COLUMNS, BASELINE_REVISION, INTERIM_COLUMNS

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "alembic_version"
TABLES = ("runs", "cells", "samples")
PG_LOCK_KEY = 0x64_74_62_65_6E_63_68  # "dtbench": the advisory lock every dtbench process takes to change a schema
SQLITE_LOCK_TIMEOUT_MS = 30_000


def _config(connection: Connection | None = None):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("path_separator", "os")
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@lru_cache(maxsize=1)
def _script():
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_config())


def head() -> str:
    """The newest schema revision this code knows (the one it reads and writes)."""
    return _script().get_current_head()


def revisions() -> list[str]:
    """Every known revision, oldest first."""
    return [r.revision for r in reversed(list(_script().walk_revisions()))]


@dataclass
class State:
    """What a database holds. ``kind``: ``new`` (no tables of ours, maybe others), ``versioned`` (has
    ``alembic_version``), ``unversioned`` (revision 0001 written before migrations), ``foreign`` (tables of ours
    that match no revision)."""

    kind: str
    revision: str | None = None
    tables: list[str] = field(default_factory=list)


def inspect_state(conn: Connection) -> State:
    """Look at the tables of the database behind ``conn`` (reads only)."""
    names = sorted(inspect(conn).get_table_names())
    if VERSION_TABLE in names:
        rows = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
        return State("versioned", ",".join(sorted(rows)) or None, names)
    ours = [t for t in TABLES if t in names]
    if not ours:
        return State("new", None, names)
    insp = inspect(conn)
    if len(ours) == len(TABLES) and all(
        BASELINE_COLUMNS[t] <= cols <= BASELINE_COLUMNS[t] | INTERIM_COLUMNS[t]
        for t in TABLES
        for cols in [{c["name"] for c in insp.get_columns(t)}]
    ):
        return State("unversioned", BASELINE_REVISION, names)
    return State("foreign", None, names)


def newer(where: str, revision: str) -> DtbenchError:
    return DtbenchError(
        f"the results database {where} is at schema revision {revision}, newer than this dtbench "
        f"knows (up to {head()}): upgrade dtbench to read or write it"
    )


def not_ours(where: str, state: State) -> DtbenchError:
    if not state.tables:
        what = "it is empty"
    else:
        shown = ", ".join(state.tables[:8]) + (", ..." if len(state.tables) > 8 else "")
        what = f"its tables: {shown}"
    return DtbenchError(f"{where} is not a dtbench results database ({what})")


def _lock_engine(url: str) -> Engine:
    """A one-connection engine whose transactions hold the schema lock (SQLite: BEGIN EXCLUSIVE)."""
    engine = writer_engine(url, poolclass=NullPool)
    if engine.dialect.name == "sqlite":
        engine.dispose()
        engine = create_engine(engine.url, poolclass=NullPool)  # without writer_engine's pragmas: ours below

        @event.listens_for(engine, "connect")
        def _autocommit_driver(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # pysqlite must not issue its own BEGIN: we issue BEGIN EXCLUSIVE
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout={SQLITE_LOCK_TIMEOUT_MS}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _exclusive(conn):
            conn.exec_driver_sql("BEGIN EXCLUSIVE")

    return engine


def _switch_to_wal(engine: Engine) -> None:
    """Put a SQLite database in WAL mode (a no-op when it is). Changing the journal mode needs the file to itself,
    and SQLite may answer "database is locked" at once rather than wait while another process holds it (several
    processes creating a database together): retry for up to the busy timeout."""
    deadline = time.monotonic() + SQLITE_LOCK_TIMEOUT_MS / 1000
    raw = engine.raw_connection()  # autocommit: no BEGIN EXCLUSIVE around the journal switch
    try:
        while True:
            try:
                raw.cursor().execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
    finally:
        raw.close()


def _where(url: str) -> str:
    path = sqlite_path(url)
    return str(path) if path is not None else display_url(url)


def ensure_current(url: str, *, note: Callable[[str], None] | None = None) -> tuple[str | None, str]:
    """Create the database at the newest revision, or upgrade it; return (revision before, revision after).

    ``note`` gets one line when an existing database is upgraded (not when a new one is created). The look and the
    change hold the schema lock (see the module docstring), so concurrent callers serialize and all succeed.

    Raises:
        DtbenchError: the database cannot be opened or written; it is not a dtbench database (a SQLite file with
            other tables, or tables of ours matching no revision); it is newer than this code; a migration failed.
    """
    where = _where(url)
    path = sqlite_path(url)
    if path is not None and path.exists() and not path.is_file():
        raise DtbenchError(f"{path} is not a results database file (it is a directory or device)")
    if path is not None and not path.parent.is_dir():
        raise DtbenchError(f"cannot open database {path}: folder {path.parent} does not exist")
    engine = _lock_engine(url)
    from alembic import command
    from alembic.util import CommandError

    target = head()
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":  # wait at most a minute for another process's schema change
                conn.execute(text(f"SET LOCAL lock_timeout = '{SQLITE_LOCK_TIMEOUT_MS * 2}ms'"))
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_LOCK_KEY})
            state = inspect_state(conn)
            if state.kind == "foreign" or (state.kind == "new" and state.tables and conn.dialect.name == "sqlite"):
                raise not_ours(where, state)
            before = state.revision
            if state.kind == "versioned" and before not in revisions():
                raise newer(where, str(before))
            if state.kind == "unversioned":
                command.stamp(_config(conn), BASELINE_REVISION)
            if before != target:
                command.upgrade(_config(conn), "head")
        if conn.dialect.name == "sqlite":  # only now that the file is known to be ours (WAL persists in the file)
            _switch_to_wal(engine)
    except DtbenchError:
        raise
    except (SQLAlchemyError, sqlite3.Error, OSError, ImportError, CommandError) as exc:
        raise _open_error(url, exc) from None
    finally:
        engine.dispose()
    if before is not None and before != target and note is not None:
        note(f"upgraded the results database {where} from schema revision {before} to {target}")
    return before, target


def _open_error(url: str, exc: BaseException) -> DtbenchError:
    """One line for a database that could not be opened, read or changed."""
    msg = one_line(exc)
    if "file is not a database" in msg:
        return DtbenchError(f"{_where(url)} is not a dtbench results database (not a SQLite file)")
    return DtbenchError(f"cannot open database {display_url(url)}: {msg}{_hint(url, exc)}")


def _hint(url: str, exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        from sqlalchemy.engine import make_url

        return driver_hint(make_url(url))
    return ""


def current(engine: Engine, url: str) -> State:
    """The state of the database behind ``engine`` (read only).

    Raises:
        DtbenchError: the database cannot be opened or is not a database at all (e.g. a text file).
    """
    try:
        with engine.connect() as conn:
            return inspect_state(conn)
    except (SQLAlchemyError, sqlite3.Error, OSError, ImportError) as exc:
        raise _open_error(url, exc) from None


def upgrade_instruction(url: str) -> str:
    """The command that upgrades the database at ``url``, quoted for a one-line message."""
    return f"run 'dtbench db upgrade --db {display_url(url)}'"


def require_current(engine: Engine, url: str) -> State:
    """Check that the database behind ``engine`` is a dtbench database at this code's revision (read only).

    Raises:
        DtbenchError: not a dtbench database (an empty file, a foreign SQLite file, a text file); an older
            revision (the message says ``run 'dtbench db upgrade --db URL'``); a newer revision than this code.
    """
    state = current(engine, url)
    where = _where(url)
    if state.kind in ("new", "foreign"):
        raise not_ours(where, state)
    if state.revision == head():
        return state
    if state.kind == "versioned" and state.revision not in revisions():
        raise newer(where, str(state.revision))
    raise DtbenchError(
        f"the results database {where} has schema revision {state.revision}, older than this "
        f"dtbench's {head()}: {upgrade_instruction(url)}"
    )
