"""Run-to-run comparison: marks on constructed before/after data, the Mann-Whitney test, the --fail-if gate."""

from __future__ import annotations

import json

import pytest
import reportdb
from click.testing import CliRunner
from scipy import stats

from dtbench.cli.main import cli
from dtbench.harness.errors import DtbenchError
from dtbench.reports.views.compare import Gate, compare_runs, mann_whitney
from dtbench.reports.views.summary import samples_frame

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

BASE = [100.0, 101.0, 99.0, 100.5, 99.5, 100.2, 99.8, 100.1]
FASTER = [v * 1.2 for v in BASE]
SLOWER = [v * 0.9 for v in BASE]
NOISY = [100.3, 99.2, 101.1, 99.9, 100.4, 99.6, 100.0, 100.6]  # same distribution as BASE


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture()
def two_runs(tmp_path):
    """Run 1 (before) and run 2 (after) with one cell per mark; each cell has a warmup sample of 1 t/s."""
    path = tmp_path / "c.db"
    sessions = reportdb.connect(path)
    spec = {  # label: (before throughputs, after throughputs, after-cell overrides)
        "AR": (BASE, BASE, {}),
        "faster": (BASE, FASTER, {}),
        "slower": (BASE, SLOWER, {}),
        "same": (BASE, NOISY, {}),
        "params": (BASE, FASTER, {"params": {"k": 9}}),
        "version": (BASE, BASE, {"version": "2"}),
        "breaks": (BASE, None, {"status": "failed", "error": "RuntimeError: boom"}),
    }
    with sessions() as s:
        before, after = reportdb.add_run(s, "b"), reportdb.add_run(s, "a")
        for label, (b, a, over) in spec.items():
            dec = "ar" if label == "AR" else "linear"
            cb = reportdb.add_cell(s, before, label, dec, params={"k": 4} if dec == "linear" else {})
            reportdb.add_samples(s, cb, [1.0] + b, warmup=1)
            ca = reportdb.add_cell(
                s,
                after,
                label,
                dec,
                params=over.get("params", cb.params),
                version=over.get("version", "1"),
                status=over.get("status", "done"),
                error=over.get("error"),
            )
            if a is not None:
                reportdb.add_samples(s, ca, [1.0] + a, warmup=1)
        reportdb.add_samples(s, reportdb.add_cell(s, before, "gone", "linear"), [1.0] + BASE, warmup=1)
        # another decoder's cell: a new cell, never paired with "gone" (same decoder and params would be)
        reportdb.add_samples(s, reportdb.add_cell(s, after, "added", "ngram"), [1.0] + BASE, warmup=1)
        s.commit()
    return path, sessions


def marks(sessions, gates=(), env_after=None, alpha=0.05):
    with sessions() as s:
        fb, fa = samples_frame(s, 1), samples_frame(s, 2)
    table, failures = compare_runs(
        fb, fa, before_env=reportdb.ENV, after_env=env_after or reportdb.ENV, alpha=alpha, gates=list(gates)
    )
    return table.set_index("label"), failures


def test_marks(two_runs):
    _, sessions = two_runs
    t, failures = marks(sessions)
    assert t["mark"].to_dict() == {
        "AR": "not significant",
        "faster": "better",
        "slower": "worse",
        "same": "not significant",
        "params": "not comparable",
        "version": "not comparable",
        "breaks": "newly failing",
        "gone": "missing",
        "added": "new",
    }
    assert "k 4 → 9" in t.loc["params", "note"] and "decoder version 1 → 2" in t.loc["version", "note"]
    assert "boom" in t.loc["breaks", "note"]
    assert t.loc["faster", "ratio"] == pytest.approx(1.2)  # warmup samples (1 t/s) excluded
    assert t.loc["faster", "before"] == pytest.approx(sum(BASE) / len(BASE))
    assert failures == []


def test_p_value_is_scipys_mann_whitney_on_per_prompt_throughputs(two_runs):
    _, sessions = two_runs
    t, _ = marks(sessions)
    assert t.loc["same", "p_value"] == pytest.approx(stats.mannwhitneyu(NOISY, BASE, alternative="two-sided").pvalue)
    assert t.loc["slower", "p_value"] < 0.001


def test_environment_change_makes_every_cell_not_comparable(two_runs):
    _, sessions = two_runs
    t, _ = marks(sessions, env_after={**reportdb.ENV, "torch": "2.14.0"})
    assert t.loc["faster", "mark"] == "not comparable" and "torch 2.13.0+cpu → 2.14.0" in t.loc["faster", "note"]
    assert t.loc["breaks", "mark"] == "newly failing"  # a failure is reported whatever else changed


def test_gate_trips_only_on_significant_change_beyond_threshold(two_runs):
    _, sessions = two_runs
    _, f = marks(sessions, [Gate.parse("throughput:-5%")])
    tripped = sorted(line.split(" ")[4] for line in f)
    assert tripped == ["breaks", "slower"]  # -10% and significant; the newly failing cell
    _, f = marks(sessions, [Gate.parse("throughput:-15%")])
    assert [line for line in f if "slower" in line] == []  # -10% is within 15%
    _, f = marks(sessions, [Gate.parse("throughput:+5%")])
    assert any(" faster " in line for line in f)  # an explicit sign picks the direction
    # TPOT rises when throughput drops: no sign means the metric's bad direction (up for a time).
    _, f = marks(sessions, [Gate.parse("tpot_ms:5%")])
    assert any(" slower " in line for line in f) and not any(" faster " in line for line in f)


def test_gate_ignores_a_large_change_that_is_not_significant(two_runs):
    _, sessions = two_runs
    _, f = marks(sessions, [Gate.parse("throughput:-5%")], alpha=1e-9)
    assert [line for line in f if "slower" in line] == []


def test_gate_parse():
    g = Gate.parse("ttft:+2")
    assert g.metric.name == "ttft_ms" and not g.relative and g.bad_is_increase and g.amount == 2
    assert g.beyond(10, 12.5) and not g.beyond(10, 11.5) and not g.beyond(10, 5)
    assert Gate.parse("throughput:5%").bad_is_increase is False
    for bad in ("throughput", "speed:-5%", "throughput:-five%", "throughput:--5%"):
        with pytest.raises(DtbenchError):
            Gate.parse(bad)


def test_mann_whitney_edges():
    assert mann_whitney([1.0, 1.0], [1.0, 1.0]) == 1.0
    assert mann_whitney([], [1.0]) != mann_whitney([], [1.0])  # NaN


def test_cli_compare_exit_codes_and_only_changed(two_runs):
    path, _ = two_runs
    ok = invoke("report", "--db", path, "--compare", "1", "2", "--format", "json")
    assert ok.exit_code == 0, ok.output
    cells = {c["label"]: c["mark"] for c in json.loads(ok.stdout)["cells"]}
    assert cells["slower"] == "worse"
    gated = invoke("report", "--db", path, "--compare", "1", "latest", "--fail-if", "throughput:-5%", "--format", "csv")
    assert gated.exit_code == 1
    assert "gate tripped: throughput:-5%: wikitext-2 L_max=128 T=64 slower" in gated.stderr
    passed = invoke(
        "report",
        "--db",
        path,
        "--compare",
        "1",
        "2",
        "--fail-if",
        "throughput:-50%",
        "--fail-if",
        "ttft_ms:+50%",
        "--only-changed",
        "--format",
        "markdown",
    )
    assert passed.exit_code == 1  # the newly failing cell trips any gate
    changed = invoke("report", "--db", path, "--compare", "1", "2", "--only-changed", "--format", "csv")
    labels = [line.split(",")[3] for line in changed.stdout.splitlines()[1:]]
    assert "same" not in labels and "AR" not in labels and "slower" in labels and "added" in labels
    table = invoke("report", "--db", path, "--compare", "1", "2")
    assert "better" in table.stdout and "newly failing" in table.stdout and "9 cells" in table.stderr


def test_cli_compare_bad_input(two_runs):
    path, _ = two_runs
    for args, needle in [
        (["--compare", "1", "1"], "two different runs"),
        (["--compare", "1", "x"], "integer or 'latest'"),
        (["--compare", "1", "2", "--fail-if", "nope:-5%"], "METRIC:THRESHOLD"),
        (["--compare", "1", "9"], "no run 9"),
    ]:
        res = invoke("report", "--db", path, *args)
        assert res.exit_code == 2, (args, res.output)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (args, res.stderr)


def test_cells_renamed_between_runs_are_paired_by_decoder_and_params(tmp_path):
    """issue 67: the same decoder and params under another label is the same cell, said so in the note; two
    candidates on one side stay unpaired (missing / new)."""
    sessions = reportdb.connect(tmp_path / "r.db")
    with sessions() as s:
        before, after = reportdb.add_run(s, "b"), reportdb.add_run(s, "a")
        for run, label, values in ((before, "lin4", BASE), (after, "linear-k4", FASTER)):
            reportdb.add_samples(
                s, reportdb.add_cell(s, run, label, "linear", params={"k": 4}), [1.0] + values, warmup=1
            )
        for run, labels in ((before, ["a1", "a2"]), (after, ["b1"])):  # ambiguous: two before, one after
            for label in labels:
                reportdb.add_samples(s, reportdb.add_cell(s, run, label, "ngram"), [1.0] + BASE, warmup=1)
        s.commit()
    t, _ = marks(sessions)
    assert t.loc["lin4 → linear-k4", "mark"] == "better"
    assert (
        "paired by decoder and params (labelled 'lin4' before, 'linear-k4' after)" in t.loc["lin4 → linear-k4", "note"]
    )
    assert "lin4" not in t.index and "linear-k4" not in t.index  # no "missing" and "new" rows for it
    assert {t.loc["a1", "mark"], t.loc["a2", "mark"], t.loc["b1", "mark"]} == {"missing", "new"}
