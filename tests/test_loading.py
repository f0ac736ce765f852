"""One loader of a run's cells for every report (issue 58 item 1): no module of reports/ but reports/loading.py
queries cells or samples, and the loader returns what the reports read, in the documented order."""

from __future__ import annotations

import ast
from pathlib import Path

from reportdb import add_cell, add_run, add_samples, connect

from dtbench.reports import loading

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

REPORTS = Path(__file__).resolve().parents[1] / "reports"
TABLES = {"Cell", "Sample"}  # the models of a run's cells and their samples (harness/store/db.py)


def queries_on_cells(path: Path) -> list[str]:
    """``file:line`` of every ``select(...)`` or ``.query(...)`` in ``path`` whose arguments name ``Cell`` or
    ``Sample`` (``select(Cell, Sample)``, ``select(Cell.id)``, ``select(db.Sample)``, across lines alike)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name not in ("select", "query"):
            continue
        names = {n.id for arg in node.args for n in ast.walk(arg) if isinstance(n, ast.Name)}
        names |= {n.attr for arg in node.args for n in ast.walk(arg) if isinstance(n, ast.Attribute)}
        if names & TABLES:
            hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_only_the_loader_queries_a_runs_cells():
    """Issue 58 item 1: "one loader of a run's cells for every report"; before it seven modules wrote their own
    ``select(Cell ...)`` (costmodel, schedule, engine, profile_report, costmodel_batch, predict, summary)."""
    outside = [hit for f in sorted(REPORTS.rglob("*.py")) if f.name != "loading.py" for hit in queries_on_cells(f)]
    assert outside == [], f"query cells through reports/loading.py, not: {outside}"
    assert queries_on_cells(REPORTS / "loading.py")  # the rule's detector sees the loader's own queries


def test_the_loaders_rows_and_their_order(tmp_path):
    """Cells in id order; samples in stored order, or by prompt with ``by_prompt``; a cell without samples only in an
    outer load; warmup samples only where asked for."""
    with connect(tmp_path / "r.db")() as s:
        run = add_run(s)
        ar, lin = add_cell(s, run, "ar"), add_cell(s, run, "linear")
        empty = add_cell(s, run, "fixed_tree", status="failed")
        add_samples(s, lin, [20.0, 21.0], warmup=1, start=3)  # stored first: prompts 3, 4
        add_samples(s, lin, [22.0], start=1)  # then prompt 1
        add_samples(s, ar, [10.0, 11.0, 12.0], warmup=1)
        s.commit()
        assert [c.label for c in loading.run_cells(s, run.id)] == ["ar", "linear", "fixed_tree"]
        assert [(c.label, x.prompt_index) for c, x in loading.cell_rows(s, run.id)] == [
            ("ar", 0),
            ("ar", 1),
            ("ar", 2),
            ("linear", 3),
            ("linear", 4),
            ("linear", 1),
        ]
        by_prompt = [x.prompt_index for c, x in loading.cell_rows(s, run.id, by_prompt=True) if c.id == lin.id]
        assert by_prompt == [1, 3, 4]
        outer = loading.cell_rows(s, run.id, outer=True)
        assert outer[-1][0].id == empty.id and outer[-1][1] is None and len(outer) == 7
        measured = [(c.label, [x.prompt_index for x in ss]) for c, ss in loading.measured_cells(s, run.id)]
        assert measured == [("ar", [1, 2]), ("linear", [4, 1])]  # warmup apart; the failed cell has none
        assert [len(ss) for _, ss in loading.cells_with_samples(s, run.id)] == [3, 3, 0]
        values = loading.sample_values(s, [lin.id, ar.id], "prompt_index")
        assert [tuple(v) for v in values] == [(ar.id, 1), (ar.id, 2), (lin.id, 4), (lin.id, 1)]
