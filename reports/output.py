"""The one output layer of the reports: a report is an object, and its formats are rendered by one registry.

A :class:`Report` carries a title, caption, notes, a display frame (strings, what people read) and a data frame
(numbers, what CSV/JSON export). The ``--format`` renderers (``table``/``markdown``/``csv``/``json``) are
registered once, in :data:`RENDERERS` (:func:`renderer`); :func:`emit_reports` renders a list of reports through
them, and :func:`emit` is the same dispatch for a report that supplies its own per-format callables (the run's cell
table, Spec-Bench views). Every path escapes through :mod:`dtbench.harness.safetext`: the markdown renderer via
:func:`~dtbench.reports.render.markdown_frame` (``markdown_cell``), the table renderer via
:func:`~dtbench.reports.render.rich_frame` (``printable``), CSV via ``to_csv`` (formula-injection guard).
:func:`stdout` is the console (a pipe or file gets the full width rather than rich's 80-column fallback).

Adding a format: register one renderer here (and, where a report overrides a format, its override).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import click
import pandas as pd
from rich.console import Console

from dtbench.harness.safetext import to_csv


@dataclass
class Report:
    """One report: what every output format draws from.

    Attributes:
        key: machine name (JSON key, file stem), e.g. ``table1_main``.
        title, caption: shown above / below the table; notes: one line each, after the caption.
        display: display strings, one column per shown column (rendered by ``table`` and ``markdown``).
        data: the numbers (rendered by ``csv`` and ``json``; :func:`~dtbench.reports.render.exported` columns).
        row_styles: optional rich style per display row (``table`` only).
    """

    key: str
    title: str
    caption: str
    display: pd.DataFrame
    data: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    row_styles: list[str | None] | None = None


#: format name -> renderer(reports) returning the text for stdout, or (``table``) a callable(console) drawing it.
RENDERERS: dict[str, Callable[[Sequence[Report]], object]] = {}


def renderer(name: str):
    """Register the renderer of output format ``name`` (a decorator); the CLI's ``--format`` choices are these."""
    def register(fn):
        RENDERERS[name] = fn
        return fn
    return register


@renderer("table")
def _table(reports: Sequence[Report]) -> Callable[[Console], None]:
    from dtbench.reports.render import rich_frame

    def draw(out: Console) -> None:
        for r in reports:
            out.print(rich_frame(r.display, r.title, "\n".join([r.caption, *r.notes]), r.row_styles))
    return draw


@renderer("markdown")
def _markdown(reports: Sequence[Report]) -> str:
    from dtbench.reports.render import markdown_frame

    return "\n".join(markdown_frame(r.display, r.title, r.caption, r.notes) for r in reports)


@renderer("csv")
def _csv(reports: Sequence[Report]) -> str:
    """One report's numbers as CSV (several reports have no one CSV: the caller refuses or writes one per report)."""
    from dtbench.reports.render import exported

    return to_csv(exported(reports[0].data)) if len(reports) == 1 else ""


@renderer("json")
def _json(reports: Sequence[Report]) -> str:
    return json.dumps({r.key: {"title": r.title, "caption": r.caption, "notes": r.notes, "rows": records(r.data)}
                       for r in reports}, indent=2)


def records(data: pd.DataFrame, **to_json) -> list[dict]:
    """A data frame's exported rows as JSON-ready records (NaN -> null); ``to_json``: pandas ``to_json`` options."""
    from dtbench.reports.render import exported

    return json.loads(exported(data).to_json(orient="records", **to_json))


FORMATS = tuple(RENDERERS)


def stdout() -> Console:
    """The console a ``table`` report draws on: the terminal's width, or 220 columns for a pipe or file."""
    return Console() if sys.stdout.isatty() else Console(width=220)


def _write(fmt: str, result) -> None:
    if fmt == "table":
        result(stdout())
    elif fmt == "csv":
        click.echo(result, nl=False)
    else:
        click.echo(result)


def emit_reports(fmt: str, reports: Sequence[Report], **overrides: Callable[[], object]) -> None:
    """Render ``reports`` in ``fmt`` with the registered renderer, unless ``overrides[fmt]`` (a callable returning
    what the renderer would: text, or for ``table`` a callable(console)) replaces it for this report.

    Raises:
        KeyError: an unregistered format (the CLI's choices are :data:`FORMATS`).
    """
    _write(fmt, overrides[fmt]() if fmt in overrides else RENDERERS[fmt](reports))


def emit(fmt: str, **make: Callable) -> None:
    """Dispatch for a report that supplies every format itself: ``table`` is callable(console) drawing rich output;
    the others (``markdown``, ``csv``, ``json``) are callables returning the text."""
    _write(fmt, make[fmt] if fmt == "table" else make[fmt]())
