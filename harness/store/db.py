"""The results database: SQLAlchemy 2.0 typed models and engine setup (SQLite by default, any SQLAlchemy URL).

Tables: ``runs`` (suite text and hash, environment, status, owner), ``cells`` (one decoder configuration on one
dataset x prompt cap L_max x T), ``samples`` (one prompt of one cell, committed as soon as it is measured),
``calibrations`` (forward-latency curves of the cost model, linked to a run or standalone).
Times are seconds, memory bytes, throughput tokens/s. Timestamps are stored in UTC and read back as naive UTC
datetimes on every backend (SQLite keeps no offset; PostgreSQL's ``timestamptz`` is converted), so reports are
the same whichever database holds the run.

URLs and engines (writer, read-only reader) are :mod:`dtbench.harness.store.engines`. The schema is versioned by
Alembic (``harness/store/migrations``, driven by :mod:`dtbench.harness.store.schema`): a writer
(``connect(url)``, ``dtbench run``) creates or upgrades the schema under a cross-process lock; a reader
(``connect(url, create=False)``, ``dtbench report``) opens the database read-only and refuses one that is not at
this code's revision. PostgreSQL works through ``postgresql+psycopg://...`` (``pip install dtbench[postgres]``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    select,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker

from dtbench.harness.safetext import printable
from dtbench.harness.store import schema
from dtbench.harness.store.engines import check_writable, reader_engine, resolve_url, writer_engine


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (what the models store)."""
    return datetime.now(UTC)


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
            value = value.astimezone(UTC)
            if dialect.name == "sqlite":
                value = value.replace(tzinfo=None)
        elif value is not None and dialect.name != "sqlite":
            value = value.replace(tzinfo=UTC)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
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
    status: Mapped[str] = mapped_column(String(20), default="running")  # running|completed|interrupted|failed|crashed
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    environment: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    error: Mapped[str | None] = mapped_column(Text)
    # Revision 0002: the process writing the run, so `--resume` can refuse a live one (None for runs written
    # before 0002): host (socket.gethostname()), pid, and the last sign of life (UTC; refreshed while it runs).
    owner_host: Mapped[str | None] = mapped_column(String(255))
    owner_pid: Mapped[int | None] = mapped_column(Integer)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Revision 0015 (issue 50): the cell being measured right now (None between cells); a run whose process died
    # with it set gets that cell failed when it is found crashed (harness/store/runs.py: mark_crashed)
    measuring_cell_id: Mapped[int | None] = mapped_column(Integer)
    cells: Mapped[list[Cell]] = relationship(back_populates="run", cascade="all, delete-orphan")


class Cell(Base):
    """One decoder configuration on one (dataset, L_max, T, batch size B) of a run."""

    __tablename__ = "cells"
    __table_args__ = (
        UniqueConstraint(
            "run_id", "dataset", "l_max", "gen_length", "batch_size", "label", name="uq_cells_point_label"
        ),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    dataset: Mapped[str] = mapped_column(String(200))
    l_max: Mapped[int] = mapped_column(Integer)  # the prompt cap L_max (column prompt_cap before revision 0006)
    gen_length: Mapped[int] = mapped_column(Integer)
    # 0011: batch size B, prompts decoded together (suite key batch_sizes); 1 for every cell written before it
    batch_size: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # 0013 (issue 37): eager | compiled (suite key execution); eager for every cell written before it. compile_s: the
    # seconds its compile step took in its worker before the warmup (compiled cells; graphs torch.compile made then)
    execution: Mapped[str] = mapped_column(String(20), default="eager", server_default="eager")
    compile_s: Mapped[float | None] = mapped_column(Float)
    compile_graphs: Mapped[int | None] = mapped_column(Integer)
    # 0015 (issue 50): every compile step of the cell as [seconds, graphs] (a resumed run compiles again in its own
    # process; compile_s/compile_graphs keep the first), None before 0015
    compile_runs: Mapped[list[list[float]] | None] = mapped_column(JSON)
    decoder: Mapped[str] = mapped_column(String(200))
    family: Mapped[str | None] = mapped_column(String(20))  # the decoder's declared family: ar|chain|tree|external
    # 0016 (issue 49): who measured it: local (dtbench's own loop) | served (requests to a server); reports tell a
    # served cell by this, never by its params' names. Backfilled from the params for cells written before 0016
    # (the runner writes it for every cell, issue 58 item 4: no hook guesses it; a writer that sets none gets local)
    measurer: Mapped[str] = mapped_column(String(10), default="local", server_default="local")
    label: Mapped[str] = mapped_column(String(300))
    decoder_version: Mapped[str] = mapped_column(String(100))
    decoder_distribution: Mapped[str] = mapped_column(String(200))
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # every param, defaults included
    sweep_group: Mapped[str | None] = mapped_column(String(300))  # label of the sweep entry this cell is a point of
    swept: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # its point of that sweep grid
    sampling: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # temperature, top_k, top_p, seed; None: greedy
    lossless_expected: Mapped[bool] = mapped_column(Boolean, default=True)
    # 0008: the rule of its samples' lossless verdict (exact | tie_aware; harness/measurement/lossless.py); NULL before: exact
    lossless_check: Mapped[str | None] = mapped_column(String(20))
    reference_label: Mapped[str | None] = mapped_column(String(300))
    target_model: Mapped[str] = mapped_column(String(500))
    draft_model: Mapped[str | None] = mapped_column(String(500))
    status: Mapped[str] = mapped_column(
        String(20), default="pending"
    )  # pending|running|done|failed|interrupted (holds samples, run stopped)
    error: Mapped[str | None] = mapped_column(Text)
    # 0014, the machine's load while the cell was measured (harness/measurement/load.py; NULL before 0014): logical CPUs, the
    # 1-minute load average before its first sample and after its last, the largest load less this process tree's
    # own share, CPU seconds other processes took during its samples and the CPU seconds there were (wall x CPUs),
    # the CPU frequency (MHz) at its start and end (NULL where unreadable)
    cpu_count: Mapped[int | None] = mapped_column(Integer)
    load_start: Mapped[float | None] = mapped_column(Float)
    load_end: Mapped[float | None] = mapped_column(Float)
    others_load_max: Mapped[float | None] = mapped_column(Float)
    others_cpu_s: Mapped[float | None] = mapped_column(Float)
    capacity_cpu_s: Mapped[float | None] = mapped_column(Float)
    cpu_mhz_start: Mapped[float | None] = mapped_column(Float)
    cpu_mhz_end: Mapped[float | None] = mapped_column(Float)
    run: Mapped[Run] = relationship(back_populates="cells")
    samples: Mapped[list[Sample]] = relationship(back_populates="cell", cascade="all, delete-orphan")


class Sample(Base):
    """One prompt decoded by one cell: times (s), counters, memory (bytes), output identity.

    Its columns are :class:`dtbench.harness.measurement.sample.SampleRecord`'s fields plus ``id``, ``cell_id`` and
    ``created_at`` (tests/test_db.py asserts it): a new column is a field there, a column here and a migration."""

    __tablename__ = "samples"
    __table_args__ = (UniqueConstraint("cell_id", "prompt_index", "repeat", name="uq_samples_prompt_repeat"),)
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
    # 0002 (definitions: harness/measurement/metrics.py). acceptance_incl_bonus: committed tokens including the bonus token /
    # drafted depth, summed over drafting iterations (a ratio, may exceed 1: the paper's Table 3 "Accept.").
    # mean_path_length_all: committed path length before the bonus token, in tokens, averaged over every iteration.
    acceptance_incl_bonus: Mapped[float | None] = mapped_column(Float)
    mean_path_length_all: Mapped[float | None] = mapped_column(Float)
    step_tokens: Mapped[list[int]] = mapped_column(JSON)  # committed tokens per iteration
    # per iteration: drafted, accepted, depth, forwards (harness/measurement/metrics.py); rows written before the Step lost its
    # duplicate tree_size field also hold "tree_size", always equal to "drafted" (readers use "drafted")
    step_stats: Mapped[dict[str, Any]] = mapped_column(JSON)
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
    # 0008, the teacher-forced check of every emitted token (harness/measurement/lossless.py; NULL: not checked): output positions
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
    # 0007 (harness/measurement/energy.py): joules over the sample (None unless energy_status is "measured"); energy_status:
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
    # 0011, batched cells (B > 1): the prompt group's first prompt index (the key its rows are paired by across
    # decoders), the rows decoded together (< B: the dataset's remainder group), and the group's wall time in seconds
    # from the start until its last row finished (its total throughput = the rows' new tokens / this); NULL at B = 1
    batch_group: Mapped[int | None] = mapped_column(Integer)
    batch_rows: Mapped[int | None] = mapped_column(Integer)
    batch_total_s: Mapped[float | None] = mapped_column(Float)
    # 0014: the 0-based repeat of this prompt (suite key repeats; 0 for every sample written before it)
    repeat: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # 0013 (issue 37): memory-bandwidth-limit seconds of its forwards / total_s (harness/calibration/roofline.py); NULL: unknown
    roofline: Mapped[float | None] = mapped_column(Float)
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
    device_name: Mapped[str] = mapped_column(String(300))  # machine.device_name (CPU model and threads, GPU model)
    prompt_len: Mapped[int] = mapped_column(Integer)  # the suite's prompt length (L_max) this curve is for
    cache_len: Mapped[int] = mapped_column(Integer)  # KV positions before the forward (0: a prefill)
    n: Mapped[int] = mapped_column(Integer)  # new tokens fed in the forward
    tree_mask: Mapped[bool] = mapped_column(Boolean)
    last_only: Mapped[bool] = mapped_column(Boolean)
    # 0012: rows of the forward, B sequences decoded together (a RaggedBatch verification: n new tokens per row, a
    # per-row 4D mask); NULL (every row before 0012) or 1: one sequence
    rows: Mapped[int | None] = mapped_column(Integer)
    median_s: Mapped[float] = mapped_column(Float)
    iqr_s: Mapped[float] = mapped_column(Float)
    repeats: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


def _stderr_note(message: str) -> None:
    print(f"note: {printable(message)}", file=sys.stderr, flush=True)


def connect(
    url: str | None = None, *, create: bool = True, note: Callable[[str], None] | None = _stderr_note
) -> sessionmaker[Session]:
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
