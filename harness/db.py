"""The results database: SQLAlchemy 2.0 typed models and engine setup (SQLite by default, any SQLAlchemy URL).

Tables: ``runs`` (suite text and hash, environment, status), ``cells`` (one decoder configuration on one
dataset x prompt cap x T), ``samples`` (one prompt of one cell, committed as soon as it is measured).
Times are seconds, memory bytes, throughput tokens/s.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, Boolean, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy import create_engine, event, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker

from dtbench.harness.errors import DtbenchError

DB_ENV = "DTBENCH_DB"
DEFAULT_URL = "sqlite:///results.db"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


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
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    environment: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    error: Mapped[str | None] = mapped_column(Text)
    owner_host: Mapped[str | None] = mapped_column(String(255))  # host of the process writing the run
    owner_pid: Mapped[int | None] = mapped_column(Integer)  # its pid
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # refreshed while it runs
    cells: Mapped[list["Cell"]] = relationship(back_populates="run", cascade="all, delete-orphan")


class Cell(Base):
    """One decoder configuration on one (dataset, prompt cap, T) of a run."""

    __tablename__ = "cells"
    __table_args__ = (UniqueConstraint("run_id", "dataset", "prompt_cap", "gen_length", "label"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    dataset: Mapped[str] = mapped_column(String(200))
    prompt_cap: Mapped[int] = mapped_column(Integer)
    gen_length: Mapped[int] = mapped_column(Integer)
    decoder: Mapped[str] = mapped_column(String(200))
    label: Mapped[str] = mapped_column(String(300))
    decoder_version: Mapped[str] = mapped_column(String(100))
    decoder_distribution: Mapped[str] = mapped_column(String(200))
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    lossless_expected: Mapped[bool] = mapped_column(Boolean, default=True)
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
    target_forwards: Mapped[int | None] = mapped_column(Integer)
    draft_forwards: Mapped[int | None] = mapped_column(Integer)
    acceptance_incl_bonus: Mapped[float | None] = mapped_column(Float)
    mean_path_length_all: Mapped[float | None] = mapped_column(Float)
    nvml_scope: Mapped[str | None] = mapped_column(String(20))
    step_tokens: Mapped[list[int]] = mapped_column(JSON)  # committed tokens per iteration
    step_stats: Mapped[dict[str, list[int]]] = mapped_column(JSON)  # per iteration: drafted, accepted, tree_size, depth
    step_times_s: Mapped[list[float]] = mapped_column(JSON)  # seconds from start at each iteration's end
    peak_rss_bytes: Mapped[int | None] = mapped_column(Integer)
    peak_allocated_bytes: Mapped[int | None] = mapped_column(Integer)
    peak_nvml_bytes: Mapped[int | None] = mapped_column(Integer)
    output_hash: Mapped[str] = mapped_column(String(64))
    output_tokens: Mapped[list[int]] = mapped_column(JSON)
    lossless: Mapped[bool | None] = mapped_column(Boolean)
    first_divergence: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    worker_host: Mapped[str | None] = mapped_column(String(255))  # host of the worker that measured it
    device_name: Mapped[str | None] = mapped_column(String(200))  # its device (GPU model, or CPU model and threads)
    cell: Mapped[Cell] = relationship(back_populates="samples")


def resolve_url(url: str | None) -> str:
    """``--db`` value, else ``$DTBENCH_DB``, else ``sqlite:///results.db``; a bare path means a SQLite file."""
    url = url or os.environ.get(DB_ENV) or DEFAULT_URL
    if "://" not in url:
        url = f"sqlite:///{url}"
    return url


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def connect(url: str | None = None, *, create: bool = True) -> sessionmaker[Session]:
    """Open the database (creating tables if ``create``) and return a session factory.

    SQLite connections get WAL journaling, a 30 s busy timeout and foreign keys; other dialects are untouched.

    Raises:
        DtbenchError: if the database cannot be opened or written (bad path, permissions, driver missing).
    """
    url = resolve_url(url)
    if url.startswith("sqlite:///") and not create:
        path = Path(url.removeprefix("sqlite:///"))
        if not path.exists():
            raise DtbenchError(f"no results database at {path} (run a suite first, or pass --db)")
    try:
        engine: Engine = create_engine(url)
        if engine.dialect.name == "sqlite":
            event.listen(engine, "connect", _sqlite_pragmas)
        if create:
            Base.metadata.create_all(engine)
        else:
            with engine.connect():
                pass
    except (SQLAlchemyError, OSError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0][:300]
        raise DtbenchError(f"cannot open database {url}: {first}") from None
    return sessionmaker(engine, expire_on_commit=False)


def latest_run_id(session: Session) -> int | None:
    """Id of the newest run, or None if the database holds none."""
    return session.scalar(select(Run.id).order_by(Run.id.desc()).limit(1))
