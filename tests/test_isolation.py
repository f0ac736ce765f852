"""Crash isolation (issue 38 item 1): with `isolation: process` a native crash fails only the cell it hit.

A plugin decoder that calls os.abort() (SIGABRT, as a segfault in a CUDA kernel would kill the process) between
`ar` and `linear` in one suite: `ar` and `linear` are done, the plugin's cell failed naming the signal with the
faulthandler's trace, nothing but the runner's lines on the terminal, a non-zero exit, and `dtbench report` works.
"""

from __future__ import annotations

import json
import signal

import pytest
from kit import install_plugin, invoke, suite_dict, tiny_pair, write_suite
from sqlalchemy import select

from dtbench.harness.execution.isolation import isolation_of
from dtbench.harness.execution.proctree import signal_name
from dtbench.harness.store import db
from dtbench.harness.suites.suite import Suite

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

ABORTING = '''
import os
from dtbench.decoders.ar import Autoregressive


class Aborting(Autoregressive):
    """AR that aborts the process (SIGABRT) on every prompt after the first."""

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate(self, input_ids, max_new_tokens):
        marker = os.environ["DTBENCH_ABORT_MARK"]
        if os.path.exists(marker):
            os.abort()
        open(marker, "w").close()
        yield from super().generate(input_ids, max_new_tokens)
'''


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_signal_names_and_the_default_isolation():
    assert signal_name(-signal.SIGSEGV) == "SIGSEGV" and signal_name(-signal.SIGABRT) == "SIGABRT"
    assert signal_name(3) == "exit code 3" and signal_name(None) == "unknown"
    suite = Suite.model_validate(
        {"name": "s", "datasets": [{"name": "wikitext-2"}], "generation_lengths": [4], "decoders": [{"name": "ar"}]}
    )
    assert isolation_of(suite, "cuda") == "process" and isolation_of(suite, "cpu") == "process"  # issue 50 item B
    assert isolation_of(suite.model_copy(update={"isolation": "none"}), "cpu") == "none"
    forced = suite.model_copy(update={"isolation": "process"})
    assert isolation_of(forced, "cpu") == "process"


def test_an_aborting_plugin_fails_its_own_cell_and_the_run_goes_on(monkeypatch, pair, tmp_path, data_dir):
    install_plugin(
        monkeypatch, tmp_path / "site", "dtbench-aborting", {"aborting": "dtbench_aborting:Aborting"}, ABORTING
    )
    monkeypatch.setenv("DTBENCH_ABORT_MARK", str(tmp_path / "aborted-once"))
    decoders = [{"name": "ar"}, {"name": "aborting"}, {"name": "linear", "params": {"k": 2}}]
    suite = suite_dict(*pair, decoders, isolation="process")
    suite["datasets"][0].update(prompts=3, warmup=1)
    dbfile = tmp_path / "iso.db"
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    assert result.exit_code == 4, result.output  # a cell failed
    assert "Traceback (most recent call last)" not in result.output  # the child's stderr went to its trace file
    assert "crashed: the measuring process died of SIGABRT" in result.output  # the failed cell's note says why
    with db.connect(str(dbfile))() as s:
        cells = {c.label: c for c in s.scalars(select(db.Cell))}
        run = s.scalars(select(db.Run)).one()
        assert run.status == "completed"
        assert run.environment["executor"]["isolation"] == "process"
        assert cells["ar"].status == "done" and len(cells["ar"].samples) == 3
        assert cells["linear"].status == "done" and len(cells["linear"].samples) == 3
        bad = cells["aborting"]
        assert bad.status == "failed" and len(bad.samples) == 1  # the first prompt was measured before the crash
        assert "crashed: the measuring process died of SIGABRT" in bad.error
        assert "faulthandler:" in bad.error and "generate" in bad.error  # the trace names where it died
        assert all(x.lossless for x in cells["linear"].samples)
    shown = invoke("report", "--db", str(dbfile), "--format", "json")
    assert shown.exit_code == 0, shown.output
    labels = {c["label"]: c for c in json.loads(shown.stdout)["cells"]}
    assert labels["aborting"]["status"] == "failed" and labels["linear"]["status"] == "done"


def test_isolated_samples_equal_in_process_ones(pair, tmp_path, data_dir):
    """The child measures exactly what the in-process worker measures: the same tokens, the same counters."""
    decoders = [{"name": "ar"}, {"name": "dynatree", "params": {"n_max": 8}}]
    out = {}
    for mode in ("none", "process"):
        suite = suite_dict(*pair, decoders, isolation=mode)
        dbfile = tmp_path / f"{mode}.db"
        result = invoke(
            "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
        )
        assert result.exit_code == 0, result.output
        with db.connect(str(dbfile))() as s:
            out[mode] = {
                (c.label, x.prompt_index): (x.output_tokens, x.iterations, x.drafted, x.accepted, x.target_forwards)
                for c in s.scalars(select(db.Cell))
                for x in c.samples
            }
    assert out["process"] == out["none"] and len(out["none"]) == 4


ORDER = [  # the decoder order that crashed on the H200 (issue 38 item 2): other decoders, then hf_assisted
    {"name": "ar"},
    {"name": "linear", "params": {"k": 2}},
    {"name": "dynatree", "params": {"n_max": 8}},
    {"name": "hf_assisted", "params": {"num_assistant_tokens": 3}},
]


def _samples(dbfile) -> dict[str, list]:
    with db.connect(str(dbfile))() as s:
        return {
            c.label: [(c.status, x.prompt_index, x.output_tokens, x.lossless) for x in c.samples]
            for c in s.scalars(select(db.Cell))
        }


def test_hf_assisted_after_other_decoders_in_one_process_is_lossless(pair, tmp_path, data_dir):
    """ar, linear, dynatree, then hf_assisted in ONE process (isolation: none): hf_assisted's rows equal ar's. On the
    H200 this order segfaulted; on a CPU it must run and stay lossless (the CUDA crash itself is not reproducible
    here)."""
    dbfile = tmp_path / "order.db"
    suite = suite_dict(*pair, ORDER, isolation="none")
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    assert result.exit_code == 0, result.output
    got = _samples(dbfile)
    assert len(got["hf_assisted"]) == 2 and all(x[0] == "done" and x[3] is True for x in got["hf_assisted"])
    assert [x[2] for x in got["hf_assisted"]] == [x[2] for x in got["ar"]]


def test_own_process_decoders_run_in_a_child_of_their_own(monkeypatch, pair, tmp_path, data_dir):
    """Under isolation: process, a decoder whose ``own_process`` names the device is measured in a separate child
    (forced on the CPU here; no built-in sets it since issue 47: hf_assisted and hf_generate share the measuring
    process again on every device), with the same samples as in one process and ar's tokens as its reference."""
    from dtbench.decoders.hf_assisted import HFAssisted, HFGenerate

    assert HFAssisted.own_process == () and HFGenerate.own_process == ()
    monkeypatch.setattr(HFAssisted, "own_process", ("cpu",))  # the parent decides; the children just measure
    dbfile = tmp_path / "own.db"
    suite = suite_dict(*pair, ORDER, isolation="process")
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    assert result.exit_code == 0, result.output
    with db.connect(str(dbfile))() as s:
        executor = s.scalars(select(db.Run)).one().environment["executor"]
    assert executor["isolation"] == "process" and executor["own_process"] == ["hf_assisted"]
    got = _samples(dbfile)
    assert all(x[0] == "done" and x[3] is True for x in got["hf_assisted"]) and len(got["hf_assisted"]) == 2
    assert [x[2] for x in got["hf_assisted"]] == [x[2] for x in got["ar"]]
    assert len(got["linear"]) == len(got["dynatree"]) == 2


# --- issue 50: a decoder's code never outlives its deadline or its cell ------------------------------------------

SLEEPING = '''
import os
import time
from dtbench.decoders.ar import Autoregressive


class Sleeping(Autoregressive):
    """AR blocked in one native call (time.sleep) for DTBENCH_SLEEP_S seconds: the async exception of the deadline
    cannot interrupt it."""

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate(self, input_ids, max_new_tokens):
        time.sleep(float(os.environ["DTBENCH_SLEEP_S"]))
        yield from super().generate(input_ids, max_new_tokens)
'''


def test_a_decoder_blocked_in_native_code_is_killed_at_its_deadline(monkeypatch, pair, tmp_path, data_dir):
    """Issue 50 item A(b): under isolation: process the parent kills the child (and its process group) once the
    cell's timeout_s and a grace margin have passed, fails the cell in one line and goes on with the next decoder
    (before the fix the run waited the whole 150 s sleep)."""
    import time

    install_plugin(
        monkeypatch, tmp_path / "site", "dtbench-sleeping", {"sleeping": "dtbench_sleeping:Sleeping"}, SLEEPING
    )
    monkeypatch.setenv("DTBENCH_SLEEP_S", "150")
    decoders = [{"name": "ar"}, {"name": "sleeping"}, {"name": "linear", "params": {"k": 2}}]
    suite = suite_dict(*pair, decoders, isolation="process", timeout_s=5)
    suite["datasets"][0].update(prompts=1, warmup=0)
    dbfile = tmp_path / "sleep.db"
    t0 = time.monotonic()
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    took = time.monotonic() - t0
    assert result.exit_code == 4, result.output
    assert took < 90, took
    assert "timed out after 5 s and did not stop (blocked outside Python)" in result.output
    with db.connect(str(dbfile))() as s:
        cells = {c.label: c for c in s.scalars(select(db.Cell))}
        assert cells["sleeping"].status == "failed" and "process group were killed" in cells["sleeping"].error
        assert cells["linear"].status == "done" and len(cells["linear"].samples) == 1


SPAWNING = '''
import os
import subprocess
from dtbench.decoders.ar import Autoregressive


class Spawning(Autoregressive):
    """AR that leaves processes behind: a child, a child in a session of its own, and an orphan (double fork)."""

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate(self, input_ids, max_new_tokens):
        tag = os.environ["DTBENCH_SPAWN_TAG"]
        subprocess.Popen(["sleep", tag + "1"])
        subprocess.Popen(["sleep", tag + "2"], start_new_session=True)
        subprocess.Popen(["sh", "-c", "sleep " + tag + "3 &"], start_new_session=True).wait()
        yield from super().generate(input_ids, max_new_tokens)
'''


def _sleepers(tag: str) -> list:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if len(cmd) == 2 and cmd[0] == "sleep" and cmd[1].startswith(tag) and p.info["status"] != "zombie":
            out.append(p)
    return out


def test_a_decoders_child_processes_end_with_its_cell(monkeypatch, pair, tmp_path, data_dir):
    """Issue 50 item C: children a decoder starts (plain, start_new_session, double-forked) do not outlive its
    cell under isolation: process (before the fix all three were still alive after the run)."""
    import os

    import psutil

    tag = f"1000.{os.getpid()}"
    install_plugin(
        monkeypatch, tmp_path / "site", "dtbench-spawning", {"spawning": "dtbench_spawning:Spawning"}, SPAWNING
    )
    monkeypatch.setenv("DTBENCH_SPAWN_TAG", tag)
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "spawning"}], isolation="process")
    suite["datasets"][0].update(prompts=1, warmup=0)
    dbfile = tmp_path / "spawn.db"
    try:
        result = invoke(
            "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
        )
        assert result.exit_code == 0, result.output
        left = _sleepers(tag)
        assert left == [], [p.cmdline() for p in left]
    finally:
        for p in _sleepers(tag):
            p.kill()
        psutil.wait_procs(_sleepers(tag), timeout=5)
