"""The one output layer (reports/output.py): a report object, renderers registered once, escaping on every path."""

import json

import pandas as pd
import pytest

from dtbench.reports import output
from dtbench.reports.output import FORMATS, RENDERERS, Report, emit_reports, renderer


def _report(**kw) -> Report:
    display = pd.DataFrame([{"Decoder": "a|b", "Speedup": "1.50×"}])
    data = pd.DataFrame([{"label": "=cmd()", "speedup": 1.5, "missing": float("nan")}])
    return Report(kw.pop("key", "r"), "Title", "Caption", display, data, notes=["note one"], **kw)


def test_formats_are_the_registered_renderers():
    assert FORMATS == ("table", "markdown", "csv", "json") and set(FORMATS) <= set(RENDERERS)


def test_markdown_escapes_and_carries_caption_and_notes(capsys):
    emit_reports("markdown", [_report()])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "### Title"
    assert "| a\\|b | 1.50× |" in out and "\nCaption\n" in out and "\nnote one\n" in out


def test_csv_guards_formulas_and_json_has_rows(capsys):
    emit_reports("csv", [_report()])
    csv = capsys.readouterr().out
    assert csv.splitlines()[0] == "label,speedup,missing" and "'=cmd()" in csv
    emit_reports("json", [_report(key="a"), _report(key="b")])
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["a", "b"] and doc["a"]["notes"] == ["note one"]
    assert doc["a"]["rows"] == [{"label": "=cmd()", "speedup": 1.5, "missing": None}]


def test_table_draws_title_caption_notes_escaped(capsys, monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(output, "stdout", lambda: Console(width=120))
    r = _report()
    r.notes = ["bell\x07here"]
    emit_reports("table", [r])
    out = capsys.readouterr().out
    assert "Title" in out and "Caption" in out and "\x07" not in out and "bell" in out


def test_an_override_replaces_one_format_and_a_registered_format_reaches_every_report(capsys, monkeypatch):
    emit_reports("json", [_report()], json=lambda: '{"custom": 1}')
    assert json.loads(capsys.readouterr().out) == {"custom": 1}
    monkeypatch.setitem(RENDERERS, "keys", lambda reports: ",".join(r.key for r in reports))
    emit_reports("keys", [_report(key="x"), _report(key="y")])
    assert capsys.readouterr().out == "x,y\n"


def test_renderer_decorator_registers(monkeypatch):
    monkeypatch.setattr(output, "RENDERERS", dict(RENDERERS))

    @renderer("upper")
    def _upper(reports):
        return reports[0].title.upper()

    assert output.RENDERERS["upper"]([_report()]) == "TITLE"
    with pytest.raises(KeyError):
        emit_reports("nope", [_report()])
