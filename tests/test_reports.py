"""Reports against numbers computed here from known samples: summaries, speedup CIs, paper tables, figures, HTML.

Databases are built directly with the SQLAlchemy models (tests/reportdb.py), so no model runs and every expected
value is computed independently with numpy from the throughputs written.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import reportdb
from click.testing import CliRunner

from dtbench.cli.main import cli
from dtbench.reports.views import compare, figures, paper
from dtbench.reports.views.summary import base_label, combined_summary, samples_frame, summarize

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)


def invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


# --- a small two-dataset run with hand-picked numbers -------------------------------------------------------

AR_WIKI = [50.0, 10.0, 11.0, 9.0, 10.5, 10.2]  # first is warmup; 5 prompts after it (compare.MIN_PROMPTS)
LIN_WIKI = [80.0, 16.0, 18.5, 17.0, 15.5, 16.4]
AR_PG = [40.0, 8.0, 8.5, 7.5, 8.0, 8.2]
LIN_PG = [70.0, 11.0, 12.0, 10.0, 13.0, 11.6]
DT_WIKI = [90.0, 21.0, 22.0, 20.5, 23.0, 21.8]
DT_PG = [90.0, 12.0, 14.0, 13.0, 12.5, 13.1]
FT_WIKI = [90.0, 19.0, 19.5, 18.0, 18.5, 19.2]


@pytest.fixture()
def small_db(tmp_path):
    """Run 1: AR, Linear Spec (K=8 wiki / K=5 pg19), DynaTree on both datasets; a wiki-only fixed tree."""
    path = tmp_path / "r.db"
    sessions = reportdb.connect(path)
    decs = [
        {"name": "ar", "label": "AR"},
        {"name": "linear", "label": "Linear Spec (K=8)", "params": {"k": 8}, "datasets": ["wikitext-2"]},
        {"name": "linear", "label": "Linear Spec (K=5)", "params": {"k": 5}, "datasets": ["pg19"]},
        {"name": "fixed_tree", "label": "Fixed Tree (D=5, B=2)", "datasets": ["wikitext-2"]},
        {"name": "dynatree", "label": "DynaTree"},
    ]
    with sessions() as s:
        run = reportdb.add_run(s, "small", text=reportdb.suite_text("small", decs, datasets=("wikitext-2", "pg19")))
        for ds, label, dec, thr, mib in [
            ("wikitext-2", "AR", "ar", AR_WIKI, 1000),
            ("wikitext-2", "Linear Spec (K=8)", "linear", LIN_WIKI, 1100),
            ("wikitext-2", "Fixed Tree (D=5, B=2)", "fixed_tree", FT_WIKI, 1150),
            ("wikitext-2", "DynaTree", "dynatree", DT_WIKI, 1200),
            ("pg19", "AR", "ar", AR_PG, 2000),
            ("pg19", "Linear Spec (K=5)", "linear", LIN_PG, 2100),
            ("pg19", "DynaTree", "dynatree", DT_PG, 2300),
        ]:
            cell = reportdb.add_cell(s, run, label, dec, dataset=ds)
            reportdb.add_samples(
                s,
                cell,
                thr,
                warmup=1,
                rss_mib=mib,
                acceptance=None if dec == "ar" else 0.8,
                path=None if dec == "ar" else 3.0,
            )
        s.commit()
    return path, sessions


def kept(values):
    return np.array(values[1:])


def test_summary_mean_std_speedup_exclude_warmup(small_db):
    _, sessions = small_db
    with sessions() as s:
        table = summarize(samples_frame(s, 1)).set_index(["dataset", "label"])
    row = table.loc[("wikitext-2", "DynaTree")]
    assert row["n"] == 5 and row["warmup_n"] == 1
    assert row["throughput_mean"] == pytest.approx(kept(DT_WIKI).mean())
    assert row["throughput_std"] == pytest.approx(kept(DT_WIKI).std(ddof=1))
    assert row["speedup"] == pytest.approx(kept(DT_WIKI).mean() / kept(AR_WIKI).mean())
    # TPOT from the stored rows: (total - TTFT) / (T - 1), total = T / throughput.
    T = 64
    tpot = (T / kept(DT_WIKI) - 0.02) / (T - 1) * 1e3
    assert row["tpot_ms_mean"] == pytest.approx(tpot.mean())
    assert row["peak_mib"] == pytest.approx(1200)


def test_speedup_ci_paired_and_verdicts(small_db):
    _, sessions = small_db
    with sessions() as s:
        table = compare.speedup_table(samples_frame(s, 1)).set_index(["dataset", "label"])
    row = table.loc[("wikitext-2", "DynaTree")]
    expected = kept(DT_WIKI).mean() / kept(AR_WIKI).mean()
    assert row["speedup"] == pytest.approx(expected)
    ratios = kept(DT_WIKI) / kept(AR_WIKI)  # same prompt_index, both after warmup
    assert row["n"] == 5 and row["paired_speedup"] == pytest.approx(np.exp(np.log(ratios).mean()))
    assert row["ci_low"] <= row["paired_speedup"] <= row["ci_high"]
    assert row["ci_method"] == "paired t (log ratios)"
    assert row["verdict"] == "faster" and row["ci_low"] > 1
    assert ("wikitext-2", "AR") not in table.index


def test_paired_ratio_ci_degenerate_when_every_prompt_has_the_same_ratio():
    point, low, high, method = compare.paired_ratio_ci([2.0] * 6)
    assert (point, low, high, method) == (pytest.approx(2.0), pytest.approx(2.0), pytest.approx(2.0), "degenerate")


def test_paired_ratio_ci_is_the_t_interval_of_the_log_ratios():
    """Independent check: exp(mean ± t_{n-1, 0.975} · sd / √n) of the log ratios, t from scipy's own ttest."""
    from scipy import stats

    rng = np.random.default_rng(7)
    ratios = np.exp(rng.normal(np.log(1.4), 0.1, 8))
    point, low, high, method = compare.paired_ratio_ci(ratios, 0.95)
    ci = stats.ttest_1samp(np.log(ratios), 0.0).confidence_interval(0.95)
    assert (low, high) == (pytest.approx(math.exp(ci.low)), pytest.approx(math.exp(ci.high)))
    assert point == pytest.approx(math.exp(np.log(ratios).mean())) and method == "paired t (log ratios)"


def test_paired_ratio_ci_covers_at_its_nominal_level_with_few_prompts():
    """At n = MIN_PROMPTS the 95% interval covers the true geometric-mean speedup about 95% of the time (a
    bootstrap interval covers about 85% there, which is why it is not used)."""
    rng = np.random.default_rng(3)
    n, trials, true = compare.MIN_PROMPTS, 2000, 1.3
    hits = 0
    for _ in range(trials):
        _, low, high, _ = compare.paired_ratio_ci(np.exp(rng.normal(math.log(true), 0.15, n)))
        hits += low <= true <= high
    assert 0.93 <= hits / trials <= 0.97


def test_base_label():
    assert base_label("Linear Spec (K=8)") == "Linear Spec" and base_label("AR") == "AR"


# --- paper tables --------------------------------------------------------------------------------------------


def tables_of(sessions, run_ids=(1,)):
    with sessions() as s:
        summary, _ = combined_summary(s, list(run_ids))
    made, skipped = paper.paper_tables(summary)
    return {t.key: t for t in made}, skipped


def test_table1_merges_linear_rows_and_keeps_methods_on_every_dataset(small_db):
    _, sessions = small_db
    t, _ = tables_of(sessions)
    t1 = t["table1_main"]
    assert list(t1.display["Method"]) == ["AR", "Linear Spec", "DynaTree"]  # the wiki-only fixed tree is not in Table 1
    lin = t1.display.set_index("Method").loc["Linear Spec"]
    m, sd = kept(LIN_WIKI).mean(), kept(LIN_WIKI).std(ddof=1)
    assert lin["wikitext-2 Throughput (t/s)"] == f"{m:.1f} ± {sd:.1f}"
    assert lin["pg19 Speedup"] == f"{kept(LIN_PG).mean() / kept(AR_PG).mean():.2f}×"
    assert any("Linear Spec (K=8) on wikitext-2" in n and "Linear Spec (K=5) on pg19" in n for n in t1.notes)
    data = t1.data.set_index("method")
    assert data.loc["DynaTree", "pg19.speedup"] == pytest.approx(kept(DT_PG).mean() / kept(AR_PG).mean())


def test_table3_ar_dashes_and_table5_memory(small_db):
    _, sessions = small_db
    t, _ = tables_of(sessions)
    ar = t["table3_efficiency"].display.set_index("Method").loc["AR"]
    assert ar["wikitext-2 Accept.ᵃ"] == "—" and ar["wikitext-2 ℓ̄ᵇ"] == "—" and ar["wikitext-2 L̄"] == "1.00"
    assert t["table3_efficiency"].display.set_index("Method").loc["DynaTree", "pg19 Accept.ᵃ"] == "80.0%"
    assert "including* the bonus token" in t["table3_efficiency"].caption
    mem = t["table5_memory"].data.set_index("method")
    assert mem.loc["AR", "average_mib"] == pytest.approx(1500)
    assert mem.loc["DynaTree", "average_mib"] == pytest.approx(1750)
    assert mem.loc["DynaTree", "rel_change_pct"] == pytest.approx(100 * 250 / 1500)
    assert t["table5_memory"].display.set_index("Method").loc["DynaTree", "Rel. change"] == "+16.67%"


def test_table4_ablation_delta_vs_first_tree_variant(small_db):
    _, sessions = small_db
    t, _ = tables_of(sessions)
    t4 = t["table4_ablation"].data.set_index("variant")
    assert list(t4.index) == ["Fixed Tree (D=5, B=2)", "DynaTree"]
    delta = 100 * (kept(DT_WIKI).mean() - kept(FT_WIKI).mean()) / kept(FT_WIKI).mean()
    assert t4.loc["DynaTree", "delta_pct"] == pytest.approx(delta)
    assert t4.loc["Fixed Tree (D=5, B=2)", "delta_pct"] == 0


def test_main_setting_prefers_most_cells_then_largest():
    import pandas as pd

    rows = [
        dict(dataset="w", l_max=c, gen_length=T, label=label, sweep=False)
        for c, T, label in [
            (800, 1500, "a"),
            (800, 1500, "b"),
            (100, 1500, "a"),
            (100, 500, "a"),
            (100, 500, "b"),
            (800, 500, "c"),
        ]
    ]
    setting = paper.main_setting(pd.DataFrame(rows))
    assert setting.T == 1500 and setting.l_maxes == {"w": 800}  # 3 cells at 1500 vs 3 at 500: tie -> larger T
    rows.append(dict(dataset="w", l_max=100, gen_length=500, label="z", sweep=False))
    assert paper.main_setting(pd.DataFrame(rows)).T == 500


def test_tables_cli_markdown_json_and_out(small_db, tmp_path):
    path, _ = small_db
    md = invoke("report", "--db", path, "--tables", "--format", "markdown")
    assert md.exit_code == 0, md.output
    assert "### Table 1 — Main results" in md.stdout and "| Linear Spec |" in md.stdout
    assert "### Table 4 — Ablation" in md.stdout
    js = invoke("report", "--db", path, "--tables", "--format", "json")
    data = json.loads(js.stdout)
    assert set(data) == {"table1_main", "table2_latency", "table3_efficiency", "table4_ablation", "table5_memory"}
    out = tmp_path / "tables"
    res = invoke("report", "--db", path, "--out", out)
    assert res.exit_code == 0 and res.stdout == ""
    assert (out / "tables.md").read_text().count("### Table") == 5
    assert (out / "table1_main.csv").read_text().startswith("method,")


def test_bad_option_combinations_are_one_line_errors(small_db):
    path, _ = small_db
    for args, needle in [
        (["--tables", "--format", "csv"], "--out DIR"),
        (["3"], "--compare BEFORE AFTER"),
        (["--compare", "1"], "two run ids"),
        (["--fail-if", "throughput:-5%"], "--compare BEFORE AFTER"),
        (["--run", "1", "--run", "1", "--tables"], "same run"),
        (["--run", "7", "--tables"], "no run 7"),
    ]:
        res = invoke("report", "--db", path, *args)
        assert res.exit_code == 2, (args, res.output)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (args, res.stderr)


def test_speedup_compare_cli(small_db):
    path, _ = small_db
    res = invoke("report", "--db", path, "--compare", "--format", "csv")
    assert res.exit_code == 0, res.output
    header = res.stdout.splitlines()[0].split(",")
    assert {"speedup", "ci_low", "ci_high", "verdict"} <= set(header)
    table = invoke("report", "--db", path, "--compare")
    assert "95% CI" in table.stdout and "faster" in table.stdout


# --- figures and HTML ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paper_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("paper") / "paper.db"
    sessions = reportdb.connect(path)
    with sessions() as s:
        ids = reportdb.paper_like(s)
    with sessions() as s:
        summary, runs = combined_summary(s, ids)
    return path, summary, ids


@pytest.mark.full  # paper-like end-to-end runs
def test_paper_like_runs_give_every_table_and_figure(paper_db, tmp_path):
    path, summary, ids = paper_db
    made, skipped = paper.paper_tables(summary)
    assert [t.key for t in made] == [
        "table1_main",
        "table2_latency",
        "table3_efficiency",
        "table4_ablation",
        "table5_memory",
    ] and not skipped
    t4 = made[3].data
    assert list(t4["variant"][:3]) == ["Fixed Tree (D=5, B=2)", "+ Dynamic Breadth & Depth", "DynaTree"]
    res = invoke("report", "--db", path, *sum((["--run", i] for i in ids), []), "--figures", tmp_path / "figs")
    assert res.exit_code == 0, res.output
    stems = [stem for stem, _ in figures.FIGURES]
    for stem in stems:
        png, svg = tmp_path / "figs" / f"{stem}.png", tmp_path / "figs" / f"{stem}.svg"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, stem
        assert b"<svg" in svg.read_bytes()[:2000], stem
    assert "note:" not in res.stderr.replace("note: 8 cells", "")  # nothing skipped


def test_figures_without_data_are_skipped_with_a_note(small_db, tmp_path):
    path, _ = small_db
    res = invoke("report", "--db", path, "--figures", tmp_path / "f")
    assert res.exit_code == 0, res.output
    notes = [line for line in res.stderr.splitlines() if line.startswith("note:")]
    assert {n.split()[2] for n in notes} == {"5", "6", "7", "8"}  # Figure N skipped: ...
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == [
        "fig3_throughput_speedup.png",
        "fig3_throughput_speedup.svg",
        "fig4_ablation.png",
        "fig4_ablation.svg",
    ]


def test_html_is_self_contained(paper_db, tmp_path):
    path, _, ids = paper_db
    out = tmp_path / "report.html"
    res = invoke("report", "--db", path, "--run", ids[0], "--html", out)
    assert res.exit_code == 0, res.output
    doc = out.read_text()
    assert doc.startswith("<!DOCTYPE html>") and "Table 1 — Main results" in doc and "95% CI" in doc
    assert doc.count("data:image/svg+xml;base64,") >= 4
    assert not re.search(r"""(src|href)=['"](https?:|//|file:)""", doc)


def test_failed_cell_shows_dash_and_note_and_figures_still_draw(tmp_path):
    path = tmp_path / "f.db"
    sessions = reportdb.connect(path)
    with sessions() as s:
        run = reportdb.add_run(s, "f")
        reportdb.add_samples(s, reportdb.add_cell(s, run, "AR", "ar"), AR_WIKI, warmup=1)
        reportdb.add_cell(s, run, "DynaTree", "dynatree", status="failed", error="RuntimeError: out of memory")
        reportdb.add_samples(s, reportdb.add_cell(s, run, "Fixed Tree", "fixed_tree"), FT_WIKI, warmup=1)
        s.commit()
    t, _ = tables_of(sessions)
    row = t["table1_main"].display.set_index("Method").loc["DynaTree"]
    assert row["wikitext-2 Throughput (t/s)"] == "—" and row["wikitext-2 Speedup"] == "—"
    assert any("DynaTree failed on wikitext-2: RuntimeError: out of memory" in n for n in t["table1_main"].notes)
    res = invoke("report", "--db", path, "--figures", tmp_path / "figs", "--compare")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "figs" / "fig4_ablation.png").exists() and "failed" in res.stdout
