"""The results database: SQLAlchemy 2.0 typed models and engine setup (SQLite by default, any SQLAlchemy URL).

Tables: ``runs`` (suite text and hash, environment, status, owner), ``cells`` (one decoder configuration on one
dataset x prompt cap L_max x T), ``samples`` (one prompt of one cell, committed as soon as it is measured),
``calibrations`` (forward-latency curves of the cost model, linked to a run or standalone).
Times are seconds, memory bytes, throughput tokens/s. Timestamps are stored in UTC and read back as naive UTC
datetimes on every backend (SQLite keeps no offset; PostgreSQL's ``timestamptz`` is converted), so reports are
the same whichever database holds the run.

The schema is versioned by Alembic (``harness/migrations``, driven by :mod:`dtbench.harness.schema`): a writer
(``connect(url)``, ``dtbench run``) creates or upgrades the schema under a cross-process lock; a reader
(``connect(url, create=False)``, ``dtbench report``) opens the database read-only and refuses one that is not at
this code's revision. PostgreSQL works through ``postgresql+psycopg://...`` (``pip install dtbench[postgres]``).
"""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Integer, String, Text, TypeDecorator,
                        UniqueConstraint, create_engine, event, select)
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker
from sqlalchemy.pool import NullPool

from dtbench.harness.errors import DtbenchError

DB_ENV = "DTBENCH_DB"
DEFAULT_URL = "sqlite:///results.db"


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (what the models store)."""
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """``DateTime(timezone=True)`` that stores UTC and reads back a naive UTC datetime on every backend.

    Aware values are converted to UTC before storing; naive values are taken as UTC. SQLite drops the offset
    (today's databases hold naive UTC text), PostgreSQL returns ``timestamptz`` in the session's time zone: both
    come back as the same naive UTC value, so a run reports identically from either database. Compare with
    ``utcnow().replace(tzinfo=None)``, or make a value aware with ``value.replace(tzinfo=timezone.utc)``.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(timezone.utc)
            if dialect.name == "sqlite":
                value = value.replace(tzinfo=None)
        elif value is not None and dialect.name != "sqlite":
            value = value.replace(tzinfo=timezone.utc)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(timezone.utc).replace(tzinfo=None)
        return value


class Base(DeclarativeBase):
    pass


class Run(Base):
    """One invocation of ``dtbench run``: the suite and the environment it ran in."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    suite_name: Mapped[str] = mapped_column(String(200))
    suite_path: Mapped[str | None] = mapped_column(String(1000))
    suite_text: Mapped[str] = mapped_column(Text)
    suite_hash: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(20), default="running")  # running|completed|interrupted|failed
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    environment: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    error: Mapped[str | None] = mapped_column(Text)
    # Revision 0002: the process writing the run, so `--resume` can refuse a live one (None for runs written
    # before 0002): host (socket.gethostname()), pid, and the last sign of life (UTC; refreshed while it runs).
    owner_host: Mapped[str | None] = mapped_column(String(255))
    owner_pid: Mapped[int | None] = mapped_column(Integer)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cells: Mapped[list["Cell"]] = relationship(back_populates="run", cascade="all, delete-orphan")


class Cell(Base):
    """One decoder configuration on one (dataset, L_max, T) of a run."""

    __tablename__ = "cells"
    __table_args__ = (UniqueConstraint("run_id", "dataset", "l_max", "gen_length", "label"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    dataset: Mapped[str] = mapped_column(String(200))
    l_max: Mapped[int] = mapped_column(Integer)  # the prompt cap L_max (column prompt_cap before revision 0006)
    gen_length: Mapped[int] = mapped_column(Integer)
    decoder: Mapped[str] = mapped_column(String(200))
    label: Mapped[str] = mapped_column(String(300))
    decoder_version: Mapped[str] = mapped_column(String(100))
    decoder_distribution: Mapped[str] = mapped_column(String(200))
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # every param, defaults included
    sweep_group: Mapped[str | None] = mapped_column(String(300))  # label of the sweep entry this cell is a point of
    swept: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # its point of that sweep grid
    sampling: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # temperature, top_k, top_p, seed; None: greedy
    lossless_expected: Mapped[bool] = mapped_column(Boolean, default=True)
    # 0008: the rule of its samples' lossless verdict (exact | tie_aware; harness/lossless.py); NULL before: exact
    lossless_check: Mapped[str | None] = mapped_column(String(20))
    reference_label: Mapped[str | None] = mapped_column(String(300))
    target_model: Mapped[str] = mapped_column(String(500))
    draft_model: Mapped[str | None] = mapped_column(String(500))
    status: Mapped[str] = mapped_column(String(20), default="pending")  # pending|running|done|failed
    error: Mapped[str | None] = mapped_column(Text)
    run: Mapped[Run] = relationship(back_populates="cells")
    samples: Mapped[list["Sample"]] = relationship(back_populates="cell", cascade="all, delete-orphan")


class Sample(Base):
    """One prompt decoded by one cell: times (s), counters, memory (bytes), output identity."""

    __tablename__ = "samples"
    __table_args__ = (UniqueConstraint("cell_id", "prompt_index"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    cell_id: Mapped[int] = mapped_column(ForeignKey("cells.id", ondelete="CASCADE"), index=True)
    prompt_index: Mapped[int] = mapped_column(Integer)
    document: Mapped[str] = mapped_column(String(500))
    warmup: Mapped[bool] = mapped_column(Boolean)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    new_tokens: Mapped[int] = mapped_column(Integer)
    total_s: Mapped[float] = mapped_column(Float)
    ttft_s: Mapped[float] = mapped_column(Float)
    tpot_s: Mapped[float | None] = mapped_column(Float)
    throughput: Mapped[float] = mapped_column(Float)  # tokens/s = new_tokens / total_s
    iterations: Mapped[int] = mapped_column(Integer)
    tokens_per_iteration: Mapped[float] = mapped_column(Float)
    drafted: Mapped[int] = mapped_column(Integer)
    accepted: Mapped[int] = mapped_column(Integer)
    draft_depth: Mapped[int] = mapped_column(Integer)
    acceptance_rate: Mapped[float | None] = mapped_column(Float)
    mean_path_length: Mapped[float | None] = mapped_column(Float)
    # Forward passes counted by the runner's hooks (counts; nullable since revision 0002, None where not counted).
    target_forwards: Mapped[int | None] = mapped_column(Integer)
    draft_forwards: Mapped[int | None] = mapped_column(Integer)  # 0002
    # 0002 (definitions: harness/metrics.py). acceptance_incl_bonus: committed tokens including the bonus token /
    # drafted depth, summed over drafting iterations (a ratio, may exceed 1: the paper's Table 3 "Accept.").
    # mean_path_length_all: committed path length before the bonus token, in tokens, averaged over every iteration.
    acceptance_incl_bonus: Mapped[float | None] = mapped_column(Float)
    mean_path_length_all: Mapped[float | None] = mapped_column(Float)
    step_tokens: Mapped[list[int]] = mapped_column(JSON)  # committed tokens per iteration
    # per iteration: drafted, accepted, depth, forwards (harness/metrics.py); rows written before the Step lost its
    # duplicate tree_size field also hold "tree_size", always equal to "drafted" (readers use "drafted")
    step_stats: Mapped[dict[str, list[int]]] = mapped_column(JSON)
    step_times_s: Mapped[list[float]] = mapped_column(JSON)  # seconds from start at each iteration's end
    # Bytes. BigInteger since revision 0002: PostgreSQL's INTEGER stops at 2 GiB (SQLite's is 64-bit anyway).
    peak_rss_bytes: Mapped[int | None] = mapped_column(BigInteger)
    peak_allocated_bytes: Mapped[int | None] = mapped_column(BigInteger)
    peak_nvml_bytes: Mapped[int | None] = mapped_column(BigInteger)
    nvml_scope: Mapped[str | None] = mapped_column(String(20))  # 0002: what peak_nvml_bytes covers (process|device)
    output_hash: Mapped[str] = mapped_column(String(64))
    output_tokens: Mapped[list[int]] = mapped_column(JSON)
    lossless: Mapped[bool | None] = mapped_column(Boolean)
    first_divergence: Mapped[int | None] = mapped_column(Integer)
    # 0008, the teacher-forced check of every emitted token (harness/lossless.py; NULL: not checked): output positions
    # checked, positions classified tie / error, the first error's output position, margins and measured noise in
    # logits, the check's seconds (outside the timed region), the diagnosed positions (JSON list of dicts)
    lossless_checked: Mapped[int | None] = mapped_column(Integer)
    lossless_ties: Mapped[int | None] = mapped_column(Integer)
    lossless_errors: Mapped[int | None] = mapped_column(Integer)
    lossless_first_error: Mapped[int | None] = mapped_column(Integer)
    lossless_error_margin: Mapped[float | None] = mapped_column(Float)
    lossless_tie_margin: Mapped[float | None] = mapped_column(Float)
    lossless_noise: Mapped[float | None] = mapped_column(Float)
    lossless_check_s: Mapped[float | None] = mapped_column(Float)
    lossless_diagnoses: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    worker_host: Mapped[str | None] = mapped_column(String(255))  # host of the worker that measured it
    device_name: Mapped[str | None] = mapped_column(String(200))  # its device (GPU model, or CPU model and threads)
    # 0007 (harness/energy.py): joules over the sample (None unless energy_status is "measured"); energy_status:
    # measured | unavailable | too_short | counter_reset (NULL: measured before energy existed); energy_source: the
    # counter ("nvml:gpu0", "rapl:package") or why none was readable.
    energy_j: Mapped[float | None] = mapped_column(Float)
    energy_status: Mapped[str | None] = mapped_column(String(20))
    energy_source: Mapped[str | None] = mapped_column(String(200))
    # 0009: question datasets' task (Spec-Bench group, raw category, 1-based turn, question id); NULL for raw text
    task_group: Mapped[str | None] = mapped_column(String(100))
    category: Mapped[str | None] = mapped_column(String(100))
    turn: Mapped[int | None] = mapped_column(Integer)
    question_id: Mapped[str | None] = mapped_column(String(100))
    cell: Mapped[Cell] = relationship(back_populates="samples")


class Calibration(Base):
    """One point of a calibrated forward-latency curve (``dtbench calibrate``, or ``calibrate: true`` in a suite).

    The median latency (s) of one forward of ``model`` over ``n`` new tokens on a KV cache already holding
    ``cache_len`` positions, device-synchronized, repeated until the median is stable. ``tree_mask``: the forward
    got an explicit 4D (tree) attention mask; ``last_only``: logits of the last position only (prefills, chain
    drafting). Rows with ``cache_len = 0`` are prefills of ``n`` prompt tokens. All rows of one calibration share
    ``batch``; ``run_id`` links it to the run it was made for (NULL: a standalone ``dtbench calibrate``, matched to
    runs by model, dtype and device).
    """

    __tablename__ = "calibrations"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    batch: Mapped[str] = mapped_column(String(32), index=True)  # one calibration (uuid4 hex)
    suite_name: Mapped[str] = mapped_column(String(200))
    suite_hash: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(10))  # target | draft
    model: Mapped[str] = mapped_column(String(500))
    dtype: Mapped[str] = mapped_column(String(20))
    device: Mapped[str] = mapped_column(String(50))  # str(torch.device): cpu, cuda:0
    device_name: Mapped[str] = mapped_column(String(300))  # measure.device_name (CPU model and threads, GPU model)
    prompt_len: Mapped[int] = mapped_column(Integer)  # the suite's prompt length (L_max) this curve is for
    cache_len: Mapped[int] = mapped_column(Integer)  # KV positions before the forward (0: a prefill)
    n: Mapped[int] = mapped_column(Integer)  # new tokens fed in the forward
    tree_mask: Mapped[bool] = mapped_column(Boolean)
    last_only: Mapped[bool] = mapped_column(Boolean)
    median_s: Mapped[float] = mapped_column(Float)
    iqr_s: Mapped[float] = mapped_column(Float)
    repeats: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


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


def _parse(url: str) -> URL:
    try:
        return make_url(url)
    except ArgumentError:
        raise DtbenchError(f"not a database URL: {url!r} (expected e.g. sqlite:///results.db or "
                           "postgresql+psycopg://user@host/db)") from None


def sqlite_path(url: str | URL) -> Path | None:
    """The file of a SQLite URL; None for other backends and for in-memory SQLite."""
    u = url if isinstance(url, URL) else make_url(url)
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:" or u.database.startswith("file:"):
        return None
    return Path(u.database)


def _one_line(exc: BaseException) -> str:
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
    u = _parse(url)
    try:
        engine = create_engine(u, **kwargs)
    except (ArgumentError, ImportError) as exc:
        raise DtbenchError(f"cannot open database {display_url(u)}: {_one_line(exc)}{_driver_hint(u)}") from None
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _driver_hint(u: URL) -> str:
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
        raise DtbenchError(f"cannot write the results database {path}: the file is read-only (chmod u+w it, or pass "
                           f"--db for another database)")
    if path.parent.is_dir() and not writable(path.parent):
        raise DtbenchError(f"cannot write the results database {path}: its folder {path.parent} is read-only "
                           f"(SQLite writes its journal files beside the database)")


def reader_engine(url: str) -> Engine:
    """An engine that cannot change the database: SQLite opened as :func:`_sqlite_reader` says, PostgreSQL with
    read-only transactions.

    Raises:
        DtbenchError: a malformed URL, a missing driver, no such SQLite file (or not a regular file).
    """
    u = _parse(url)
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
        raise DtbenchError(f"cannot open database {display_url(u)}: {_one_line(exc)}{_driver_hint(u)}") from None


def _stderr_note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def connect(url: str | None = None, *, create: bool = True,
            note: Callable[[str], None] | None = _stderr_note) -> sessionmaker[Session]:
    """Open the results database and return a session factory.

    ``create=True`` (a writer: ``dtbench run``): create the database at the newest schema revision if it is new,
    or upgrade it if it is older (an unversioned database written before migrations existed is recognised as
    revision 0001), calling ``note`` with one line when it upgrades; the check and upgrade hold a cross-process
    lock, so several writers may start at once on a new database. SQLite connections get WAL journaling, a 30 s
    busy timeout and foreign keys.

    ``create=False`` (a reader: ``dtbench report`` and every read-only command): open the database read-only
    (SQLite: never written, no journal switch, no stray files; PostgreSQL: read-only transactions) and require it
    to be at this code's revision.

    Raises:
        DtbenchError: one line, if the URL is empty or malformed, the driver is missing, the database cannot be
            opened, is not a dtbench results database, is older than this code (readers; the message says to run
            ``dtbench db upgrade --db URL``), or is newer than this code.
    """
    from dtbench.harness import schema

    resolved = resolve_url(url)
    if create:
        check_writable(resolved)
        engine = writer_engine(resolved)
        schema.ensure_current(resolved, note=note)
    else:
        engine = reader_engine(resolved)
        schema.require_current(engine, resolved)
    return sessionmaker(engine, expire_on_commit=False)


def latest_run_id(session: Session) -> int | None:
    """Id of the newest run, or None if the database holds none."""
    return session.scalar(select(Run.id).order_by(Run.id.desc()).limit(1))
