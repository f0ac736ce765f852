"""Metrics that mean what they say (issue 8, items 12, 13, 17, 18, 19), on synthetic databases (tests/reportdb.py).

- 12: the Lossless verdict counts every measured sample, warmup included, in every output.
- 13: a cell that failed after some prompts is marked partial everywhere, and kept out of the paper's tables and
  figures unless asked.
- 17: a cell whose samples are all warmup shows a dash and a note, never the warmup's numbers.
- 18: the run's hardware flags (environment["hardware"]) are shown where the environment is; old runs show nothing.
- 19: below compare.MIN_PROMPTS prompts after warmup there is no CI and no verdict, only "n too small"; the
  speedup CI is built on the paired per-prompt ratios.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import reportdb
from click.testing import CliRunner

from dtbench.cli.main import cli
from dtbench.reports.rendering import html, render
from dtbench.reports.views import compare, figures, paper
from dtbench.reports.views.compare import compare_runs, speedup_table
from dtbench.reports.views.summary import combined_summary, samples_frame, summarize

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture()
def tricky(tmp_path):
    path = tmp_path / "t.db"
    sessions = reportdb.connect(path)
    with sessions() as s:
        rid = reportdb.tricky_run(s)
    return path, sessions, rid


def summary_of(sessions, rid):
    with sessions() as s:
        return summarize(samples_frame(s, rid)).set_index("label", drop=False)


def tables_of(sessions, rid, include_partial=False):
    with sessions() as s:
        summary, _ = combined_summary(s, [rid])
    made, _ = paper.paper_tables(summary, include_partial)
    return {t.key: t for t in made}


def html_of(sessions, rid, include_partial=False):
    with sessions() as s:
        summary, runs = combined_summary(s, [rid])
        frame = samples_frame(s, rid)
    return html.build_html(summary, runs, {rid: speedup_table(frame)}, include_partial=include_partial)


def kept(values):
    return np.array(values[1:])


# --- 12: Lossless counts warmup samples ----------------------------------------------------------------------------


def test_lossless_verdict_counts_warmup_samples(tricky):
    _, sessions, rid = tricky
    row = summary_of(sessions, rid).loc["Diverges"]
    assert (row["lossless"], row["lossless_n"], row["divergences"]) == ("no", "5/6", [17])
    assert render.formatted(row)["lossless"] == "no 5/6 (first at 17)"


@pytest.mark.parametrize("fmt", ["table", "markdown", "csv", "json"])
def test_lossless_divergence_in_warmup_shows_in_every_format(tricky, fmt):
    path, _, _ = tricky
    res = invoke("report", "--db", path, "--format", fmt)
    assert res.exit_code == 0, res.output
    if fmt == "json":
        cell = next(c for c in json.loads(res.stdout)["cells"] if c["label"] == "Diverges")
        assert (cell["lossless"], cell["lossless_n"]) == ("no", "5/6")
    elif fmt == "csv":
        line = next(line for line in res.stdout.splitlines() if ",Diverges," in line)
        assert ",no,5/6," in line
    else:
        assert "no 5/6 (first at 17)" in res.stdout


def test_lossless_divergence_in_warmup_shows_in_paper_tables_and_html(tricky):
    _, sessions, rid = tricky
    t = tables_of(sessions, rid)
    note = (
        "Diverges is not lossless on wikitext-2: 5/6 samples (warmup included) match ar, first divergence at token 17"
    )
    assert note in t["table1_main"].notes
    doc = html_of(sessions, rid)
    assert "no 5/6 (first at 17)" in doc and note in doc


# --- 13: partial cells ---------------------------------------------------------------------------------------------


def test_partial_flag_only_for_failed_cells_with_samples(tricky):
    _, sessions, rid = tricky
    table = summary_of(sessions, rid)
    assert table["partial"].to_dict() == {
        "AR": False,
        "Diverges": False,
        "Partial": True,
        "Warmup only": False,
        "Broken": False,
    }
    assert table.loc["Partial", "n"] == 2 and table.loc["Partial", "throughput_mean"] == pytest.approx(21.5)


def test_partial_cell_is_marked_in_the_terminal_markdown_csv_and_json(tricky):
    path, _, _ = tricky
    table = invoke("report", "--db", path).stdout
    partial_row = next(line for line in table.splitlines() if "Partial" in line and "│" in line)
    assert "(partial)" in partial_row and "FAILED (partial), yes 3/3" in partial_row
    assert (
        f"Partial is partial: it failed after 3 measured prompts (2 after warmup), its numbers come from those "
        f"prompts only: {reportdb.PARTIAL_ERROR}" in " ".join(table.split())
    )
    md = invoke("report", "--db", path, "--format", "markdown").stdout
    assert "| Partial | 21.5 ± 0.7 (partial) |" in md and "- Partial is partial: it failed after 3" in md
    csv_lines = invoke("report", "--db", path, "--format", "csv").stdout.splitlines()
    header = csv_lines[0].split(",")
    rows = {line.split(",")[3]: dict(zip(header, line.split(","))) for line in csv_lines[1:]}
    assert rows["Partial"]["partial"] == "True" and rows["Diverges"]["partial"] == "False"
    cells = {c["label"]: c for c in json.loads(invoke("report", "--db", path, "--format", "json").stdout)["cells"]}
    assert cells["Partial"]["partial"] is True and cells["Broken"]["partial"] is False


def test_partial_cell_is_left_out_of_paper_tables_unless_asked(tricky):
    _, sessions, rid = tricky
    t = tables_of(sessions, rid)
    row = t["table1_main"].display.set_index("Method").loc["Partial"]
    assert row["wikitext-2 Throughput (t/s)"] == "—" and row["wikitext-2 Speedup"] == "—"
    data = t["table1_main"].data.set_index("method").loc["Partial"]
    assert math.isnan(data["wikitext-2.throughput_mean"]) and bool(data["wikitext-2.partial"])
    assert any(
        n.startswith("Partial is partial on wikitext-2: it failed after 3 measured prompts (2 after warmup)")
        and "left out (--include-partial" in n
        for n in t["table1_main"].notes
    )
    assert t["table4_ablation"].display.set_index("Variant").loc["Partial", "Throughput (t/s)"] == "—"

    t = tables_of(sessions, rid, include_partial=True)
    disp = t["table1_main"].display.set_index("Method")
    assert "Partial (partial: wikitext-2)" in disp.index
    assert disp.loc["Partial (partial: wikitext-2)", "wikitext-2 Throughput (t/s)"] == "21.5 ± 0.7"
    assert t["table1_main"].data.set_index("method").loc["Partial", "wikitext-2.throughput_mean"] == pytest.approx(21.5)
    assert any("its numbers come from those prompts only" in n for n in t["table1_main"].notes)


def _bar_heights(fig, ax_index=0):
    return [p.get_height() for p in fig.axes[ax_index].patches]


def test_partial_cell_is_left_out_of_figures_unless_asked(tricky):
    _, sessions, rid = tricky
    with sessions() as s:
        summary, _ = combined_summary(s, [rid])
    labels = list(summary["label"])  # one dataset: figure 3 has one bar per method, in this order
    figs, notes = figures.build_figures(summary)
    assert math.isnan(_bar_heights(figs["fig3_throughput_speedup"])[labels.index("Partial")])
    assert any(n.startswith("partial cells left out of the figures") and "Partial (wikitext-2" in n for n in notes)

    figs, notes = figures.build_figures(summary, include_partial=True)
    bar = figs["fig3_throughput_speedup"].axes[0].patches[labels.index("Partial")]
    assert bar.get_height() == pytest.approx(21.5) and bar.get_hatch() == figures.PARTIAL_HATCH
    assert any(n.startswith("figures include partial cells") for n in notes)


def test_partial_cell_in_html_and_speedup_compare(tricky):
    path, sessions, rid = tricky
    doc = html_of(sessions, rid)
    assert "FAILED (partial)" in doc and "Partial is partial: it failed after 3 measured prompts" in doc
    with sessions() as s:
        table = speedup_table(samples_frame(s, rid)).set_index("label")
    assert bool(table.loc["Partial", "partial"]) and table.loc["Partial", "verdict"].endswith("(partial)")
    res = invoke("report", "--db", path, "--compare", "--format", "markdown")
    line = next(line for line in res.stdout.splitlines() if line.startswith("| wikitext-2 | 128 | 64 | Partial"))
    assert "(partial)" in line


def test_partial_cell_in_run_to_run_compare(tmp_path):
    sessions = reportdb.connect(tmp_path / "c.db")
    base = [1.0] + [100.0 + i for i in range(8)]
    with sessions() as s:
        before, after = reportdb.add_run(s, "b"), reportdb.add_run(s, "a")
        for run in (before, after):
            reportdb.add_samples(s, reportdb.add_cell(s, run, "AR", "ar"), base, warmup=1)
        reportdb.add_samples(s, reportdb.add_cell(s, before, "Lin", "linear"), base, warmup=1)
        cell = reportdb.add_cell(s, after, "Lin", "linear", status="failed", error="boom")
        reportdb.add_samples(s, cell, base[:6], warmup=1)
        s.commit()
        fb, fa = samples_frame(s, before.id), samples_frame(s, after.id)
    table, _ = compare_runs(fb, fa, before_env=reportdb.ENV, after_env=reportdb.ENV)
    row = table.set_index("label").loc["Lin"]
    assert row["mark"] == "newly failing" and bool(row["after_partial"]) and not bool(row["before_partial"])
    disp = render.compare_display(table).set_index("Decoder").loc["Lin"]
    assert disp["After (t/s)"].endswith("(partial)") and not disp["Before (t/s)"].endswith("(partial)")


# --- 17: only warmup samples -------------------------------------------------------------------------------------


def test_warmup_only_cell_shows_dashes_and_a_note_not_warmup_numbers(tricky):
    path, sessions, rid = tricky
    row = summary_of(sessions, rid).loc["Warmup only"]
    assert bool(row["all_warmup"]) and row["n"] == 0 and row["warmup_n"] == 2
    assert all(
        math.isnan(row[c]) for c in ("throughput_mean", "speedup", "ttft_ms_mean", "acceptance_rate", "peak_mib")
    )
    f = render.formatted(row)
    assert (f["throughput"], f["speedup"], f["ttft_ms"], f["acceptance_rate"]) == ("—", "—", "—", "—")
    out = " ".join(invoke("report", "--db", path).stdout.split())
    assert "Warmup only: all 2 measured prompts are warmup, so it has no numbers after warmup" in out
    assert "65.0" not in out  # the warmup mean
    t = tables_of(sessions, rid)
    assert t["table1_main"].display.set_index("Method").loc["Warmup only", "wikitext-2 Throughput (t/s)"] == "—"
    assert (
        "Warmup only on wikitext-2: all 2 measured prompts are warmup, so it has no numbers after warmup "
        "(the suite's prompts must exceed its warmup)" in t["table1_main"].notes
    )


# --- 18: hardware flags -------------------------------------------------------------------------------------------


HW_LINE = "hardware: CPU avx2 avx512f avx512_bf16 (no avx512_fp16 amx_bf16 amx_tile); torch CPU kernels AVX512"


def test_hardware_flags_in_run_header_html_and_json(tricky):
    path, sessions, rid = tricky
    res = invoke("report", "--db", path)
    assert res.exit_code == 0 and HW_LINE in res.stdout
    assert HW_LINE.removeprefix("hardware: ") in html_of(sessions, rid)
    meta = json.loads(invoke("report", "--db", path, "--format", "json").stdout)["run"]
    assert meta["environment"]["hardware"] == reportdb.HARDWARE


def test_old_runs_without_hardware_show_nothing(tmp_path):
    path = tmp_path / "old.db"
    sessions = reportdb.connect(path)
    with sessions() as s:
        rid = reportdb.tricky_run(s, hardware=False)
    res = invoke("report", "--db", path)
    assert res.exit_code == 0 and "hardware" not in res.stdout and res.stdout.startswith("run 1 · suite tricky")
    assert "<td>—</td>" in html_of(sessions, rid).split("<h2>Paper tables")[0]


def test_hardware_text_for_cuda_and_missing_flags():
    env = {
        "hardware": {"cpu_flags": None, "torch_cpu_capability": "AVX2", "cuda_capability": "7.5", "cuda_bf16": False}
    }
    assert render.hardware_text(env) == "torch CPU kernels AVX2; CUDA compute capability 7.5, no native bf16"
    assert render.hardware_text({}) == "" and render.hardware_text(None) == ""


def test_hardware_flag_change_makes_runs_not_comparable_only_when_both_recorded():
    with_hw = {**reportdb.ENV, "hardware": reportdb.HARDWARE}
    no_bf16 = {
        **reportdb.ENV,
        "hardware": {**reportdb.HARDWARE, "cpu_flags": {**reportdb.HARDWARE["cpu_flags"], "avx512_bf16": False}},
    }
    diff = compare.env_differences(with_hw, no_bf16)
    assert len(diff) == 1 and diff[0].startswith("hardware CPU avx2 avx512f avx512_bf16")
    assert compare.env_differences(reportdb.ENV, with_hw) == []  # an old run lacks the flags: no difference claimed


# --- 19: too few prompts --------------------------------------------------------------------------------------------


@pytest.fixture()
def few(tmp_path):
    path = tmp_path / "few.db"
    sessions = reportdb.connect(path)
    with sessions() as s:
        rid = reportdb.few_prompts_run(s)
    return path, sessions, rid


def test_two_prompts_give_no_ci_and_no_verdict(few):
    _, sessions, rid = few
    with sessions() as s:
        row = speedup_table(samples_frame(s, rid)).set_index("label").loc["Linear"]
    assert row["n"] == 2 and row["verdict"] == "n too small"
    assert math.isnan(row["ci_low"]) and math.isnan(row["ci_high"])
    assert row["speedup"] == pytest.approx(0.77, rel=0.02)  # the point estimate is still shown
    disp = render.speedup_display(speedup_table(samples_frame(sessions(), rid))).iloc[0]
    assert disp["95% CI"] == f"n too small (n < {compare.MIN_PROMPTS})" and disp["Verdict"] == "n too small"


def test_two_prompts_in_compare_cli_and_html(few):
    path, sessions, rid = few
    for fmt in ("table", "markdown"):
        res = invoke("report", "--db", path, "--compare", "--format", fmt)
        assert res.exit_code == 0 and "n too small" in res.stdout and "slower" not in res.stdout, res.stdout
    doc = html_of(sessions, rid)
    assert "n too small" in doc and "slower" not in doc


def test_enough_prompts_give_a_paired_ci_and_a_verdict(tmp_path):
    sessions = reportdb.connect(tmp_path / "ok.db")
    with sessions() as s:
        rid = reportdb.few_prompts_run(s, after_warmup=compare.MIN_PROMPTS)
        row = speedup_table(samples_frame(s, rid)).set_index("label").loc["Linear"]
    assert row["n"] == compare.MIN_PROMPTS and row["verdict"] == "slower"
    assert row["ci_low"] < row["paired_speedup"] < row["ci_high"] < 1


def test_ci_pairs_prompts_by_index(tmp_path):
    """AR's prompts differ wildly in difficulty; the decoder is exactly 1.5x AR on each. Pairing by prompt index
    sees a certain 1.5x; an unpaired interval would straddle 1."""
    sessions = reportdb.connect(tmp_path / "p.db")
    ar = [1.0, 5.0, 40.0, 12.0, 80.0, 20.0, 3.0]
    lin = [1.0] + [1.5 * v * (1 + 0.002 * (-1) ** i) for i, v in enumerate(ar[1:])]
    with sessions() as s:
        run = reportdb.add_run(s, "p")
        reportdb.add_samples(s, reportdb.add_cell(s, run, "AR", "ar"), ar, warmup=1)
        reportdb.add_samples(s, reportdb.add_cell(s, run, "Lin", "linear"), lin, warmup=1)
        s.commit()
        row = speedup_table(samples_frame(s, run.id)).iloc[0]
    assert row["verdict"] == "faster" and 1.49 < row["ci_low"] < row["ci_high"] < 1.51


def test_run_to_run_compare_with_few_prompts_is_n_too_small(tmp_path):
    sessions = reportdb.connect(tmp_path / "r.db")
    with sessions() as s:
        b, a = reportdb.add_run(s, "b"), reportdb.add_run(s, "a")
        for run, thr in ((b, [1.0, 100.0, 101.0, 99.0]), (a, [1.0, 50.0, 51.0, 49.0])):
            reportdb.add_samples(s, reportdb.add_cell(s, run, "Lin", "linear"), thr, warmup=1)
        s.commit()
        fb, fa = samples_frame(s, b.id), samples_frame(s, a.id)
    table, failures = compare_runs(
        fb, fa, before_env=reportdb.ENV, after_env=reportdb.ENV, gates=[compare.Gate.parse("throughput:-5%")]
    )
    row = table.iloc[0]
    assert row["mark"] == "n too small" and math.isnan(row["p_value"]) and failures == []
    assert "3 before, 3 after" in row["note"]


def test_min_prompts_is_documented():
    docs = " ".join(p.read_text() for p in (Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
    assert f"fewer than {compare.MIN_PROMPTS} prompts after warmup" in " ".join(docs.split())


def test_speedups_against_a_partial_ar_cell_are_left_out_too(tmp_path):
    sessions = reportdb.connect(tmp_path / "a.db")
    with sessions() as s:
        run = reportdb.add_run(s, "a")
        ar = reportdb.add_cell(s, run, "AR", "ar", status="failed", error="killed")
        reportdb.add_samples(s, ar, reportdb.AR_THR[:4], warmup=1)
        reportdb.add_samples(s, reportdb.add_cell(s, run, "Lin", "linear"), reportdb.DIVERGES_THR, warmup=1)
        s.commit()
        summary, _ = combined_summary(s, [run.id])
    table1 = {x.key: x for x in paper.paper_tables(summary)[0]}["table1_main"]
    t = table1.display.set_index("Method")
    assert t.loc["Lin", "wikitext-2 Speedup"] == "—" and t.loc["Lin", "wikitext-2 Throughput (t/s)"] != "—"
    assert t.loc["AR", "wikitext-2 Throughput (t/s)"] == "—"
    assert (
        "Lin on wikitext-2: speedup left out, its AR baseline is partial (--include-partial shows it)" in table1.notes
    )


def test_include_partial_reaches_the_paper_outputs_and_is_refused_elsewhere(tricky, capsys):
    from dtbench.harness.errors import DtbenchError
    from dtbench.reports.command import report_command

    path, _, _ = tricky
    kw = dict(
        runs=(),
        db_url=f"sqlite:///{path}",
        run_ids=[],
        fmt="json",
        compare=False,
        alpha=0.05,
        only_changed=False,
        fail_if=[],
        out_dir=None,
        fig_dir=None,
        html_file=None,
    )
    report_command(tables=True, include_partial=True, **kw)
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)["table1_main"]["rows"]}
    assert (
        rows["Partial"]["wikitext-2.throughput_mean"] == pytest.approx(21.5) and rows["Partial"]["wikitext-2.partial"]
    )
    report_command(tables=True, **kw)
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)["table1_main"]["rows"]}
    assert rows["Partial"]["wikitext-2.throughput_mean"] is None
    with pytest.raises(DtbenchError, match="--include-partial is for --tables"):
        report_command(tables=False, include_partial=True, **kw)
