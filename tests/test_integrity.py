"""Run integrity (issue 8): a run's recorded status is always true, a misbehaving plugin fails only its own cell,
built-in names cannot be hijacked, a live run is not taken over, exit codes tell what happened, and a hanging
decoder is stopped by the per-sample time limit.

Runs go through the real CLI and runner on tiny float64 model folders (kit.tiny_pair) and real WikiText-2 text;
plugins are tiny distributions installed into a temporary folder on sys.path.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
from kit import install_plugin, invoke, one_line_error, suite_dict, tiny_pair, write_suite
from sqlalchemy import func, select

from dtbench.harness import registry
from dtbench.harness.execution import deadline
from dtbench.harness.store import db, runs

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

PLUGINS = '''
import sys, time
import numpy as np
from dtbench.decoders.ar import Autoregressive
from dtbench.decoders.base import Step


class Probe(Autoregressive):
    @classmethod
    def reference(cls, params):
        return ("ar", {})


class NumpyTokens(Probe):
    def generate(self, input_ids, max_new_tokens):
        for step in super().generate(input_ids, max_new_tokens):
            yield Step(tokens=tuple(np.int64(t) for t in step.tokens))


class FloatTokens(Probe):
    def generate(self, input_ids, max_new_tokens):
        for step in super().generate(input_ids, max_new_tokens):
            yield Step(tokens=tuple(float(t) for t in step.tokens))


class BadCounter(Probe):
    def generate(self, input_ids, max_new_tokens):
        for step in super().generate(input_ids, max_new_tokens):
            yield Step(tokens=step.tokens, accepted="many")


class Exits(Probe):
    def generate(self, input_ids, max_new_tokens):
        yield from super().generate(input_ids, 1)
        sys.exit(3)


class Hangs(Probe):
    def generate(self, input_ids, max_new_tokens):
        yield from super().generate(input_ids, 1)
        while True:  # pure Python between two yields, catching everything it can
            try:
                time.sleep(0.01)
            except Exception:
                pass


class Wrong(Probe):
    """Claims to be lossless and is not."""
    def generate(self, input_ids, max_new_tokens):
        for i, step in enumerate(super().generate(input_ids, max_new_tokens)):
            yield Step(tokens=(5,) if i == 2 else step.tokens)


class FastFake(Autoregressive):
    """A hijacker: 'ar' that does nothing."""
    def generate(self, input_ids, max_new_tokens):
        yield Step(tokens=(0,) * max_new_tokens)
'''

NAMES = {
    "np_tokens": "NumpyTokens",
    "float_tokens": "FloatTokens",
    "bad_counter": "BadCounter",
    "exits": "Exits",
    "hangs": "Hangs",
    "wrong": "Wrong",
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    install_plugin(
        monkeypatch, tmp_path / "site", "dtbench-probe", {k: f"dtbench_probe:{v}" for k, v in NAMES.items()}, PLUGINS
    )


def run_cli(tmp_path, data_dir, suite, *extra):
    dbfile = tmp_path / "r.db"
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress", *extra
    )
    return result, dbfile


def cells_of(dbfile):
    with db.connect(str(dbfile))() as s:
        return {c.label: (c.status, c.error, len(c.samples)) for c in s.scalars(select(db.Cell))}


def run_row(dbfile):
    with db.connect(str(dbfile))() as s:
        run = s.scalars(select(db.Run)).one()
        return run.status, run.error


def test_bad_step_contents_and_sys_exit_fail_only_their_cells(plugins, pair, tmp_path, data_dir):
    decoders = [
        {"name": "ar"},
        {"name": "np_tokens"},
        {"name": "float_tokens"},
        {"name": "bad_counter"},
        {"name": "exits"},
        {"name": "linear", "params": {"k": 2}},
    ]
    result, dbfile = run_cli(tmp_path, data_dir, suite_dict(*pair, decoders))
    assert result.exit_code == 4, result.output  # a cell failed
    cells = cells_of(dbfile)
    assert cells["np_tokens"] == ("done", None, 2)  # numpy integers are integer ids: accepted as such
    assert cells["float_tokens"][0] == "failed" and "not an integer id" in cells["float_tokens"][1]
    assert cells["bad_counter"][0] == "failed" and "Step.accepted must be an integer" in cells["bad_counter"][1]
    assert cells["exits"][0] == "failed" and "SystemExit" in cells["exits"][1]
    assert cells["linear"] == ("done", None, 2)  # the run went on after them
    assert run_row(dbfile) == ("completed", None)
    assert "a cell failed" in result.stderr
    failed = [line.strip() for line in result.stderr.splitlines() if line.startswith("  ")]  # each failed cell, why
    assert [line.split(" ")[0] for line in failed] == ["float_tokens", "bad_counter", "exits"], result.stderr
    assert "SystemExit" in failed[2] and "B=1 T=" in failed[2]


def test_database_failure_leaves_run_failed_and_resumable(pair, tmp_path, data_dir, monkeypatch):
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}])
    real_add = db.Session.add
    calls = {"n": 0}

    def flaky_add(self, obj, *a, **k):
        if isinstance(obj, db.Sample):
            calls["n"] += 1
            if calls["n"] == 3:
                from sqlalchemy.exc import OperationalError

                raise OperationalError("INSERT INTO samples", {}, Exception("disk I/O error"))
        return real_add(self, obj, *a, **k)

    monkeypatch.setattr(db.Session, "add", flaky_add)
    result, dbfile = run_cli(tmp_path, data_dir, suite)
    assert result.exit_code == 1, result.output
    assert "run 1 failed" in result.stderr and "--resume-run 1" in result.stderr and "Traceback" not in result.output
    status, error = run_row(dbfile)
    assert status == "failed" and "disk I/O error" in error
    assert all(status != "done" for status, _, _ in cells_of(dbfile).values())
    monkeypatch.undo()
    result, _ = run_cli(tmp_path, data_dir, suite, "--resume")
    assert result.exit_code == 0, result.output
    assert run_row(dbfile) == ("completed", None)
    with db.connect(str(dbfile))() as s:
        rows = s.execute(
            select(db.Sample.cell_id, db.Sample.prompt_index, func.count()).group_by(
                db.Sample.cell_id, db.Sample.prompt_index
            )
        ).all()
    assert len(rows) == 4 and all(n == 1 for *_, n in rows)


def test_hanging_decoder_times_out_and_the_run_goes_on(plugins, pair, tmp_path, data_dir):
    decoders = [{"name": "ar"}, {"name": "hangs"}, {"name": "linear", "params": {"k": 2}}]
    result, dbfile = run_cli(tmp_path, data_dir, suite_dict(*pair, decoders, timeout_s=1.5))
    assert result.exit_code == 4, result.output
    cells = cells_of(dbfile)
    assert cells["hangs"][0] == "failed" and cells["hangs"][1] == "prompt 0: timed out after 1.5 s"
    assert cells["linear"] == ("done", None, 2)
    assert run_row(dbfile) == ("completed", None)


def test_auto_timeout_is_derived_from_the_reference():
    assert deadline.sample_timeout("auto", 2.0) == 60.0
    assert deadline.sample_timeout("auto", 30.0) == 300.0
    assert deadline.sample_timeout("auto", None) == deadline.AUTO_TIMEOUT_REFERENCE_S
    assert deadline.sample_timeout(5, 30.0) == 5.0 and deadline.sample_timeout(None, 30.0) is None


def test_exit_code_for_divergence_and_for_both(plugins, pair, tmp_path, data_dir):
    result, _ = run_cli(tmp_path, data_dir, suite_dict(*pair, [{"name": "ar"}, {"name": "wrong"}]))
    assert result.exit_code == 3, result.output
    assert "diverged" in result.stderr
    (tmp_path / "r.db").unlink()
    result, _ = run_cli(tmp_path, data_dir, suite_dict(*pair, [{"name": "ar"}, {"name": "wrong"}, {"name": "exits"}]))
    assert result.exit_code == 5, result.output


def test_builtin_names_are_reserved(monkeypatch, tmp_path, pair, data_dir):
    install_plugin(monkeypatch, tmp_path / "site", "evil-dist", {"ar": "evil_dist:FastFake"}, PLUGINS)
    found = registry.scan()
    assert found.entries["ar"].distribution == "dtbench"
    assert [e.distribution for e in found.refused] == ["evil-dist"]
    listing = invoke("decoders")
    assert "refused" in listing.stdout and "evil-dist" in listing.stdout
    assert "decoder 'ar' from distribution evil-dist 0.1 refused" in listing.stderr
    result, dbfile = run_cli(tmp_path, data_dir, suite_dict(*pair, [{"name": "ar"}]))
    assert result.exit_code == 0, result.output
    assert "refused" in result.stderr
    with db.connect(str(dbfile))() as s:
        assert s.scalars(select(db.Cell)).one().decoder_distribution == "dtbench"


def test_two_distributions_claiming_one_name(monkeypatch, tmp_path, pair):
    install_plugin(monkeypatch, tmp_path / "a", "dist-one", {"lookup": "dist_one:Wrong"}, PLUGINS)
    install_plugin(monkeypatch, tmp_path / "b", "dist-two", {"lookup": "dist_two:Wrong"}, PLUGINS)
    path = write_suite(tmp_path, suite_dict(*pair, [{"name": "lookup"}]))
    one_line_error(invoke("validate", path), "'lookup' is registered by dist-one 0.1 and dist-two 0.1")


def test_resume_refuses_a_live_run_unless_forced(pair, tmp_path, data_dir):
    suite = suite_dict(*pair, [{"name": "ar"}])
    result, dbfile = run_cli(tmp_path, data_dir, suite)
    assert result.exit_code == 0
    sessions = db.connect(str(dbfile))

    def set_owner(**kw):
        with sessions() as s:
            run = s.scalars(select(db.Run)).one()
            run.status = "running"
            for k, v in kw.items():
                setattr(run, k, v)
            s.commit()

    # This very process is alive on this host: a second `dtbench run --resume` must not write into its run.
    set_owner(owner_host=socket.gethostname(), owner_pid=os.getpid(), heartbeat_at=db.utcnow())
    one_line_error(
        run_cli(tmp_path, data_dir, suite, "--resume")[0],
        "run 1 is still being written",
        f"pid {os.getpid()} on this host",
        "--force",
    )
    # Another host with a fresh heartbeat: alive. A stale heartbeat: dead, free to resume.
    set_owner(owner_host="elsewhere", owner_pid=1, heartbeat_at=db.utcnow() - timedelta(seconds=10))
    one_line_error(run_cli(tmp_path, data_dir, suite, "--resume")[0], "host elsewhere")
    set_owner(owner_host="elsewhere", owner_pid=1, heartbeat_at=db.utcnow() - timedelta(seconds=runs.STALE_S + 5))
    assert run_cli(tmp_path, data_dir, suite, "--resume")[0].exit_code == 0
    # A live owner on this host is never taken over, not even with --force (issue 19: two writers of one run).
    set_owner(owner_host=socket.gethostname(), owner_pid=os.getpid(), heartbeat_at=db.utcnow())
    one_line_error(
        run_cli(tmp_path, data_dir, suite, "--resume", "--force")[0],
        "run 1 is still being written",
        f"kill {os.getpid()}",
    )
    # --force takes over an owner on another host whose heartbeat is fresh (it cannot be checked from here).
    set_owner(owner_host="elsewhere", owner_pid=1, heartbeat_at=db.utcnow() - timedelta(seconds=10))
    assert run_cli(tmp_path, data_dir, suite, "--resume", "--force")[0].exit_code == 0
    with sessions() as s:
        run = s.scalars(select(db.Run)).one()
        assert run.status == "completed" and run.owner_pid == os.getpid()


def test_a_dead_pid_on_this_host_is_free_to_resume(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    run = db.Run(status="running", owner_host=socket.gethostname(), owner_pid=dead, heartbeat_at=db.utcnow())
    assert runs.owner_alive(run) is None
    run.owner_pid = os.getpid()
    assert "still running" in runs.owner_alive(run)
    run.status = "interrupted"
    assert runs.owner_alive(run) is None
