"""The Ray executor (issue 11) on a real local Ray cluster (2 CPUs, workers of 1 thread) and tiny float64 models:
the same cells and output tokens as the local executor; a worker process killed mid-group has its group retried
once and nothing is lost or duplicated; a worker that dies twice on a group fails that group's remaining samples;
a driver SIGKILLed mid-run resumes, with either executor, to exactly one sample per (cell, prompt); `calibrate: true`
and `n_max: auto` calibrate on a worker actor, the driver stores the curves with the run and the actors decode with
the budget the driver resolved.

Real processes throughout: Ray actors load the model folders themselves; the test decoders (a tiny plugin
distribution on PYTHONPATH, so the actors see it too) stall, sleep or kill their own worker process.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kit import fast_calibration_settings, invoke, one_line_error, suite_dict, tiny_pair, write_suite
from rich.console import Console
from sqlalchemy import func, select

from dtbench.harness.calibration import calibrate as cal
from dtbench.harness.calibration import calibrate_run
from dtbench.harness.calibration.curves import FED_MASK
from dtbench.harness.execution.executors import LocalExecutor
from dtbench.harness.execution.ray_executor import RayExecutor
from dtbench.harness.execution.runner import run_suite
from dtbench.harness.store import db
from dtbench.harness.suites.suitefile import load_suite

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'dtbench[ray]')")

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.skipif(os.name != "posix", reason="POSIX signals")]

PLUGIN = '''
import os, signal, time
from pathlib import Path
from dtbench.decoders.ar import Autoregressive
from dtbench.decoders.base import DecoderParams


class Probe(Autoregressive):
    @classmethod
    def reference(cls, params):
        return ("ar", {})


class StallParams(DecoderParams):
    pid_file: str


class Stall(Probe):
    """The first call anywhere (it creates `pid_file`) writes its worker's pid there and waits to be killed."""
    Params = StallParams

    def generate(self, input_ids, max_new_tokens):
        try:
            fd = os.open(self.params.pid_file + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            fd = None
        if fd is not None:
            os.close(fd)
            Path(self.params.pid_file).write_text(str(os.getpid()))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(0.05)
        yield from super().generate(input_ids, max_new_tokens)


class SleepyParams(DecoderParams):
    delay: float = 0.2


class Sleepy(Probe):
    Params = SleepyParams

    def generate(self, input_ids, max_new_tokens):
        for step in super().generate(input_ids, max_new_tokens):
            time.sleep(self.params.delay)
            yield step


class Suicide(Probe):
    def generate(self, input_ids, max_new_tokens):
        os.kill(os.getpid(), signal.SIGKILL)
        yield from super().generate(input_ids, max_new_tokens)
'''


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster of 2 CPUs whose workers (and any subprocess driver) import the test plugin."""
    site = tmp_path_factory.mktemp("site")
    (site / "dtbench_raytest.py").write_text(PLUGIN)
    info = site / "dtbench_raytest-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dtbench-raytest\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[dtbench.decoders]\nstall = dtbench_raytest:Stall\n"
        "sleepy = dtbench_raytest:Sleepy\nsuicide = dtbench_raytest:Suicide\n"
    )
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *([old_path] if old_path else [])])
    sys.path.insert(0, str(site))
    import importlib

    importlib.invalidate_caches()
    import logging

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        sys.path.remove(str(site))
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


def run(tmp_path, suite: dict, executor, dbname: str, data_dir) -> tuple[int, str, Path]:
    """run_suite in this process; (run id, console text, database file)."""
    path = write_suite(tmp_path, suite, f"{dbname}.yaml")
    parsed, text = load_suite(path)
    dbfile = tmp_path / f"{dbname}.db"
    out = io.StringIO()
    run_id = run_suite(
        parsed,
        text,
        db.connect(str(dbfile)),
        data_dir=str(data_dir),
        executor=executor,
        console=Console(file=out, width=200),
        progress=False,
    )
    return run_id, " ".join(out.getvalue().split()), dbfile  # console lines unwrapped


def rows(dbfile, sql: str) -> list[tuple]:
    with sqlite3.connect(f"file:{dbfile}?mode=ro", uri=True, timeout=30) as con:
        return con.execute(sql).fetchall()


def one_sample_each(dbfile, cells: int, prompts: int) -> None:
    counts = rows(dbfile, "select cell_id, prompt_index, count(*) from samples group by cell_id, prompt_index")
    assert len(counts) == cells * prompts and all(n == 1 for *_, n in counts), counts


def outputs(dbfile) -> dict:
    return {
        (label, i): h
        for label, i, h in rows(
            dbfile, "select c.label, s.prompt_index, s.output_hash from samples s join cells c on c.id = s.cell_id"
        )
    }


DECODERS = [
    {"name": "ar"},
    {"name": "linear", "params": {"k": 2}},
    {"name": "fixed_tree", "params": {"depth": 2}},
    {"name": "dynatree"},
]


def test_ray_matches_local(cluster, pair, tmp_path, data_dir):
    suite = suite_dict(*pair, DECODERS)
    suite["datasets"][0]["prompts"] = 3
    _, _, local = run(tmp_path, suite, LocalExecutor(threads=1), "local", data_dir)
    path = write_suite(tmp_path, suite)
    result = invoke(
        "run",
        path,
        "--db",
        str(tmp_path / "ray.db"),
        "--data-dir",
        str(data_dir),
        "--no-progress",
        "--executor",
        "ray",
        "--workers",
        "2",
        "--threads-per-worker",
        "1",
    )
    assert result.exit_code == 0, result.output
    ray_db = tmp_path / "ray.db"
    cells = "select dataset, l_max, gen_length, label, decoder, status, lossless_expected from cells order by id"
    assert rows(ray_db, cells) == rows(local, cells) and len(rows(local, cells)) == 4
    assert outputs(ray_db) == outputs(local) and len(outputs(local)) == 12  # the same tokens, sample for sample
    one_sample_each(ray_db, 4, 3)
    assert rows(ray_db, "select distinct status from runs") == [("completed",)]
    # Where each sample was measured: the worker's host and device, under both executors.
    for dbfile in (local, ray_db):
        assert rows(dbfile, "select count(*) from samples where worker_host is null or device_name is null") == [(0,)]
    with db.connect(str(ray_db))() as s:
        env = s.scalars(select(db.Run)).one().environment
    assert env["executor"]["name"] == "ray" and env["executor"]["workers"] == 2 and env["device"] == "cpu"

    # A cell whose samples came from two device models is flagged in the report.
    with sqlite3.connect(ray_db) as con:
        con.execute(
            "update samples set device_name = 'NVIDIA H100' where id = (select min(s.id) from samples s "
            "join cells c on c.id = s.cell_id where c.label = 'linear')"
        )
    report = invoke("report", "--db", str(ray_db), "--format", "markdown")
    assert report.exit_code == 0, report.output
    assert "linear: its samples were measured on 2 different devices" in report.stdout
    assert "speedups across different GPUs are not comparable" in report.stdout
    assert report.stdout.count("different devices") == 1


def test_a_worker_killed_mid_group_is_retried_once(cluster, pair, tmp_path, data_dir):
    pid_file = tmp_path / "pid"
    decoders = [
        {"name": "ar"},
        {"name": "stall", "params": {"pid_file": str(pid_file)}},
        {"name": "linear", "params": {"k": 2}},
    ]
    suite = suite_dict(*pair, decoders)
    killed: dict = {}

    def killer():  # kill the worker process that is measuring `stall`, from outside it, as the OOM killer would
        deadline = time.monotonic() + 240
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)
        killed["pid"], killed["at"] = int(pid_file.read_text()), db.utcnow()
        os.kill(killed["pid"], signal.SIGKILL)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    run_id, console, dbfile = run(tmp_path, suite, RayExecutor(workers=2, threads_per_worker=1), "killed", data_dir)
    thread.join(timeout=10)
    assert "pid" in killed, "the worker was never killed"
    assert f"pid {killed['pid']}" in console and "retrying the group on another worker" in console, console
    assert rows(dbfile, "select status from runs") == [("completed",)]
    assert rows(dbfile, "select label, status, error from cells order by id") == [
        ("ar", "done", None),
        ("stall", "done", None),
        ("linear", "done", None),
    ]
    one_sample_each(dbfile, 3, 2)  # nothing lost, nothing measured twice
    # The killed group's reference, committed before the kill, was kept and served the retry: not measured again.
    with db.connect(str(dbfile))() as s:
        at = {
            (label, i): t.replace(tzinfo=None)
            for label, i, t in s.execute(
                select(db.Cell.label, db.Sample.prompt_index, db.Sample.created_at).join(db.Cell)
            )
        }
    kill = killed["at"].replace(tzinfo=None)
    assert any(at[("ar", i)] < kill < at[("stall", i)] for i in range(2)), (at, kill)
    assert rows(dbfile, "select count(*) from samples where lossless = 0") == [(0,)]


def test_a_group_whose_worker_dies_twice_fails_its_remaining_samples(cluster, pair, tmp_path, data_dir):
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "suicide"}, {"name": "linear", "params": {"k": 2}}])
    suite["datasets"][0].update(prompts=1, warmup=0)
    _, console, dbfile = run(tmp_path, suite, RayExecutor(workers=2, threads_per_worker=1), "twice", data_dir)
    assert console.count("died while measuring") == 2 and "second attempt" in console, console
    assert rows(dbfile, "select status from runs") == [("completed",)]
    cells = rows(dbfile, "select label, status, error from cells order by id")
    assert cells[0] == ("ar", "done", None)
    for _label, status, error in cells[1:]:  # the group's samples not stored yet fail their cells
        assert status == "failed" and error.startswith("prompt 0: the worker died (twice): ActorDiedError"), cells
    assert rows(dbfile, "select c.label, count(*) from samples s join cells c on c.id = s.cell_id group by 1") == [
        ("ar", 1)
    ]


def dtbench(*args) -> list[str]:
    return [sys.executable, "-m", "dtbench.cli.main", *map(str, args)]


@pytest.mark.parametrize("resume_with", ["local", "ray"])
def test_driver_killed_then_resumed(cluster, pair, tmp_path, data_dir, resume_with):
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "sleepy", "params": {"delay": 0.25}}])
    suite["datasets"][0]["prompts"] = 4
    path = write_suite(tmp_path, suite)
    dbfile = tmp_path / "results.db"
    common = ["--db", dbfile, "--data-dir", data_dir, "--no-progress", "--no-report", "--threads-per-worker", "1"]
    proc = subprocess.Popen(
        dtbench("run", path, *common, "--executor", "ray", "--address", cluster, "--workers", 2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        n = 0
        while n < 1 and time.monotonic() < deadline:
            assert proc.poll() is None, f"dtbench run exited early: {proc.stderr.read()[-2000:]}"
            try:
                n = rows(dbfile, "select count(*) from samples")[0][0]
            except sqlite3.OperationalError:
                n = 0
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # no handler runs: the run stays 'running', its actors die with it
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    before = rows(dbfile, "select id, cell_id, prompt_index, output_hash, created_at from samples order by id")
    assert 1 <= len(before) < 8, "killed too late to test resuming"
    assert rows(dbfile, "select status from runs") == [("running",)]

    extra = ["--executor", "ray", "--workers", "1"] if resume_with == "ray" else []
    result = invoke("run", path, *map(str, common), "--resume", *extra)
    assert result.exit_code == 0, result.output
    assert rows(dbfile, "select id, status from runs") == [(1, "completed")]
    one_sample_each(dbfile, 2, 4)
    after = rows(dbfile, "select id, cell_id, prompt_index, output_hash, created_at from samples order by id")
    assert after[: len(before)] == before  # measured before the kill: kept, not re-measured
    assert rows(
        dbfile, "select distinct lossless from samples s join cells c on c.id = s.cell_id where c.decoder = 'sleepy'"
    ) == [(1,)]
    with db.connect(str(dbfile))() as s:
        assert s.scalar(select(func.count()).select_from(db.Sample).where(db.Sample.worker_host.is_(None))) == 0


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_ray_options_and_a_missing_ray_are_one_line_errors(pair, tmp_path, monkeypatch):
    path = write_suite(tmp_path, suite_dict(*pair, [{"name": "ar"}]))
    one_line_error(invoke("run", path, "--workers", "2"), "--address and --workers need --executor ray")
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    one_line_error(invoke("run", path, "--executor", "ray"), "--executor ray needs Ray", "pip install 'dtbench[ray]'")


# --- calibration on a worker (issue 12) ----------------------------------------------------------------------------

Fast = fast_calibration_settings()  # one forward per point


FAST = Fast()
CAL_KEYS = "select role, n, cache_len, tree_mask, last_only from calibrations order by 1, 2, 3, 4, 5"


def calibrate_suite(pair, decoders: list, **extra) -> dict:
    suite = suite_dict(*pair, decoders, **extra)
    suite["datasets"][0].update(prompts=2, warmup=0)
    return suite


def test_calibrate_true_runs_on_a_worker(cluster, pair, tmp_path, data_dir, monkeypatch):
    """`calibrate: true` under Ray: the first actor measures, the driver stores the same rows as the local executor
    with the worker's host and device, and `report --cost-model` prices every cell."""
    monkeypatch.setattr(calibrate_run, "Settings", Fast)
    suite = calibrate_suite(
        pair,
        [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}, {"name": "fixed_tree", "params": {"depth": 2}}],
        calibrate=True,
    )
    _, local_console, local = run(tmp_path, suite, LocalExecutor(threads=1), "cal-local", data_dir)
    ray_db = tmp_path / "cal-ray.db"  # through the command, progress bar on (live while the worker calibrates)
    result = invoke(
        "run",
        write_suite(tmp_path, suite),
        "--db",
        str(ray_db),
        "--data-dir",
        str(data_dir),
        "--no-report",
        "--executor",
        "ray",
        "--workers",
        "2",
        "--threads-per-worker",
        "1",
    )
    assert result.exit_code == 0, result.output
    run_id, console = 1, " ".join(result.output.split())
    assert rows(ray_db, "select status from runs") == [("completed",)]
    keys = rows(ray_db, CAL_KEYS)
    assert keys == rows(local, CAL_KEYS) and len(keys) > 20  # the same curves, point for point
    assert rows(ray_db, "select distinct run_id, device from calibrations") == [(run_id, "cpu")]
    with db.connect(str(ray_db))() as s:
        run_row = s.get(db.Run, run_id)
        where, env_device = run_row.environment["calibration"], run_row.environment["device_name"]
        batch = s.scalars(select(db.Calibration.batch).limit(1)).one()
    # Measured by an actor (another process), recorded as such; the rows carry that worker's device name.
    assert where["batch"] == batch and where["pid"] != os.getpid() and where["device"] == "cpu", where
    assert where["device_name"] == env_device  # the first worker's: the run's environment
    assert rows(ray_db, "select distinct device_name from calibrations") == [(where["device_name"],)]
    assert f"(pid {where['pid']}, " in console and "calibration stored" in console, console
    assert "curves" in local_console and "interleaved pass 1/1" in local_console  # local: each pass; Ray: a spinner
    one_sample_each(ray_db, 3, 2)
    report = invoke("report", "--db", str(ray_db), "--cost-model", "--format", "json")
    assert report.exit_code == 0, report.output
    out = json.loads(report.output)
    assert out["calibration"] == {"batch": batch, "run_id": run_id}
    assert {c["label"] for c in out["cells"]} == {"ar", "linear", "fixed_tree"}
    assert all(c["predicted_s"] > 0 and c["measured_s"] > 0 for c in out["cells"])


def verify_sizes(dbfile, label: str) -> list[int]:
    """Tokens fed by each tree-masked target forward (root + drafted nodes) of a decoder's samples."""
    fed = [
        json.loads(ss)["target_fed"]
        for (ss,) in rows(
            dbfile, f"select s.step_stats from samples s join cells c on c.id = s.cell_id where c.label = '{label}'"
        )
    ]
    return [n for sample in fed for step in sample for n, _past, flags in step if flags & FED_MASK]


def test_auto_budget_resolved_by_the_driver_reaches_the_workers(cluster, pair, tmp_path, data_dir, monkeypatch):
    """`n_max: auto` under Ray: calibrated on an actor, resolved by the driver (here pinned to 3), recorded in the
    cell's params and used by every actor's decoder (no tree verification beyond root + 3 nodes); outputs equal the
    local executor's."""
    monkeypatch.setattr(calibrate_run, "Settings", Fast)
    monkeypatch.setattr(
        calibrate_run, "auto_budget", lambda curves, cache_len, factor: 3
    )  # the driver's choice, not timing
    suite = calibrate_suite(pair, [{"name": "ar"}, {"name": "dynatree", "params": {"n_max": "auto"}}])
    _, _, local = run(tmp_path, suite, LocalExecutor(threads=1), "auto-local", data_dir)
    _, console, ray_db = run(tmp_path, suite, RayExecutor(workers=2, threads_per_worker=1), "auto-ray", data_dir)
    assert "n_max: auto -> 3 for dynatree" in console, console
    cells = "select label, status, params from cells order by id"
    assert rows(ray_db, cells) == rows(local, cells)
    assert json.loads(rows(ray_db, "select params from cells where label = 'dynatree'")[0][0])["n_max"] == 3
    assert rows(ray_db, "select distinct status from cells") == [("done",)]
    assert outputs(ray_db) == outputs(local) and len(outputs(local)) == 4
    one_sample_each(ray_db, 2, 2)
    for dbfile in (local, ray_db):  # the decoders ran the resolved budget, on both executors
        sizes = verify_sizes(dbfile, "dynatree")
        assert sizes and max(sizes) <= 1 + 3, sizes
    assert rows(ray_db, "select count(*) from calibrations where run_id = 1")[0][0] > 0


class _FakeRay:
    def get(self, ref):
        return ref


class _FakeHandle:
    class calibrate:  # noqa: N801  (an actor method: handle.calibrate.remote(...))
        @staticmethod
        def remote(contexts, settings):
            return cal.Measured([], "node-a", 11, "cuda:0", "NVIDIA A100")


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_workers_with_different_devices_calibrate_on_the_first_with_a_warning():
    from dtbench.harness.execution.ray_executor import _Actor
    from dtbench.harness.execution.worker import WorkerInfo

    def actor(host, name):
        return _Actor(_FakeHandle(), None, WorkerInfo(host, 11, "cuda:0", name, {}, {}, None, []))

    executor = RayExecutor(workers=2)
    executor.ray, executor.actors = _FakeRay(), [actor("node-a", "NVIDIA A100"), actor("node-b", "NVIDIA H100")]
    out = io.StringIO()
    measured = executor.calibrate({}, FAST, Console(file=out, width=300))
    assert measured.host == "node-a" and measured.device_name == "NVIDIA A100"
    warning, calibrating = out.getvalue().strip().splitlines()
    assert "different devices" in warning and "curves come from NVIDIA A100 (node-a) only" in warning, warning
    assert calibrating.startswith("calibrating the cost model on Ray worker node-a"), calibrating
