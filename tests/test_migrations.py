"""Schema migrations: a results.db written before migrations existed upgrades and reports byte for byte as it did;
a new database is created at the newest revision and matches the models; an outdated database is refused by
read-only commands, a newer one by every command; on SQLite and PostgreSQL.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import MetaData, create_engine, inspect, select, text

from dtbench.harness import db, schema
from dtbench.harness.cli import cli
from dtbench.harness.errors import DtbenchError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
OLD_DB = FIXTURES / "results-0001.db"
RUNS = (1, 2)


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture()
def old_db(tmp_path) -> Path:
    """A copy of the fixture database (never the committed file itself)."""
    return Path(shutil.copy(OLD_DB, tmp_path / "old.db"))


def assert_reports_identical(url: str) -> None:
    for run in RUNS:
        for fmt in ("json", "csv"):
            result = invoke("report", "--db", url, "--run", str(run), "--format", fmt)
            assert result.exit_code == 0, result.output
            assert result.stdout == (FIXTURES / f"results-0001.run{run}.{fmt}").read_text(), (run, fmt)


def test_old_database_is_refused_by_report_then_upgrades_and_reports_identically(old_db):
    url = f"sqlite:///{old_db}"
    line = one_line_error(invoke("report", "--db", str(old_db)), "revision 0001", "older")
    assert line.endswith(f"run 'dtbench db upgrade --db {url}'")
    current = invoke("db", "current", "--db", str(old_db))
    assert current.exit_code == 0 and "revision 0001 (written before migrations" in current.stdout
    up = invoke("db", "upgrade", "--db", str(old_db))
    assert up.exit_code == 0, up.output
    assert f"upgraded from schema revision 0001 to {schema.head()}" in up.stdout
    shown = invoke("db", "current", "--db", str(old_db)).stdout.strip()
    assert shown == f"{url}: schema revision {schema.head()} (head)"
    assert_reports_identical(url)
    again = invoke("db", "upgrade", "--db", str(old_db))
    assert again.exit_code == 0 and "already at schema revision" in again.stdout


def test_writer_upgrades_an_old_database_with_one_note(old_db, capsys):
    db.connect(str(old_db))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"note: upgraded the results database {old_db} from schema revision 0001 to {schema.head()}"]
    db.connect(str(old_db))
    assert capsys.readouterr().err == ""  # already current: silent
    sessions = db.connect(str(old_db), create=False)
    with sessions() as s:  # old rows keep NULL in the new columns; the new columns are usable
        sample = s.scalars(select(db.Sample).order_by(db.Sample.id)).first()
        assert sample.draft_forwards is None and sample.nvml_scope is None and sample.target_forwards is not None
        assert s.scalar(select(db.Run.owner_pid).limit(1)) is None


def normalized_schema(url: str) -> dict:
    """Tables, columns (type, nullability), unique constraints, foreign keys and indexes, order-free."""
    engine = create_engine(url)
    try:
        insp = inspect(engine)
        out = {}
        for t in sorted(insp.get_table_names()):
            out[t] = {
                "columns": sorted((c["name"], str(c["type"]), c["nullable"]) for c in insp.get_columns(t)),
                "unique": sorted(tuple(u["column_names"]) for u in insp.get_unique_constraints(t)),
                "fks": sorted((tuple(f["constrained_columns"]), f["referred_table"], tuple(f["referred_columns"]),
                               (f.get("options") or {}).get("ondelete")) for f in insp.get_foreign_keys(t)),
                "indexes": sorted((i["name"], tuple(i["column_names"]), bool(i["unique"]))
                                  for i in insp.get_indexes(t)),
                "pk": insp.get_pk_constraint(t)["constrained_columns"],
            }
        return out
    finally:
        engine.dispose()


def test_upgraded_schema_equals_a_new_one(old_db, tmp_path):
    db.connect(str(old_db), note=None)
    db.connect(str(tmp_path / "new.db"))
    assert normalized_schema(f"sqlite:///{old_db}") == normalized_schema(f"sqlite:///{tmp_path / 'new.db'}")


def test_new_database_matches_the_models(db_url):
    """The migrations produce exactly the ORM's schema (Alembic autogenerate finds nothing to change)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    db.connect(db_url)
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            diffs = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), db.Base.metadata)
            assert diffs == []
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == schema.head()
    finally:
        engine.dispose()
    assert schema.revisions() == ["0001", "0002"]


def _copy_rows(src_url: str, dst_url: str) -> None:
    """Copy every row of runs, cells, samples (same ids) from one database to another with the same tables."""
    src, dst = create_engine(src_url), create_engine(dst_url)
    try:
        meta = MetaData()
        meta.reflect(src, only=list(schema.TABLES))
        with src.connect() as s, dst.begin() as d:
            dmeta = MetaData()
            dmeta.reflect(d, only=list(schema.TABLES))
            for t in schema.TABLES:  # parents first
                rows = [dict(r._mapping) for r in s.execute(meta.tables[t].select().order_by(meta.tables[t].c.id))]
                d.execute(dmeta.tables[t].insert(), rows)
            if d.dialect.name == "postgresql":
                for t in schema.TABLES:
                    d.execute(text(f"SELECT setval(pg_get_serial_sequence('{t}', 'id'), (SELECT max(id) FROM {t}))"))
    finally:
        src.dispose()
        dst.dispose()


def test_unversioned_postgres_database_upgrades_and_reports_identically(pg_server, old_db):
    """Today's code on PostgreSQL: the 0001 tables made by create_all, no alembic_version. dtbench stamps and
    upgrades it, and the runs (copied from the SQLite fixture) report byte for byte as they did from SQLite."""
    from alembic import command

    url = pg_server.new_database()
    engine = create_engine(url)
    with engine.begin() as conn:  # revision 0001's tables, then forget the revision: what create_all left
        command.upgrade(schema._config(conn), "0001")
        conn.execute(text("DROP TABLE alembic_version"))
    engine.dispose()
    _copy_rows(f"sqlite:///{old_db}", url)  # JSON, timestamps, floats from the SQLite file as they are
    one_line_error(invoke("report", "--db", url), "revision 0001", "dtbench db upgrade --db")
    notes = []
    db.connect(url, note=notes.append)
    where = db.display_url(url)
    assert notes == [f"upgraded the results database {where} from schema revision 0001 to {schema.head()}"]
    assert_reports_identical(url)


def test_newer_database_is_refused_by_every_command(db_url):
    db.connect(db_url)
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    for create in (True, False):
        with pytest.raises(DtbenchError, match="revision 9999, newer than this dtbench"):
            db.connect(db_url, create=create)
    one_line_error(invoke("report", "--db", db_url), "newer than this dtbench")
    one_line_error(invoke("db", "upgrade", "--db", db_url), "newer than this dtbench")
    one_line_error(invoke("db", "current", "--db", db_url), "newer than this dtbench")


def test_upgrade_creates_a_new_database(db_url):
    first = invoke("db", "upgrade", "--db", db_url)
    assert first.exit_code == 0 and f"created at schema revision {schema.head()}" in first.stdout, first.output
    assert "(head)" in invoke("db", "current", "--db", db_url).stdout


def test_interim_database_without_alembic_version_upgrades(db_url):
    """dtbench between commit 3c3e168 and the migrations added the 0002 columns with create_all (INTEGER byte
    columns, no alembic_version): recognised, stamped 0001 and upgraded to the same schema as a new database."""
    from alembic import command

    engine = create_engine(db_url)
    with engine.begin() as conn:
        command.upgrade(schema._config(conn), "0001")
        conn.execute(text("DROP TABLE alembic_version"))
        stamp = "DATETIME" if conn.dialect.name == "sqlite" else "TIMESTAMP WITH TIME ZONE"  # as create_all made it
        for table, cols in (("runs", f"owner_host VARCHAR(255)|owner_pid INTEGER|heartbeat_at {stamp}"),
                            ("samples", "draft_forwards INTEGER|acceptance_incl_bonus FLOAT|"
                                        "mean_path_length_all FLOAT|nvml_scope VARCHAR(20)")):
            for col in cols.split("|"):
                conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {col}"))
    engine.dispose()
    notes = []
    db.connect(db_url, note=notes.append)
    assert len(notes) == 1 and "from schema revision 0001 to" in notes[0]
    fresh = db_url.rsplit("/", 1)[0] + "/fresh.db" if db_url.startswith("sqlite") else None
    if fresh:
        db.connect(fresh)
        assert normalized_schema(db_url) == normalized_schema(fresh)
    else:
        cols = {c["name"]: str(c["type"]) for c in inspect(create_engine(db_url)).get_columns("samples")}
        assert cols["peak_rss_bytes"] == "BIGINT" and cols["draft_forwards"] == "INTEGER"
