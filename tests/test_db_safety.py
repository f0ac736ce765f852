"""The results database under concurrency and hostile input (issue 8 items 4 and 11), on SQLite and PostgreSQL:

* several processes creating a new database at once all succeed and leave one correct schema;
* two processes writing at once lose nothing; a writer killed with SIGKILL loses nothing it committed;
* read-only commands never change the file (bytes, mtime, no -wal/-shm left behind), cannot write through their
  sessions, and a file that is not a dtbench database is a one-line error (exit 2) that leaves it untouched;
* ``--db ''`` is an error, not results.db.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kit import invoke, one_line_error
from sqlalchemy import create_engine, func, inspect, select, text
from sqlalchemy.exc import SQLAlchemyError

from dtbench.harness.errors import DtbenchError
from dtbench.harness.store import db

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "results-0001.db"

# A child process: wait for the start gate (a wall-clock instant shared by all children), then open the database
# as a writer and store one run with `samples` samples, committing each.
CHILD = textwrap.dedent("""
    import os, sys, time
    from dtbench.harness.store import db
    url, gate, samples = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    while time.time() < gate:
        pass
    sessions = db.connect(url)
    with sessions() as s:
        run = db.Run(suite_name=f"p{os.getpid()}", suite_text="", suite_hash="0", environment={"pid": os.getpid()})
        cell = db.Cell(run=run, dataset="d", l_max=8, gen_length=4, decoder="ar", label="ar",
                       decoder_version="1", decoder_distribution="dtbench", params={}, target_model="m")
        s.add(cell)
        s.commit()
        for i in range(samples):
            s.add(db.Sample(cell_id=cell.id, prompt_index=i, document="d", warmup=False, prompt_tokens=8,
                            new_tokens=4, total_s=1.0, ttft_s=0.1, tpot_s=0.3, throughput=4.0, iterations=4,
                            tokens_per_iteration=1.0, drafted=0, accepted=0, draft_depth=0, target_forwards=4,
                            step_tokens=[1, 1, 1, 1], step_stats={}, step_times_s=[0.1, 0.4, 0.7, 1.0],
                            output_hash="h", output_tokens=[1, 2, 3, 4]))
            s.commit()
            print(i, flush=True)
""")


def children(url: str, n: int, samples: int, delay: float = 1.5) -> list[subprocess.Popen]:
    gate = time.time() + delay  # after every child has imported SQLAlchemy: they open the database together
    return [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, url, str(gate), str(samples)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]


def count(url: str, table: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar()
    finally:
        engine.dispose()


def test_processes_creating_a_new_database_at_once_all_succeed(db_url):
    """Fails on the code before migrations: 'table runs already exists' (SQLite) / duplicate key in pg_type."""
    procs = children(db_url, n=6, samples=1)
    results = [(p.wait(timeout=240), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    failed = [err.strip().splitlines()[-1] for rc, err in results if rc != 0]
    assert not failed, failed
    assert count(db_url, "runs") == 6 and count(db_url, "samples") == 6
    from dtbench.harness.store import schema

    engine = create_engine(db_url)
    try:
        assert set(schema.TABLES) | {"alembic_version"} <= set(inspect(engine).get_table_names())
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [schema.head()]
    finally:
        engine.dispose()


def test_two_concurrent_writers_lose_nothing(db_url):
    db.connect(db_url)
    procs = children(db_url, n=2, samples=25, delay=1.0)
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
    sessions = db.connect(db_url, create=False)
    with sessions() as s:
        per_run = s.execute(
            select(db.Cell.run_id, func.count(db.Sample.id)).join(db.Sample).group_by(db.Cell.run_id)
        ).all()
    assert sorted(n for _, n in per_run) == [25, 25]


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL is POSIX")
def test_writer_killed_keeps_every_committed_sample(db_url):
    db.connect(db_url)
    (proc,) = children(db_url, n=1, samples=10_000, delay=0.0)
    try:
        for _ in range(5):  # five samples committed (the child prints after each commit)
            assert proc.stdout.readline(), proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
    sessions = db.connect(db_url, create=False)
    with sessions() as s:
        indexes = s.scalars(select(db.Sample.prompt_index).order_by(db.Sample.prompt_index)).all()
    assert len(indexes) >= 5 and indexes == list(range(len(indexes)))  # a prefix: nothing torn or duplicated
    writer = db.connect(db_url)  # the database is still writable after the kill
    with writer() as s:
        s.add(db.Run(suite_name="after", suite_text="", suite_hash="0", environment={}))
        s.commit()


# --- read-only commands ---------------------------------------------------------------------------------------


def snapshot(path: Path) -> tuple:
    """The file's bytes and mtime, and the folder's listing (a -wal, -shm or -journal left behind shows there)."""
    st = path.stat()
    return path.read_bytes(), st.st_mtime_ns, sorted(os.listdir(path.parent))


@pytest.fixture()
def current_db(tmp_path) -> Path:
    """The fixture database upgraded to the current revision, in a folder of its own."""
    folder = tmp_path / "current"
    folder.mkdir()
    path = Path(shutil.copy(FIXTURE, folder / "results.db"))
    db.connect(str(path))  # upgrades it (a note on stderr)
    return path


@pytest.mark.parametrize("journal", ["wal", "delete"])
def test_report_never_modifies_the_file(current_db, journal):
    """Fails on the code before migrations: a rollback-journal database is switched to WAL by `report`."""
    with sqlite3.connect(current_db) as con:
        con.execute(f"PRAGMA journal_mode={journal}")
    con.close()
    time.sleep(0.01)  # an mtime change could not hide inside the clock's resolution
    before = snapshot(current_db)
    for args in (["report"], ["report", "--format", "json"], ["report", "--compare"], ["db", "current"]):
        result = invoke(*args, "--db", str(current_db))
        assert result.exit_code == 0, (args, result.output)
        assert snapshot(current_db) == before, args


def test_report_while_a_writer_holds_the_database(current_db):
    """With a writer's -wal and -shm present, report reads through them and leaves them as they were."""
    writer = sqlite3.connect(current_db)
    writer.execute("PRAGMA journal_mode=wal")
    writer.execute("UPDATE runs SET suite_name = suite_name")  # a committed write sits in the WAL
    writer.commit()
    before = snapshot(current_db)
    assert {"results.db-wal", "results.db-shm"} <= set(before[2])
    result = invoke("report", "--db", str(current_db), "--format", "csv")
    assert result.exit_code == 0, result.output
    assert snapshot(current_db)[0:2] == before[0:2] and snapshot(current_db)[2] == before[2]
    writer.close()


def test_readonly_sessions_cannot_write(db_url):
    db.connect(db_url)
    sessions = db.connect(db_url, create=False)
    with sessions() as s:
        s.add(db.Run(suite_name="x", suite_text="", suite_hash="0", environment={}))
        with pytest.raises(SQLAlchemyError):
            s.commit()
    assert count(db_url, "runs") == 0


def _foreign(path: Path) -> None:
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
        con.execute("INSERT INTO notes (body) VALUES ('mine')")
    con.close()


BAD_FILES = {
    "empty file": (lambda p: p.write_bytes(b""), "is not a dtbench results database (it is empty)"),
    "foreign sqlite": (_foreign, "is not a dtbench results database (its tables: notes)"),
    "text file": (lambda p: p.write_text("hello\n" * 200), "is not a dtbench results database (not a SQLite file)"),
    "binary junk": (lambda p: p.write_bytes(bytes(range(256)) * 64), "not a SQLite file"),
}


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_not_a_dtbench_database_is_one_line_and_untouched(tmp_path, kind):
    """Fails on the code before migrations: a multi-line SQL error, and the file switched to WAL."""
    make, message = BAD_FILES[kind]
    folder = tmp_path / "bad"
    folder.mkdir()
    path = folder / "results.db"
    make(path)
    time.sleep(0.01)
    before = snapshot(path)
    for args in (["report"], ["report", "--format", "json"], ["db", "current"]):
        one_line_error(invoke(*args, "--db", str(path)), message)
        assert snapshot(path) == before, args
    if kind != "empty file":  # a writer may create its tables in an empty file, never in somebody else's
        one_line_error(invoke("db", "upgrade", "--db", str(path)), message)
        assert snapshot(path)[0] == before[0]


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_missing_file_and_folder_are_one_line_errors(tmp_path):
    one_line_error(invoke("report", "--db", str(tmp_path / "nope.db")), "no results database at")
    assert not (tmp_path / "nope.db").exists()
    one_line_error(invoke("report", "--db", str(tmp_path)), "is not a results database file")
    one_line_error(invoke("db", "upgrade", "--db", str(tmp_path / "no" / "such" / "x.db")), "does not exist")


def test_empty_db_option_is_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for args in (["report", "--db", ""], ["db", "upgrade", "--db", ""], ["db", "current", "--db", "  "]):
        one_line_error(invoke(*args), "--db is empty")
    suite = tmp_path / "s.yaml"
    suite.write_text(
        "name: s\ntarget: {model: smollm2-135m}\ndatasets: [{name: wikitext-2, prompts: 1, warmup: 0}]\n"
        "generation_lengths: [2]\ndecoders: [{name: ar}]\n"
    )
    one_line_error(invoke("run", str(suite), "--db", ""), "--db is empty")
    monkeypatch.setenv("DTBENCH_DB", "")
    one_line_error(invoke("report"), "DTBENCH_DB is set but empty")
    assert not (tmp_path / "results.db").exists()


def test_bad_urls_are_one_line_errors(tmp_path):
    one_line_error(invoke("report", "--db", "nosuchdialect://x/y"), "cannot open database")
    with pytest.raises(DtbenchError):
        db.connect("postgresql+nosuchdriver://u@localhost/x")
