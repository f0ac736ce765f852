"""A run's lifecycle (issues 19 and 50): resume refuses a run id no database holds and a run another live
process still writes; the CPU-time limit (auto timeout) spares a descheduled decoder and stops a spinning one; a
compile step runs under the cell's deadline; a run whose process died is marked crashed and resumed past the cell;
an interrupted run marks its cells interrupted and keeps every compile; an isolated child's output goes to its log.

Split out of tests/test_hardening.py by subject (issue 57 item 3); each section names the issue item it tests.
Shared helpers: tests/hardening_kit.py.
"""

from __future__ import annotations

import os

import pytest
from hardening_kit import TINY
from kit import invoke, one_line_error, write_suite

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)


# --- issue 19 item 13 and also seen: resuming a run no database holds, or one still being written ------------------


def test_huge_resume_run_id(tmp_path, data_dir):
    from dtbench.harness.store import db

    dbfile = tmp_path / "r.db"
    db.connect(str(dbfile))
    one_line_error(
        invoke(
            "run",
            write_suite(tmp_path, TINY),
            "--db",
            str(dbfile),
            "--data-dir",
            str(data_dir),
            "--resume-run",
            "99999999999999999999999",
            "--no-progress",
        ),
        "no run 99999999999999999999999",
    )


def test_resuming_a_live_run_is_refused_before_models_load(tmp_path, monkeypatch):
    import socket

    from sqlalchemy import select

    from dtbench.harness.models import loading as models
    from dtbench.harness.store import db
    from dtbench.harness.suites.suitefile import load_suite, suite_hash

    path = write_suite(tmp_path, TINY)
    _, text = load_suite(path)
    dbfile = tmp_path / "r.db"
    sessions = db.connect(str(dbfile))
    with sessions() as s:
        s.add(
            db.Run(
                suite_name="tiny",
                suite_path=path,
                suite_text=text,
                suite_hash=suite_hash(text),
                status="running",
                environment={},
                owner_host=socket.gethostname(),
                owner_pid=os.getpid(),
                heartbeat_at=db.utcnow(),
            )
        )
        s.commit()

    def no_loading(*a, **kw):
        raise AssertionError("models loaded before the run's owner was checked")

    monkeypatch.setattr(models, "load_tokenizer", no_loading)
    monkeypatch.setattr(models, "load_model", no_loading)
    for extra in ([], ["--force"]):
        one_line_error(
            invoke("run", path, "--db", str(dbfile), "--resume", "--no-progress", *extra),
            "run 1 is still being written",
            f"pid {os.getpid()} on this host",
        )
    with sessions() as s:
        assert s.scalars(select(db.Run)).one().owner_pid == os.getpid()  # untouched


# --- issue 19, also seen: the auto timeout on a busy machine -------------------------------------------------------


class _Paced:
    """A decoder whose T steps each take ``wait`` seconds of wall time: sleeping (descheduled by a busy machine:
    no CPU used) or spinning (computing: CPU used)."""

    def __init__(self, wait: float, spin: bool):
        import torch

        self.target, self.draft, self.wait, self.spin = torch.nn.Linear(1, 1), None, wait, spin

    def generate(self, input_ids, T):
        import time

        from dtbench.decoders.base import Step

        for _i in range(T):
            end = time.monotonic() + self.wait
            while self.spin and time.monotonic() < end:
                pass
            if not self.spin:
                time.sleep(self.wait)
            yield Step(tokens=(5,), drafted=0, accepted=0, depth=0)


def test_cpu_limit_spares_a_descheduled_decoder_and_stops_a_spinning_one():
    import torch

    from dtbench.harness.measurement.measure import SampleTimeout, measure

    cpu = torch.device("cpu")
    m = measure(_Paced(0.3, spin=False), [1, 2], 4, cpu, timeout_s=None, cpu_timeout_s=0.5)  # 1.2 s wall, ~0 CPU
    assert m.tokens == [5] * 4 and m.cpu_s is not None and m.cpu_s < 0.5
    with pytest.raises(SampleTimeout):
        measure(_Paced(0.3, spin=True), [1, 2], 40, cpu, timeout_s=None, cpu_timeout_s=0.5)


@pytest.mark.fast  # keeps the module's subject in the fast tier (issue 57)
def test_auto_timeout_uses_the_reference_cpu_time():
    from dtbench.harness.execution import deadline as runner

    assert runner.cpu_timeout("auto", 4.2, 8.0) == (runner.AUTO_TIMEOUT_REFERENCE_S, 80.0)
    assert runner.cpu_timeout("auto", 300.0, 2.0) == (3000.0, 60.0)
    assert runner.cpu_timeout("auto", 4.2, None) == (60.0, None)  # a stored reference: wall time only, as before
    assert runner.cpu_timeout(5, 4.2, 8.0) == (5.0, None) and runner.cpu_timeout(None, 4.2, 8.0) == (None, None)


def test_references_hand_their_cpu_time_to_the_next_decoders(monkeypatch):
    """run_group passes the reference's CPU seconds to measure_cell, which sets the CPU limit from them."""
    from dtbench.harness.measurement import local_measurer as runner

    seen = []
    monkeypatch.setattr(
        runner,
        "measure_rows",
        lambda *a, timeout_s=None, cpu_timeout_s=None, **k: (
            seen.append((timeout_s, cpu_timeout_s)) or (_ for _ in ()).throw(RuntimeError("stop"))
        ),
    )
    from types import SimpleNamespace

    class Fake:  # a decoder class: constructed, no corpus declared
        def __init__(self, *args):
            pass

        corpus_of = staticmethod(lambda params: None)

    cp = SimpleNamespace(reference_label="ar", label="x", cls=Fake, params=None, sampling=None)
    suite = SimpleNamespace(timeout_s="auto", seed=0)
    prompt = SimpleNamespace(index=0, token_ids=(1, 2))
    target = SimpleNamespace(model=None)
    from dtbench.harness.measurement.sample import Reference

    group = SimpleNamespace(batch_size=1, gen_length=4, warmup=False, prompt_index=0, prompt_indices=(0,))
    runner.measure_cell(cp, [prompt], group, Reference([[5] * 4], 4.2, 8.0), target, None, None, suite)
    from dtbench.harness.execution.deadline import AUTO_TIMEOUT_REFERENCE_S

    assert seen == [(AUTO_TIMEOUT_REFERENCE_S, 80.0)]


# --- issue 50: nothing runs that nobody asked for (round 5) --------------------------------------------------------

SPINNING = '''
import os
import time
from dtbench.decoders.ar import Autoregressive


class Spinning(Autoregressive):
    """AR whose generate spins in pure Python for DTBENCH_SPIN_S seconds before decoding (a hang, bounded so that
    the code before the fix ends too)."""

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate(self, input_ids, max_new_tokens):
        end = time.monotonic() + float(os.environ["DTBENCH_SPIN_S"])
        while time.monotonic() < end:
            pass
        yield from super().generate(input_ids, max_new_tokens)
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kit import tiny_pair

    return tiny_pair(tmp_path_factory.mktemp("models"))


def test_a_compiled_cells_compile_step_runs_under_its_deadline(tiny, tmp_path, data_dir, monkeypatch):
    """Issue 50 item A(a): the compile step calls the decoder's generate; a plugin that hangs there is stopped at
    the cell's timeout_s (before the fix it ran on for the whole 150 s spin, past the deadline)."""
    import time

    from kit import install_plugin, suite_dict
    from sqlalchemy import select

    from dtbench.harness.store import db

    install_plugin(
        monkeypatch, tmp_path / "site", "dtbench-spinning", {"spinning": "dtbench_spinning:Spinning"}, SPINNING
    )
    monkeypatch.setenv("DTBENCH_SPIN_S", "150")
    decoders = [{"name": "ar"}, {"name": "spinning", "execution": ["compiled"]}]
    suite = suite_dict(*tiny, decoders, execution=["eager", "compiled"], timeout_s=5, isolation="none")
    suite["datasets"][0].update(prompts=1, warmup=0)
    dbfile = tmp_path / "spin.db"
    t0 = time.monotonic()
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    took = time.monotonic() - t0
    assert result.exit_code == 4, result.output  # a cell failed, the run ended
    assert took < 120, took
    with db.connect(str(dbfile))() as s:
        cell = s.scalars(select(db.Cell).where(db.Cell.label == "spinning [compiled]")).one()
        assert cell.status == "failed" and "timed out after 5 s (in the compile step)" in cell.error, cell.error
    assert "timed out after 5 s (in the compile step)" in result.output


ABORTING = '''
from dtbench.decoders.ar import Autoregressive


class Aborting(Autoregressive):
    """AR that aborts its process (SIGABRT) on every prompt."""

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate(self, input_ids, max_new_tokens):
        import os

        os.abort()
        yield from super().generate(input_ids, max_new_tokens)
'''


def test_a_run_that_died_is_marked_crashed_and_resume_skip_failed_goes_past_it(tiny, tmp_path, data_dir, monkeypatch):
    """Issue 50 item B: a decoder that aborts the process under isolation: none (a `dtbench run` of its own, exit
    134) left the run `running` forever; now `report` marks it crashed (its owner pid is gone) with the cell it
    was measuring failed, and `--resume --skip-failed` completes the run without measuring that cell again."""
    import subprocess
    import sys
    from pathlib import Path

    from kit import install_plugin, suite_dict
    from sqlalchemy import select

    from dtbench.harness.store import db

    site = tmp_path / "site"
    install_plugin(monkeypatch, site, "dtbench-crashing", {"aborting": "dtbench_crashing:Aborting"}, ABORTING)
    decoders = [{"name": "ar"}, {"name": "aborting"}, {"name": "linear", "params": {"k": 2}}]
    suite = suite_dict(*tiny, decoders, isolation="none")
    suite["datasets"][0].update(prompts=2, warmup=1)
    path, dbfile = write_suite(tmp_path, suite), tmp_path / "crash.db"
    args = ["run", path, "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    dtbench = str(Path(sys.executable).with_name("dtbench"))
    died = subprocess.run([dtbench, *args], env=env, capture_output=True, text=True, timeout=300)
    assert died.returncode in (-6, 134), died.stderr[-2000:]  # SIGABRT: nothing recorded by the process itself
    with db.connect(str(dbfile))() as s:
        assert s.scalars(select(db.Run)).one().status == "running"
    shown = invoke("report", "--db", str(dbfile))
    assert shown.exit_code == 0, shown.output
    assert "was still marked running, but the run's process (pid" in shown.stderr, shown.stderr
    assert " · crashed · " in shown.stdout, shown.stdout
    assert "aborting failed: crashed: the run's process died while measuring this cell" in shown.output
    with db.connect(str(dbfile))() as s:  # reports read the database only: the next resume stores it
        assert s.scalars(select(db.Run)).one().status == "running"
    resumed = invoke(*args, "--resume", "--skip-failed")
    assert resumed.exit_code == 4, resumed.output  # completed, with the crashing cell failed
    assert "was still marked running, but the run's process (pid" in resumed.stderr
    with db.connect(str(dbfile))() as s:
        run = s.scalars(select(db.Run)).one()
        cells = {c.label: c for c in run.cells}
        assert run.status == "completed" and run.measuring_cell_id is None
        assert cells["aborting"].status == "failed" and cells["aborting"].error.startswith("crashed: the run's")
        assert len(cells["ar"].samples) == len(cells["linear"].samples) == 2
    one_line_error(invoke(*args, "--skip-failed"), "--skip-failed needs --resume")


INTERRUPTING = '''
import os
from dtbench.decoders.ar import Autoregressive


class Interrupting(Autoregressive):
    """AR that raises KeyboardInterrupt (as Ctrl-C would) on prompt DTBENCH_INTERRUPT_AT's length of input."""

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate(self, input_ids, max_new_tokens):
        calls = int(os.environ.get("DTBENCH_CALLS", "0")) + 1
        os.environ["DTBENCH_CALLS"] = str(calls)
        if calls == int(os.environ["DTBENCH_INTERRUPT_AT"]):
            raise KeyboardInterrupt
        yield from super().generate(input_ids, max_new_tokens)
'''


def test_an_interrupted_run_marks_cells_with_samples_interrupted_and_keeps_every_compile(
    tiny, tmp_path, data_dir, monkeypatch
):
    """Issue 50 item D: cells of an interrupted run that hold samples are `interrupted` (they were left `pending`),
    with a note in the report; a resumed run's compile step no longer overwrites the first one's compile_s (every
    one is kept in compile_runs)."""
    from kit import install_plugin, suite_dict
    from sqlalchemy import select

    from dtbench.harness.execution.runner import commit_outcome
    from dtbench.harness.measurement.cells import Outcome
    from dtbench.harness.store import db

    site = tmp_path / "site"
    install_plugin(
        monkeypatch, site, "dtbench-interrupting", {"stops": "dtbench_interrupting:Interrupting"}, INTERRUPTING
    )
    monkeypatch.setenv("DTBENCH_INTERRUPT_AT", "2")
    monkeypatch.setenv("DTBENCH_CALLS", "0")
    decoders = [{"name": "ar"}, {"name": "stops"}, {"name": "linear", "params": {"k": 2}}]
    suite = suite_dict(*tiny, decoders)
    suite["datasets"][0].update(prompts=3, warmup=1)
    path, dbfile = write_suite(tmp_path, suite), tmp_path / "int.db"
    args = ["run", path, "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"]
    stopped = invoke(*args)
    assert stopped.exit_code == 130, stopped.output
    with db.connect(str(dbfile))() as s:
        cells = {c.label: c for c in s.scalars(select(db.Cell))}
        assert {k: (c.status, len(c.samples)) for k, c in cells.items()} == {
            "ar": ("interrupted", 2),
            "stops": ("interrupted", 1),
            "linear": ("interrupted", 1),
        }
        ar_id, run_id = cells["ar"].id, cells["ar"].run_id
    shown = invoke("report", "--db", str(dbfile))
    assert "stops was interrupted after 1 measured prompts (0 after warmup)" in shown.stderr + shown.stdout
    sessions = db.connect(str(dbfile))
    for seconds, graphs in ((1.5, 3), (2.5, 4)):  # the first run's compile step, then a resumed run's
        commit_outcome(sessions, run_id, ar_id, Outcome("ar", rows=[], compile_s=seconds, compile_graphs=graphs))
    with sessions() as s:
        cell = s.get(db.Cell, ar_id)
        assert (cell.compile_s, cell.compile_graphs, cell.compile_runs) == (1.5, 3, [[1.5, 3], [2.5, 4]])
    monkeypatch.setenv("DTBENCH_INTERRUPT_AT", "0")
    resumed = invoke(*args, "--resume")
    assert resumed.exit_code == 0, resumed.output
    with sessions() as s:
        assert {c.status for c in s.scalars(select(db.Cell))} == {"done"}


SHOUTING = '''
import os
import sys
from dtbench.decoders.ar import Autoregressive


class Shouting(Autoregressive):
    """AR that prints 10^6 lines with terminal escape codes, then aborts its process."""

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate(self, input_ids, max_new_tokens):
        sys.stdout.write("\\x1b[31mshouting\\x1b]0;title\\x07 line\\n" * 1_000_000)
        sys.stdout.flush()
        os.abort()
        yield from super().generate(input_ids, max_new_tokens)
'''


def test_an_isolated_childs_output_goes_to_its_log_not_the_terminal(tiny, tmp_path, data_dir, monkeypatch):
    """Issue 50 item D: 10^6 printed lines with escape codes from a decoder measured in the child went straight to
    the terminal; now they go to the child's log, kept when the child crashes and named in the cell's error."""
    import re as _re
    import subprocess
    import sys
    from pathlib import Path

    from kit import install_plugin, suite_dict
    from sqlalchemy import select

    from dtbench.harness.store import db

    site = tmp_path / "site"
    install_plugin(monkeypatch, site, "dtbench-shouting", {"shouting": "dtbench_shouting:Shouting"}, SHOUTING)
    suite = suite_dict(*tiny, [{"name": "ar"}, {"name": "shouting"}], isolation="process")
    suite["datasets"][0].update(prompts=1, warmup=0)
    dbfile = tmp_path / "shout.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    dtbench = str(Path(sys.executable).with_name("dtbench"))
    args = ["run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"]
    result = subprocess.run([dtbench, *args], env=env, capture_output=True, text=True, timeout=300)
    terminal = result.stdout + result.stderr  # what a user's terminal shows
    assert result.returncode == 4, terminal[-3000:]
    assert "shouting\x1b" not in terminal and len(terminal) < 20_000, len(terminal)
    with db.connect(str(dbfile))() as s:
        error = s.scalars(select(db.Cell).where(db.Cell.label == "shouting")).one().error
    assert "died of SIGABRT" in error and "\x1b" not in error, error
    log = _re.search(r"; log (\S+\.log)", error)
    assert log is not None, error
    with open(log.group(1), "rb") as f:
        assert f.read(64).startswith(b"\x1b[31mshouting")
    os.unlink(log.group(1))
