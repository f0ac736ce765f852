"""One statistics layer (issue 18, item 2): on a sampled suite with greedy and sampled AR cells in one group, every
report pairs a cell with the AR cell that decodes the same way and gives the same speedup for it: the cell table
(summary), `--compare` (speedup_table), `--fail-if speedup:...` (the gate's cell value), `--cost-model` (measured
speedup), paper Table 1 and the HTML report."""

from __future__ import annotations

import math

import pytest
import reportdb

from dtbench.harness.store import db
from dtbench.reports import stats
from dtbench.reports.pricing import costmodel
from dtbench.reports.rendering.html import build_html
from dtbench.reports.views.compare import per_prompt, speedup_table
from dtbench.reports.views.paper import paper_tables
from dtbench.reports.views.summary import combined_summary, samples_frame, summarize

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

GREEDY, T07, T10 = None, {"temperature": 0.7}, {"temperature": 1.0}
# (label, decoder, sampling, throughputs: 1 warmup + 5 prompts); per-prompt values vary, so a mean of per-prompt
# ratios differs from the ratio of means, and the AR cells differ, so pairing with the wrong one shows.
CELLS = [
    ("AR (greedy)", "ar", GREEDY, [1.0, 10.0, 12.0, 8.0, 11.0, 9.0]),
    ("AR (T=0.7)", "ar", T07, [1.0, 8.0, 6.0, 9.0, 7.0, 10.0]),
    ("AR (T=1.0)", "ar", T10, [1.0, 5.0, 4.0, 6.0, 5.5, 4.5]),
    ("Linear (greedy)", "linear", GREEDY, [1.0, 21.0, 22.0, 19.0, 25.0, 18.0]),
    ("Linear (T=0.7)", "linear", T07, [1.0, 12.0, 10.0, 11.0, 13.0, 14.0]),
    ("Linear (T=1.0)", "linear", T10, [1.0, 6.0, 7.0, 5.0, 6.5, 5.5]),
]


def expected(label: str) -> float:
    by = {c[0]: c for c in CELLS}
    mine = by[label]
    ar = next(c for c in CELLS if c[1] == "ar" and c[2] == mine[2])
    return (sum(mine[3][1:]) / 5) / (sum(ar[3][1:]) / 5)


class NoCurves:
    """A calibration that prices nothing (the fixture's samples carry no per-forward records)."""

    batch, run_id = "0" * 32, 1

    def roles(self):
        return set()

    def cost(self, *a):
        return 1.0


@pytest.fixture()
def sampled(tmp_path):
    sessions = db.connect(str(tmp_path / "s.db"))
    with sessions() as s:
        run = reportdb.add_run(s, "sampling")
        for label, decoder, sampling, thr in CELLS:
            cell = reportdb.add_cell(
                s, run, label, decoder, sampling=sampling, params={"k": 4} if decoder != "ar" else {}
            )
            reportdb.add_samples(
                s,
                cell,
                thr,
                warmup=1,
                acceptance=0.5 if decoder != "ar" else None,
                path=2.0 if decoder != "ar" else None,
            )
        s.commit()
        rid = run.id
    return sessions, rid


def test_every_report_gives_the_same_speedup_for_the_same_cell(sampled):
    sessions, rid = sampled
    with sessions() as s:
        frame = samples_frame(s, rid)
        summary = summarize(frame)
        combined, runs = combined_summary(s, [rid])
        cost = costmodel.cost_table(s, runs[0], NoCurves())
    table = speedup_table(frame)
    rows = per_prompt(frame)
    tables, _ = paper_tables(combined)
    table1 = tables[0].data.set_index("method")
    html = build_html(combined, runs, {rid: table})
    for label, decoder, _, _ in CELLS:
        if decoder == "ar":
            continue
        want = expected(label)
        got = {
            "cell table": float(summary.set_index("label").loc[label, "speedup"]),
            "--compare": float(table.set_index("label").loc[label, "speedup"]),
            "--fail-if": stats.cell_value(rows[rows["label"] == label], "speedup"),
            "--cost-model": float(cost.set_index("label").loc[label, "measured_speedup"]),
            "Table 1": float(table1.loc[label, [c for c in table1.columns if c.endswith("speedup")][0]]),
        }
        for where, value in got.items():
            assert math.isclose(value, want, rel_tol=1e-12), (label, where, value, want)
        assert f"{want:.2f}×" in html, label
    # the old bug: T=0.7 linear divided by greedy AR (the group's first AR row) would be 12/10 = 1.2, not 12/8 = 1.5
    assert math.isclose(expected("Linear (T=0.7)"), 1.5) and not math.isclose(
        float(summary.set_index("label").loc["Linear (T=0.7)", "speedup"]), 1.2
    )


def test_the_baseline_pairs_by_run_group_and_decoding():
    import pandas as pd

    frame = pd.DataFrame(
        {
            "dataset": ["d"] * 4,
            "l_max": [1] * 4,
            "gen_length": [8] * 4,
            "decoder": ["ar", "ar", "x", "x"],
            "sampling": [None, T07, None, T10],
            "throughput_mean": [10.0, 8.0, 20.0, 30.0],
        }
    )
    base = stats.baseline_values(frame, "throughput_mean")
    assert base.iloc[:3].tolist() == [10.0, 8.0, 10.0] and math.isnan(base.iloc[3])  # T=1.0 has no AR: no speedup
    assert (
        stats.show(float("nan"), ".2f") == stats.MISSING == stats.show(None, ".2f")
        and stats.show(1.5, ".2f", "×") == "1.50×"
    )


def test_compare_and_resume_check_the_same_environment_keys():
    from dtbench.harness.store.runs import MUST_MATCH
    from dtbench.reports.views.compare import env_differences

    base = dict(reportdb.ENV, target={"model": "t"}, draft=None)
    for key in MUST_MATCH:
        other = dict(base, **{key: "something else"})
        assert [d for d in env_differences(base, other) if d.startswith(key + " ")], key
