"""The machine's load with every cell and repeats (issue 41 items 2 and 3).

The load is read by :func:`dtbench.harness.measurement.load.probe`; the runner tests inject its readings (a machine with three
busy loops beside the run, a quiet one), so their verdicts do not depend on what else this machine runs; one smoke
test reads the real machine."""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import time

import pytest
import yaml
from kit import invoke, suite_dict, tiny_pair, write_suite
from sqlalchemy import select

from dtbench.harness.errors import DtbenchError
from dtbench.harness.measurement import load
from dtbench.harness.store import db

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

BUSY_NOTE = "measured on a busy machine"


# --- the probe and the rule ------------------------------------------------------------------------------------


def test_the_probe_reads_sane_numbers_of_this_machine():
    start = load.probe()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # some CPU time of our own between the readings
        pass
    end = load.probe()
    assert start.cpus == end.cpus == (os.cpu_count() or 1) >= 1
    assert end.load_1m is not None and 0 <= end.load_1m < 100 * end.cpus
    assert end.own_cpu_s - start.own_cpu_s >= 0.25  # the spin above, counted as ours
    assert end.busy_cpu_s is not None and end.busy_cpu_s - start.busy_cpu_s >= 0.2
    assert end.own_load >= 0 and end.at_s > start.at_s
    assert end.cpu_mhz is None or 10 < end.cpu_mhz < 20_000
    part = load.span(start, end)
    assert part["capacity_cpu_s"] == pytest.approx((end.at_s - start.at_s) * end.cpus)
    assert 0 <= part["others_cpu_s"] <= part["capacity_cpu_s"]
    assert set(part) == set(load.COLUMNS)


def test_a_cells_load_keeps_its_start_and_sums_its_cpu_seconds():
    first = {"cpu_count": 2, "load_start": 0.5, "load_end": 0.7, "others_load_max": 0.2, "others_cpu_s": 1.0,
             "capacity_cpu_s": 10.0, "cpu_mhz_start": 2000.0, "cpu_mhz_end": 2100.0}  # fmt: skip
    second = {**first, "load_start": 3.0, "load_end": 4.0, "others_load_max": 2.5, "others_cpu_s": 5.0}
    cell = load.merge(load.merge(dict.fromkeys(load.COLUMNS), first), second)
    assert (cell["load_start"], cell["load_end"], cell["others_load_max"]) == (0.5, 4.0, 2.5)
    assert (cell["others_cpu_s"], cell["capacity_cpu_s"]) == (6.0, 20.0)
    assert load.others_share(cell) == pytest.approx(0.3)


@pytest.mark.parametrize(
    "row, busy",
    [
        ({"cpu_count": 2, "load_start": 2.0, "load_end": 2.1, "others_load_max": 0.3, "others_cpu_s": 0.5,
          "capacity_cpu_s": 20.0}, False),  # dtbench's own 2 threads: load 2, but not from others
        ({"cpu_count": 2, "load_start": 5.0, "load_end": 5.1, "others_load_max": 3.1, "others_cpu_s": 0.5,
          "capacity_cpu_s": 20.0}, True),  # load from others above half the cores
        ({"cpu_count": 2, "load_start": 1.0, "load_end": 1.0, "others_load_max": 0.5, "others_cpu_s": 3.0,
          "capacity_cpu_s": 20.0}, True),  # others took 15% of the CPU time
        (dict.fromkeys(load.COLUMNS), False),  # a cell stored before 0014
    ],
)  # fmt: skip
def test_the_busy_rule(row, busy):
    assert load.busy(row) is busy
    note = load.note({**row, "label": "linear"})
    assert (note is not None) is busy
    if busy:
        assert note.startswith(f"linear: {BUSY_NOTE}: 1-min load ") and "on 2 CPUs" in note


def test_require_quiet_waits_then_refuses_in_one_line():
    loads = iter([3.0, 2.5, 0.4])
    assert load.wait_quiet(1.0, 5.0, poll_s=0.01, loadavg=lambda: next(loads)) == 0.4
    with pytest.raises(DtbenchError, match=r"not quiet: 1-min load 3\.00 is not below 1 after waiting 0\.05 s"):
        load.wait_quiet(1.0, 0.05, poll_s=0.01, loadavg=lambda: 3.0)
    assert load.quiet_threshold("auto", cpus=4) == 2.0 and load.quiet_threshold("1.5") == 1.5
    with pytest.raises(DtbenchError, match="--require-quiet="):
        load.quiet_threshold("busy")


# --- runs ------------------------------------------------------------------------------------------------------


class FakeMachine:
    """Readings of a 2-CPU machine, 1 s apart: dtbench's own process keeps ``own`` cores busy; other processes add
    ``others`` cores of CPU and of load (three busy loops: others=3, capped by the 2 cores' capacity)."""

    def __init__(self, others: float, own: float = 1.0):
        self.others, self.own, self.clock = others, own, itertools.count()

    def __call__(self) -> load.Reading:
        t = float(next(self.clock))
        return load.Reading(
            at_s=t,
            cpus=2,
            load_1m=self.own + self.others,
            own_load=self.own,
            busy_cpu_s=t * min(2.0, self.own + self.others),
            own_cpu_s=t * self.own,
            cpu_mhz=2400.0,
        )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


def _suite(pair, repeats: int) -> dict:
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "linear", "params": {"k": 3}}], repeats=repeats)
    suite["datasets"][0].update(prompts=6, warmup=1)
    return suite


def _run(monkeypatch, tmp_path, data_dir, suite, dbfile, machine, *extra):
    monkeypatch.setattr(load, "probe", machine)
    return invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress",
        "--no-report", *extra,
    )  # fmt: skip


def test_repeats_interleave_and_report_medians_cvs_and_busy_cells(monkeypatch, pair, tmp_path, data_dir):
    dbfile = tmp_path / "r.db"
    suite = _suite(pair, repeats=3)
    busy = _run(monkeypatch, tmp_path, data_dir, suite, dbfile, FakeMachine(others=3.0))
    assert busy.exit_code == 0, busy.output
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2))  # --require-quiet finds it quiet at once
    quiet = _run(monkeypatch, tmp_path, data_dir, suite, dbfile, FakeMachine(others=0.0), "--require-quiet")
    assert quiet.exit_code == 0, quiet.output

    with db.connect(str(dbfile))() as s:
        samples = s.scalars(select(db.Sample).join(db.Cell).where(db.Cell.run_id == 1).order_by(db.Sample.id)).all()
        label = {c.id: c.label for c in s.scalars(select(db.Cell))}
        order = [(x.prompt_index, x.repeat, label[x.cell_id]) for x in samples]
        run2 = s.get(db.Run, 2)
        half = (os.cpu_count() or 1) / 2
        assert run2.environment["require_quiet"] == {"below": half, "load_1m": 0.2, "limit_s": 120.0}
        assert all(x.lossless is not False and x.lossless_checked for x in samples if label[x.cell_id] == "linear")
    # warmup prompt 0 once; every other prompt 3 times, each time ar then linear: never one decoder back to back
    assert order[:2] == [(0, 0, "ar"), (0, 0, "linear")]
    assert order[2:8] == [(1, r, d) for r in range(3) for d in ("ar", "linear")]
    assert len(order) == 2 * (1 + 5 * 3)

    report = json.loads(invoke("report", "--db", str(dbfile), "--run", "1", "--format", "json").stdout)
    cells = {c["label"]: c for c in report["cells"]}
    assert cells["linear"]["n"] == 5 and cells["linear"]["repeats"] == 3  # prompts, not samples
    assert cells["linear"]["throughput_median"] > 0 and cells["linear"]["throughput_cv"] >= 0
    assert cells["linear"]["busy"] is True and cells["linear"]["others_cpu_share"] == pytest.approx(0.5)
    assert cells["linear"]["load_start"] == 4.0 and cells["linear"]["cpu_count"] == 2
    for fmt in ("table", "markdown", "html", "json"):
        shown = invoke("report", "--db", str(dbfile), "--run", "1", "--format", fmt)
        text = " ".join(shown.stdout.split())  # the terminal wraps long notes
        assert shown.exit_code == 0 and f"linear: {BUSY_NOTE}: 1-min load 4.0 (3.0 from other processes)" in text, (
            fmt,
            shown.stdout,
        )
        assert "Median (t/s)" in shown.stdout or fmt in ("json", "table")
        quiet_report = invoke("report", "--db", str(dbfile), "--run", "2", "--format", fmt)
        assert quiet_report.exit_code == 0 and "busy machine" not in " ".join(quiet_report.stdout.split()), fmt
    rows = list(
        csv.DictReader(io.StringIO(invoke("report", "--db", str(dbfile), "--run", "1", "--format", "csv").stdout))
    )
    assert {r["busy"] for r in rows} == {"True"} and all(r["repeats"] == "3" for r in rows)

    speedups = json.loads(invoke("report", "--db", str(dbfile), "--run", "1", "--compare", "--format", "json").stdout)
    assert speedups["cells"][0]["n"] == 5  # pairs are prompts (their median over repeats), not 15 samples
    compared = invoke("report", "--db", str(dbfile), "--compare", "1", "2", "--format", "markdown")
    assert compared.exit_code == 0, compared.output
    assert "the two runs' machine load differs (run 1: 1-min load 4.0" in compared.stdout
    with db.connect(str(dbfile))() as s:
        cells = [{c: getattr(cell, c) for c in load.COLUMNS} for cell in s.get(db.Run, 2).cells]
    assert load.loads_differ(load.run_load(cells), load.run_load(cells), ("run 2", "run 2")) is None


def test_require_quiet_refuses_a_busy_machine_before_anything_runs(monkeypatch, pair, tmp_path, data_dir):
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 7.0, 6.0))
    dbfile = tmp_path / "r.db"
    result = _run(
        monkeypatch, tmp_path, data_dir, _suite(pair, 1), dbfile, FakeMachine(0.0), "--require-quiet=2",
        "--quiet-timeout", "0.2",
    )  # fmt: skip
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("error")]
    assert errors == [
        f"error: the machine is not quiet: 1-min load 7.50 is not below 2 after waiting 0.2 s ({os.cpu_count()} "
        "CPUs); nothing was run"
    ], result.output
    with db.connect(str(dbfile))() as s:
        assert s.scalars(select(db.Run)).all() == []


def test_repeats_must_be_a_positive_count(tmp_path):
    from kit import one_line_error

    for bad in (0, "3", 1000):
        path = write_suite(tmp_path, suite_dict(tmp_path, tmp_path, [{"name": "ar"}], repeats=bad))
        result = invoke("validate", path)
        assert result.exit_code == 2 and "repeats" in one_line_error(result), result.output


def test_a_cells_throughput_counts_a_prompts_repeats_once_as_their_median():
    from dtbench.reports.stats import cell_throughput

    rows = [
        {"cell_id": 1, "prompt_index": 0, "repeat": r, "warmup": False, "throughput": v}
        for r, v in enumerate([10.0, 12.0, 30.0])
    ] + [{"cell_id": 1, "prompt_index": 1, "repeat": 0, "warmup": False, "throughput": 20.0}]
    assert cell_throughput(rows) == pytest.approx((12.0 + 20.0) / 2)
    assert cell_throughput([{"warmup": False, "throughput": v} for v in (1.0, 3.0)]) == 2.0  # no prompt columns


def test_min_groups_repeats_the_groups_of_points_with_few(tmp_path):
    """min_groups: 4 over 9 prompts (1 warmup): B = 1 has 8 groups (measured once), B = 4 two (twice each), B = 8 one
    (4 times), each repeat of a group with every decoder, back to back per group; warmup groups once; the larger of
    ``repeats`` and the raised count wins."""
    from collections import Counter

    from dtbench.harness.suites.plan import plan_suite
    from dtbench.harness.suites.suitefile import parse_suite

    def groups(**extra):
        suite = suite_dict(tmp_path, tmp_path, [{"name": "ar"}], batch_sizes=[1, 4, 8], **extra)
        suite["datasets"][0]["prompts"] = 9
        return plan_suite(parse_suite(yaml.safe_dump(suite))).groups()

    got = groups(min_groups=4)
    counts = Counter((g.batch_size, g.prompt_index, g.warmup) for g in got)
    assert {k: v for k, v in counts.items() if k[2]} == {(1, 0, True): 1, (4, 0, True): 1, (8, 0, True): 1}
    assert {k[:2]: v for k, v in counts.items() if not k[2]} == {
        **{(1, i): 1 for i in range(1, 9)},
        (4, 1): 2,
        (4, 5): 2,
        (8, 1): 4,
    }
    at8 = [g for g in got if g.batch_size == 8 and not g.warmup]
    assert [g.repeat for g in at8] == [0, 1, 2, 3] and {g.repeats for g in at8} == {4}
    assert [(g.prompt_index, g.repeat) for g in got if g.batch_size == 4 and not g.warmup] == [
        (1, 0), (1, 1), (5, 0), (5, 1)
    ]  # fmt: skip
    assert Counter(g.batch_size for g in groups(min_groups=4, repeats=3) if not g.warmup) == {1: 24, 4: 6, 8: 4}
    assert all(g.repeats == 1 for g in groups())  # not set: every group once
