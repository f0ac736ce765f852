"""Schema migrations: a results.db written before migrations existed upgrades and reports the same numbers it did;
a new database is created at the newest revision and matches the models; an outdated database is refused by
read-only commands, a newer one by every command; on SQLite and PostgreSQL.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from kit import invoke, one_line_error
from sqlalchemy import MetaData, create_engine, inspect, select, text

from dtbench.harness.errors import DtbenchError
from dtbench.harness.store import db, engines, schema

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
OLD_DB = FIXTURES / "results-0001.db"
RUNS = (1, 2)


@pytest.fixture()
def old_db(tmp_path) -> Path:
    """A copy of the fixture database (never the committed file itself)."""
    return Path(shutil.copy(OLD_DB, tmp_path / "old.db"))


# Report fields whose definition changed on purpose since the fixture was written, and why:
# lossless_n counts every measured sample, warmup included (issue 8 item 12: a divergence during warmup is still a
# divergence); the old "1/1" of a run with one warmup prompt is now "2/2". Every other field is compared.
CHANGED_ON_PURPOSE = {"lossless_n"}


def assert_reports_identical(url: str) -> None:
    """Every number the pre-migration code reported for the fixture's runs is reported unchanged (JSON and CSV).

    New fields (metrics added since, e.g. acceptance_incl_bonus) may appear; none of the old ones may change."""
    import csv
    import io
    import json

    for run in RUNS:
        result = invoke("report", "--db", url, "--run", str(run), "--format", "json")
        assert result.exit_code == 0, result.output
        old, new = json.loads((FIXTURES / f"results-0001.run{run}.json").read_text()), json.loads(result.stdout)
        assert new["run"] == {**old["run"], **{k: v for k, v in new["run"].items() if k not in old["run"]}}
        assert [c["label"] for c in new["cells"]] == [c["label"] for c in old["cells"]]
        for o, n in zip(old["cells"], new["cells"]):
            assert {k: n[k] for k in o if k not in CHANGED_ON_PURPOSE} == {
                k: v for k, v in o.items() if k not in CHANGED_ON_PURPOSE
            }, (run, o["label"])
        result = invoke("report", "--db", url, "--run", str(run), "--format", "csv")
        assert result.exit_code == 0, result.output
        old_rows = list(csv.DictReader(io.StringIO((FIXTURES / f"results-0001.run{run}.csv").read_text())))
        new_rows = list(csv.DictReader(io.StringIO(result.stdout)))
        assert len(new_rows) == len(old_rows)
        for o, n in zip(old_rows, new_rows):
            assert {k: n[k] for k in o if k not in CHANGED_ON_PURPOSE} == {
                k: v for k, v in o.items() if k not in CHANGED_ON_PURPOSE
            }, (run, o["label"])


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
                "fks": sorted(
                    (
                        tuple(f["constrained_columns"]),
                        f["referred_table"],
                        tuple(f["referred_columns"]),
                        (f.get("options") or {}).get("ondelete"),
                    )
                    for f in insp.get_foreign_keys(t)
                ),
                "indexes": sorted(
                    (i["name"], tuple(i["column_names"]), bool(i["unique"])) for i in insp.get_indexes(t)
                ),
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
    revs = schema.revisions()
    assert revs[0] == "0001" and revs == [f"{i:04d}" for i in range(1, len(revs) + 1)]  # a linear history


def test_0003_backfills_sweep_points_and_the_papers_conventions(old_db, tmp_path):
    """Old cells learn their sweep group from the stored suite text once, at upgrade; old samples get the paper's
    acceptance (incl. bonus) and ℓ over every iteration from the per-step data they always stored."""
    import sqlite3

    import yaml

    con = sqlite3.connect(old_db)
    run_id, text_ = con.execute("SELECT id, suite_text FROM runs ORDER BY id LIMIT 1").fetchone()
    suite = yaml.safe_load(text_)
    suite["decoders"].append({"name": "linear", "label": "Lin", "sweep": {"k": [2, 3]}})
    cell = con.execute("SELECT * FROM cells WHERE run_id = ? AND decoder = 'linear'", (run_id,)).fetchone()
    cols = [d[0] for d in con.execute("SELECT * FROM cells LIMIT 0").description]
    row = dict(zip(cols, cell), id=None, label="Lin (k=3)")
    con.execute(f"INSERT INTO cells ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", [row[c] for c in cols])
    con.execute("UPDATE runs SET suite_text = ? WHERE id = ?", (yaml.safe_dump(suite, sort_keys=False), run_id))
    con.commit()
    con.close()
    assert invoke("db", "upgrade", "--db", str(old_db)).exit_code == 0
    with db.connect(str(old_db), create=False)() as s:
        cells = {c.label: (c.sweep_group, c.swept) for c in s.scalars(select(db.Cell).where(db.Cell.run_id == run_id))}
        assert cells["Lin (k=3)"] == ("Lin", {"k": 3}) and cells["linear"] == (None, None)
        for sample in s.scalars(select(db.Sample)):
            drafting = [i for i, d in enumerate(sample.step_stats["drafted"]) if d]
            if not drafting:
                assert sample.acceptance_incl_bonus is None and sample.mean_path_length_all is None
                continue
            depth = sum(sample.step_stats["depth"])
            assert sample.acceptance_incl_bonus == pytest.approx(sum(sample.step_tokens[i] for i in drafting) / depth)
            assert sample.mean_path_length_all == pytest.approx(sample.accepted / sample.iterations)


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
    where = engines.display_url(url)
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
        for table, cols in (
            ("runs", f"owner_host VARCHAR(255)|owner_pid INTEGER|heartbeat_at {stamp}"),
            (
                "samples",
                "draft_forwards INTEGER|acceptance_incl_bonus FLOAT|mean_path_length_all FLOAT|nvml_scope VARCHAR(20)",
            ),
        ):
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


def test_0006_renames_prompt_cap_to_l_max_keeping_values_and_old_suites_parse(old_db):
    """cells.prompt_cap becomes cells.l_max with the same values; the suite text stored with the old runs (which
    says prompt_cap:) still parses, to the L_max its cells were measured at (what ``--resume`` re-reads)."""
    import sqlite3

    from dtbench.harness.suites.suitefile import parse_suite

    con = sqlite3.connect(old_db)
    before = con.execute("SELECT id, run_id, prompt_cap FROM cells ORDER BY id").fetchall()
    texts = dict(con.execute("SELECT id, suite_text FROM runs").fetchall())
    con.close()
    assert before and all("prompt_cap:" in t for t in texts.values())
    assert invoke("db", "upgrade", "--db", str(old_db)).exit_code == 0
    con = sqlite3.connect(old_db)
    assert con.execute("SELECT id, run_id, l_max FROM cells ORDER BY id").fetchall() == before
    assert "prompt_cap" not in [d[0] for d in con.execute("SELECT * FROM cells LIMIT 0").description]
    con.close()
    for run_id, text_ in texts.items():
        caps = {c for ds in parse_suite(text_, f"run {run_id}").datasets for c in ds.l_maxes}
        assert caps == {cap for _, r, cap in before if r == run_id}


def test_0006_downgrades_and_upgrades_again(db_url):
    """0006 round-trips on SQLite and PostgreSQL: the column and its unique constraint follow the name."""
    from alembic import command

    with db.connect(db_url)() as s:
        run = db.Run(suite_name="s", suite_text="", suite_hash="h", status="done", environment={})
        s.add(
            db.Cell(
                run=run,
                dataset="d",
                l_max=8,
                gen_length=4,
                decoder="ar",
                label="ar",
                decoder_version="1",
                decoder_distribution="dtbench",
                params={},
                lossless_expected=True,
                target_model="m",
                status="done",
            )
        )
        s.commit()
    engine = create_engine(db_url)
    try:
        # At head the constraint also holds batch_size (revision 0011, issue 29).
        for rev, column, unique in (
            ("0005", "prompt_cap", ("run_id", "dataset", "prompt_cap", "gen_length", "label")),
            ("head", "l_max", ("run_id", "dataset", "l_max", "gen_length", "batch_size", "label")),
        ):
            with engine.begin() as conn:
                getattr(command, "downgrade" if rev != "head" else "upgrade")(schema._config(conn), rev)
            insp = inspect(engine)
            assert column in {c["name"] for c in insp.get_columns("cells")}
            assert unique in [tuple(u["column_names"]) for u in insp.get_unique_constraints("cells")]
            with engine.connect() as conn:
                assert conn.execute(text(f"SELECT {column} FROM cells")).scalar() == 8
    finally:
        engine.dispose()


def test_0011_old_cells_report_as_batch_size_1_and_the_unique_key_holds_b(old_db):
    """Issue 29: an upgraded database's cells are B = 1 and its samples have no batch group; two cells that differ
    only in batch size may coexist, two with the same B may not."""
    from sqlalchemy.exc import IntegrityError

    url = f"sqlite:///{old_db}"
    assert invoke("db", "upgrade", "--db", str(old_db)).exit_code == 0
    engine = create_engine(url)
    with engine.connect() as conn:
        assert set(conn.execute(text("SELECT DISTINCT batch_size FROM cells")).scalars()) == {1}
        assert conn.execute(text("SELECT COUNT(*) FROM samples WHERE batch_group IS NOT NULL")).scalar() == 0
    sessions = db.connect(url)
    with sessions() as s:
        cell = s.scalars(select(db.Cell)).first()
        fields = dict(
            run_id=cell.run_id,
            dataset=cell.dataset,
            l_max=cell.l_max,
            gen_length=cell.gen_length,
            decoder=cell.decoder,
            label=cell.label,
            decoder_version="1",
            decoder_distribution="d",
            params={},
            lossless_expected=True,
            target_model="m",
            status="done",
        )
        s.add(db.Cell(batch_size=4, **fields))
        s.commit()
        s.add(db.Cell(batch_size=4, **fields))
        with pytest.raises(IntegrityError):
            s.commit()


def test_0014_old_samples_are_repeat_0_old_cells_have_no_load_and_the_unique_key_holds_the_repeat(old_db):
    """Issue 41: an upgraded database's samples are repeat 0 and its cells carry no load (no busy note in any
    report); a second repeat of a stored prompt may be added, the same repeat twice may not."""
    from sqlalchemy.exc import IntegrityError

    from dtbench.harness.measurement import load

    url = f"sqlite:///{old_db}"
    assert invoke("db", "upgrade", "--db", str(old_db)).exit_code == 0
    engine = create_engine(url)
    with engine.connect() as conn:
        assert set(conn.execute(text("SELECT DISTINCT repeat FROM samples")).scalars()) == {0}
        assert conn.execute(text("SELECT COUNT(*) FROM cells WHERE load_start IS NOT NULL")).scalar() == 0
    engine.dispose()
    for fmt in ("table", "markdown", "json"):
        shown = invoke("report", "--db", str(old_db), "--run", "1", "--format", fmt)
        assert shown.exit_code == 0 and "busy machine" not in shown.stdout and "Median" not in shown.stdout, fmt
    sessions = db.connect(url)
    with sessions() as s:
        sample = s.scalars(select(db.Sample)).first()
        assert load.note({c: getattr(sample.cell, c) for c in load.COLUMNS}) is None
        columns = {c.name: getattr(sample, c.name) for c in db.Sample.__table__.columns if c.name not in ("id",)}
        s.add(db.Sample(**{**columns, "repeat": 1}))
        s.commit()
        s.add(db.Sample(**{**columns, "repeat": 1}))
        with pytest.raises(IntegrityError):
            s.commit()


def test_0016_backfills_the_measurer_from_the_params_and_a_served_run_reports_the_same(tmp_path):
    """Issue 49 item 4: a database written before 0016 learns each cell's measurer from the params the reports read
    before (a server's engine, base_url or launch: served; anything else: local), so a run with servers reports the
    same speedups (a server against its plain server, never against ar) after the upgrade as before it."""
    import json

    import reportdb
    from alembic import command

    path = tmp_path / "served.db"
    with reportdb.connect(path)() as session:
        run = reportdb.add_run(session)
        reportdb.add_served_pair(session, run, {"launch": ["srv", "{port}"]})
        lookalike = reportdb.add_cell(session, run, "lin", "linear", params={"k": 2})  # a local cell
        reportdb.add_samples(session, lookalike, [2.0] * 6, warmup=1)
        session.commit()
    before = invoke("report", "--db", str(path), "--format", "json")
    assert before.exit_code == 0, before.output
    url = f"sqlite:///{path}"
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            command.downgrade(schema._config(conn), "0015")
        assert "measurer" not in {c["name"] for c in inspect(engine).get_columns("cells")}
    finally:
        engine.dispose()
    assert invoke("db", "upgrade", "--db", str(path)).exit_code == 0
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            got = dict(conn.execute(text("SELECT label, measurer FROM cells")).all())
    finally:
        engine.dispose()
    assert got == {"ar": "local", "plain": "served", "spec": "served", "lin": "local"}
    after = invoke("report", "--db", str(path), "--format", "json")
    assert after.exit_code == 0, after.output
    rows = {r["label"]: r for r in json.loads(after.stdout)["cells"]}
    assert rows["spec"]["speedup"] == pytest.approx(0.4) and rows["plain"]["speedup"] is None
    assert json.loads(after.stdout)["cells"] == json.loads(before.stdout)["cells"]


def test_the_store_guesses_no_measurer_its_writer_names_it(tmp_path):
    """Issue 58 item 4: no import-time hook of the harness fills ``cells.measurer`` (the runner writes it for every
    cell: tests/test_group_keys.py); a writer that sets none gets the column's default, ``local``, whatever decoder
    the cell names. Before, importing dtbench.harness.measurement.cells made the store ask the registry (``srv`` -> served)."""
    import dtbench.harness.measurement.cells  # noqa: F401  (it registered the store's hook before issue 58)

    assert not hasattr(db, "set_measurer_of")
    with db.connect(f"sqlite:///{tmp_path / 'new.db'}")() as s:
        run = db.Run(suite_name="s", suite_text="", suite_hash="h", status="done", environment={})
        common = dict(dataset="d", l_max=8, gen_length=4, decoder_version="1", decoder_distribution="dtbench")
        common.update(params={}, lossless_expected=True, target_model="m", status="done")
        s.add(db.Cell(run=run, decoder="ar", label="ar", **common))
        s.add(db.Cell(run=run, decoder="server", label="srv", **common))
        s.add(db.Cell(run=run, decoder="server", label="named", measurer="served", **common))
        s.commit()
        got = {c.label: c.measurer for c in s.scalars(select(db.Cell))}
        assert got == {"ar": "local", "srv": "local", "named": "served"}
