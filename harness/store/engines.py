"""Database URLs and engines: resolving ``--db`` / ``$DTBENCH_DB``, showing a URL (password masked), a writer
engine (SQLite: WAL, busy timeout, foreign keys) and a reader engine that cannot change the database.

Used by :mod:`dtbench.harness.store.db` (``connect``) and :mod:`dtbench.harness.store.schema` (migrations under a
lock); it imports neither.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import NullPool

from dtbench.harness.errors import DtbenchError

DB_ENV = "DTBENCH_DB"
DEFAULT_URL = "sqlite:///results.db"


def resolve_url(url: str | None) -> str:
    """``--db`` value, else ``$DTBENCH_DB``, else ``sqlite:///results.db``; a bare path means a SQLite file.

    Raises:
        DtbenchError: if ``url`` (or ``$DTBENCH_DB`` when it is used) is set but empty.
    """
    if url is None:
        url = os.environ.get(DB_ENV)
        if url is not None and not url.strip():
            raise DtbenchError(f"${DB_ENV} is set but empty: give a SQLAlchemy URL or a SQLite file path, or unset it")
        url = url or DEFAULT_URL
    if not url.strip():
        raise DtbenchError("--db is empty: give a SQLAlchemy URL or a SQLite file path")
    url = url.strip()
    if "://" not in url:
        url = f"sqlite:///{url}"
    return url


def display_url(url: str | URL) -> str:
    """The URL as it may be shown to the user: the password masked."""
    try:
        return (url if isinstance(url, URL) else make_url(url)).render_as_string(hide_password=True)
    except ArgumentError:
        return str(url)


def parse_url(url: str) -> URL:
    try:
        return make_url(url)
    except ArgumentError:
        raise DtbenchError(
            f"not a database URL: {url!r} (expected e.g. sqlite:///results.db or postgresql+psycopg://user@host/db)"
        ) from None


def sqlite_path(url: str | URL) -> Path | None:
    """The file of a SQLite URL; None for other backends and for in-memory SQLite."""
    u = url if isinstance(url, URL) else make_url(url)
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:" or u.database.startswith("file:"):
        return None
    return Path(u.database)


def one_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def writer_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for writing: SQLite gets WAL journaling, a 30 s busy timeout and foreign keys.

    Raises:
        DtbenchError: a malformed URL or a missing driver (e.g. psycopg for PostgreSQL: pip install dtbench[postgres]).
    """
    u = parse_url(url)
    try:
        engine = create_engine(u, **kwargs)
    except (ArgumentError, ImportError) as exc:
        raise DtbenchError(f"cannot open database {display_url(u)}: {one_line(exc)}{driver_hint(u)}") from None
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def driver_hint(u: URL) -> str:
    return " (pip install 'dtbench[postgres]')" if u.get_backend_name() == "postgresql" else ""


def _sqlite_reader(path: Path) -> Callable[[], sqlite3.Connection]:
    """A DB-API connection factory that opens the SQLite file ``path`` without ever changing it.

    Never a journal-mode switch, never a pragma that writes, ``query_only`` on. While a writer is active (or a
    crashed one left a ``-wal`` or ``-journal`` file) the file is opened ``mode=ro``: SQLite then reads the
    existing WAL and touches nothing. Otherwise ``mode=ro`` would leave behind ``-wal``/``-shm`` files of a
    WAL-mode database (a read-only connection cannot delete them), so the file is opened ``mode=rw`` (never
    ``rwc``: it is not created) with ``query_only``: nothing can be written, there is nothing to checkpoint, and
    SQLite removes the ``-wal``/``-shm`` files it made when the connection closes. A file we may not write, or one
    in a folder we may not write (see :func:`writable`), with no writer's files beside it, is opened
    ``mode=ro&immutable=1``: SQLite reads it without locks or shared memory, so a WAL-mode database in a read-only
    folder reports (``mode=ro`` alone fails there: "attempt to write a readonly database") and a read-only file
    gets no ``-wal``/``-shm`` files left beside it.
    """
    from urllib.parse import quote

    resolved = path.resolve()
    base = "file:" + quote(str(resolved))

    def creator() -> sqlite3.Connection:
        busy = any(Path(f"{resolved}{suffix}").exists() for suffix in ("-wal", "-journal"))
        if busy:  # a writer is active (or crashed): read its WAL too; SQLite's own files exist already
            query = "mode=ro"
        elif writable(resolved) and writable(resolved.parent):
            query = "mode=rw"
        else:  # nothing can change this file, so read it as it is and create nothing (no -wal/-shm, no lock)
            query = "mode=ro&immutable=1"
        con = sqlite3.connect(f"{base}?{query}", uri=True, timeout=30, check_same_thread=False)
        con.execute("PRAGMA query_only=ON")
        return con

    return creator


def writable(path: Path) -> bool:
    """Whether dtbench may write ``path`` (a file or folder): the process may (``os.access``), and the owner has not
    taken every write bit away (``chmod 444``), which root would otherwise ignore."""
    try:
        return os.access(path, os.W_OK) and bool(path.stat().st_mode & 0o222)
    except OSError:
        return False


def check_writable(url: str) -> None:
    """Fail before anything is loaded when a SQLite results database cannot be written.

    The file itself (if it exists) must be writable, and its folder too: SQLite writes ``-wal``/``-shm`` (or
    ``-journal``) files beside it. Other backends are checked by connecting (their permissions are the server's).

    Raises:
        DtbenchError: one line naming the file or folder that cannot be written.
    """
    path = sqlite_path(url)
    if path is None:
        return
    if path.exists() and path.is_file() and not writable(path):
        raise DtbenchError(
            f"cannot write the results database {path}: the file is read-only (chmod u+w it, or pass "
            f"--db for another database)"
        )
    if path.parent.is_dir() and not writable(path.parent):
        raise DtbenchError(
            f"cannot write the results database {path}: its folder {path.parent} is read-only "
            f"(SQLite writes its journal files beside the database)"
        )


def reader_engine(url: str) -> Engine:
    """An engine that cannot change the database: SQLite opened as :func:`_sqlite_reader` says, PostgreSQL with
    read-only transactions.

    Raises:
        DtbenchError: a malformed URL, a missing driver, no such SQLite file (or not a regular file).
    """
    u = parse_url(url)
    path = sqlite_path(u)
    try:
        if path is not None:
            if not path.exists():
                raise DtbenchError(f"no results database at {path} (run a suite first, or pass --db)")
            if not path.is_file():
                raise DtbenchError(f"{path} is not a results database file (it is a directory or device)")
            return create_engine("sqlite://", creator=_sqlite_reader(path), poolclass=NullPool)
        if u.get_backend_name() == "sqlite":
            raise DtbenchError(f"an in-memory SQLite database ({display_url(u)}) holds no results to read")
        kwargs: dict[str, Any] = {}
        if u.get_backend_name() == "postgresql":
            kwargs["connect_args"] = {"options": "-c default_transaction_read_only=on"}
        return create_engine(u, **kwargs)
    except (ArgumentError, ImportError) as exc:
        raise DtbenchError(f"cannot open database {display_url(u)}: {one_line(exc)}{driver_hint(u)}") from None
