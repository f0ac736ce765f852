"""The one output layer (reports/rendering/output.py): a report object, a document envelope, renderers registered once,
escaping on every path, and every report command printed through the registry (issue 18, item 5)."""

import json
import re

import pandas as pd
import pytest
import reportdb
from kit import invoke
from rich.console import Console

from dtbench.harness.errors import DtbenchError
from dtbench.reports.rendering import output
from dtbench.reports.rendering.output import FORMATS, RENDERERS, Document, Note, Report, emit, rendered, renderer

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)


def _report(**kw) -> Report:
    display = pd.DataFrame([{"Decoder": "a|b", "Speedup": "1.50×"}])
    data = pd.DataFrame([{"label": "=cmd()", "speedup": 1.5, "missing": float("nan")}])
    return Report(kw.pop("key", "r"), "Title", "Caption", display, data, notes=kw.pop("notes", ["note one"]), **kw)


def test_formats_are_the_registered_renderers_and_the_cli_choices():
    from dtbench.cli.main import report

    # the built-ins are pyproject's entry points, sorted by name (the installer's order is not theirs)
    assert FORMATS == ("csv", "html", "json", "markdown", "table") and FORMATS == tuple(RENDERERS)[: len(FORMATS)]
    (fmt,) = [p for p in report.params if p.name == "fmt"]
    # the built-ins first, then any format an installed plugin registers (`dtbench.formats`; test_plugin installs tsv)
    assert tuple(fmt.type.choices)[: len(FORMATS)] == FORMATS and set(fmt.type.choices) == set(RENDERERS)


def test_markdown_escapes_and_carries_header_caption_and_notes(capsys):
    emit("markdown", Document([_report()], header="run 1 · suite a|b\nhardware: x"))
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[:4] == ["run 1 · suite a\\|b", "", "hardware: x", ""] and lines[4] == "### Title"
    assert "| a\\|b | 1.50× |" in out and "\nCaption\n" in out and "\n- note one\n" in out


def test_csv_guards_formulas_and_flattens_lists_and_dicts(capsys):
    emit("csv", [_report()])
    csv = capsys.readouterr().out
    assert csv.splitlines()[0] == "label,speedup,missing" and "'=cmd()" in csv
    data = pd.DataFrame([{"l_max": 128, "per_position": [0.5, 0.25], "params": {"k": 4}}])
    doc = Document([Report("x", "X", "", pd.DataFrame([{"a": "1"}]), data)], rows="cells")
    assert rendered("csv", doc).splitlines() == ["prompt_cap,per_position,params", '128,0.5;0.25,"{""k"":4}"']
    assert json.loads(rendered("json", doc))["cells"] == [
        {"prompt_cap": 128, "per_position": [0.5, 0.25], "params": {"k": 4}}
    ]


def test_csv_of_several_reports_is_one_table_when_their_columns_agree():
    a, b = _report(key="a"), _report(key="b")
    b.data = b.data.assign(label="second")
    assert rendered("csv", [a, b]).splitlines()[1:] == ["'=cmd(),1.5,", "second,1.5,"]
    b.data = b.data.rename(columns={"speedup": "ratio"})
    with pytest.raises(DtbenchError, match="different columns"):
        rendered("csv", [a, b])


def test_json_envelopes(capsys):
    emit("json", [_report(key="a"), _report(key="b")])
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["a", "b"] and doc["a"]["notes"] == ["note one"]
    assert doc["a"]["rows"] == [{"label": "=cmd()", "speedup": 1.5, "missing": None}]
    emit("json", Document([_report(notes=[Note("styled", "red")])], meta={"run": 7}, rows="cells"))
    assert json.loads(capsys.readouterr().out) == {
        "run": 7,
        "cells": [{"label": "=cmd()", "speedup": 1.5, "missing": None}],
    }
    third = _report()
    third.data = pd.DataFrame([{"x": 1 / 3}])
    assert json.loads(rendered("json", Document([third], rows="r", precision=15)))["r"][0]["x"] == 0.333333333333333
    assert json.loads(rendered("json", Document([third], rows="r")))["r"][0]["x"] == 0.3333333333


def test_table_draws_header_title_caption_and_styled_notes_escaped(monkeypatch, capsys):
    monkeypatch.setattr(output, "stdout", lambda: Console(width=120, force_terminal=True, color_system="standard"))
    r = _report(notes=["bell\x07here", Note("failed badly", "red")], row_styles=["green"])
    emit("table", Document([r], header="run 9 \x1b[31m"))
    out = capsys.readouterr().out
    assert "Title" in out and "Caption" in out and "bell" in out and "run 9 \\x1b[31m" in out
    assert "\x07" not in out and "\x1b[31m" in out.split("failed badly")[0].rsplit("\n", 1)[-1]  # the note is red


def test_html_is_escaped_self_contained_and_styles_rows():
    r = _report(row_styles=["bold red"], notes=[Note("<b>boom</b>", "yellow")])
    r.display = pd.DataFrame([{"Decoder": "<script>alert(1)</script>", "Speedup": "1.50×"}])
    page = rendered("html", Document([r], header="run 3"))
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<tr class='bold red'>" in page and "<p class='note yellow'>&lt;b&gt;boom&lt;/b&gt;</p>" in page
    assert "<td class='l'>&lt;script" in page and "<td>1.50×</td>" in page  # text left, numbers right
    assert "<p class='caption'>run 3</p>" in page and "<h3>Title</h3>" in page


def test_renderer_decorator_registers_and_unknown_formats_raise(monkeypatch, request):
    monkeypatch.setattr(output, "RENDERERS", dict(RENDERERS))
    request.addfinalizer(lambda: output.FORMAT_REGISTRY.unregister("upper"))  # the one registry holds it (issue 58)
    with pytest.raises(DtbenchError, match="report format 'csv' is a built-in name of dtbench"):
        renderer("csv")(lambda doc: "")  # a built-in is never taken over, in-process either

    @renderer("upper")
    def _upper(doc):
        return doc.reports[0].title.upper()

    assert output.RENDERERS["upper"](Document([_report()])) == "TITLE"
    with pytest.raises(KeyError):
        emit("nope", [_report()])


# --- every report command prints through the registry ------------------------------------------------------------


@pytest.fixture()
def keys_format(monkeypatch):
    """A format registered only here: it prints every report's key and the document's JSON envelope, so a report
    that bypassed the registry (its own per-format branch) cannot print it."""
    monkeypatch.setitem(
        RENDERERS, "keys", lambda doc: " ".join(["keys:", *(r.key for r in doc.reports), *sorted(doc.meta)])
    )


@pytest.fixture()
def two_runs(tmp_path):
    """Two copies of reportdb's tricky run (failed, partial, warmup-only and diverging cells) in one database."""
    path = tmp_path / "r.db"
    return (str(path), *reportdb.runs_of(path, reportdb.tricky_run, reportdb.tricky_run))


def test_a_registered_format_reaches_every_report_and_the_cli(keys_format, two_runs):
    path, first, second = two_runs
    cases = {
        (): "keys: cells_0 run",
        ("--compare",): "keys: speedups confidence run",
        ("--compare", str(first), str(second)): "keys: compare after alpha before gate",
        ("--tables",): "keys: table1_main",
    }
    for args, start in cases.items():
        res = invoke("report", "--db", path, "--format", "keys", *args)
        assert res.exit_code == 0, res.output
        assert res.stdout.startswith(start), (args, res.stdout)
    assert "keys" in invoke("report", "--help").stdout


def test_html_format_of_every_report(two_runs):
    path, first, second = two_runs
    for args, needle in {
        (): "wikitext-2 · L_max=128 · T=64",
        ("--compare",): "speedup vs AR",
        ("--compare", str(first), str(second)): f"run {first} → run {second}",
        ("--tables",): "Table 1",
    }.items():
        res = invoke("report", "--db", path, "--format", "html", *args)
        assert res.exit_code == 0, res.output
        assert res.stdout.startswith("<!DOCTYPE html>") and needle in res.stdout, (args, res.stdout[:300])
        assert len(re.findall("<table>", res.stdout)) >= 1


def test_cell_table_reads_the_same_in_every_format(two_runs):
    """The run's cell table is reports like any other: the same display strings in the terminal, Markdown and HTML,
    and one row per cell in CSV and JSON."""
    path, first, _ = two_runs
    md = invoke("report", "--db", path, "--run", str(first), "--format", "markdown").stdout
    page = invoke("report", "--db", path, "--run", str(first), "--format", "html").stdout
    table = invoke("report", "--db", path, "--run", str(first)).stdout
    assert md.startswith(f"run {first} · suite tricky") and "### wikitext-2 · L_max=128 · T=64" in md
    assert "mean ± std over" in md and "- Partial is partial" in md
    for shown in ("no 5/6 (first at 17)", "21.5 ± 0.7 (partial)"):
        assert shown in md and shown in page and shown in table
    assert "<tr class='red'>" in page and "<p class='note red'>Partial is partial" in page
    cells = json.loads(invoke("report", "--db", path, "--run", str(first), "--format", "json").stdout)["cells"]
    csv = invoke("report", "--db", path, "--run", str(first), "--format", "csv").stdout.splitlines()
    assert len(cells) == len(csv) - 1 and all("params" in c for c in cells) and csv[0].endswith(",params")


def test_out_dir_writes_what_the_markdown_and_csv_formats_print(two_runs, tmp_path):
    from dtbench.reports.views.paper import paper_tables
    from dtbench.reports.views.summary import combined_summary

    path, first, _ = two_runs
    out = tmp_path / "tables"
    res = invoke("report", "--db", path, "--run", str(first), "--out", str(out))
    assert res.exit_code == 0, res.output
    md = invoke("report", "--db", path, "--run", str(first), "--tables", "--format", "markdown").stdout
    assert (out / "tables.md").read_text() == md
    with reportdb.connect(path)() as s:
        made, _ = paper_tables(combined_summary(s, [first])[0], False)
    assert made and {t.key for t in made} == {p.stem for p in out.glob("*.csv")}
    for t in made:
        assert (out / f"{t.key}.md").read_text() == rendered("markdown", [t]) and (
            out / f"{t.key}.md"
        ).read_text() in md
        assert (out / f"{t.key}.csv").read_text() == rendered("csv", [t])
