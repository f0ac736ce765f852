"""The one output layer of the reports: a report is an object, and every format is one registered renderer.

A :class:`Report` carries a title, caption, notes, a display frame (strings, what people read) and a data frame
(numbers, what CSV/JSON export). A :class:`Document` is what one command prints: its reports, the line above them
(the run header) and the envelope of its machine-readable form (JSON keys such as ``run``, the key of its rows).
The ``--format`` renderers (``table``, ``markdown``, ``csv``, ``json``, ``html``) are entry points of the group
``dtbench.formats`` in pyproject.toml, like a plugin's, read by the one registry (:data:`FORMAT_REGISTRY`) into
:data:`RENDERERS` (the CLI's ``--format`` choices); ``FORMATS`` is the built-in ones' names. A format registered
in-process with :func:`renderer` is an entry of the same registry (issue 58 item 6).
Every report, the run's cell table included, is printed by :func:`emit`; ``--out DIR`` and ``--html FILE`` write
what the same renderers return.

Every path escapes through :mod:`dtbench.harness.safetext`: markdown via ``markdown_cell``, the terminal via
``printable`` (:func:`plain`), CSV via ``to_csv`` (formula-injection guard), HTML via ``html_text`` (control
characters made visible, then :func:`html.escape`).

Adding a format: one function taking a :class:`Document` and returning its text (``table`` returns a callable
drawing on a rich Console) and one entry point in ``dtbench.formats``. The CLI's choices, ``--help`` and every
report pick it up.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import click

from dtbench.core import clip, redact_json
from dtbench.harness.errors import DtbenchError
from dtbench.harness.measurement.metrics import MISSING
from dtbench.harness.safetext import html_text, markdown_cell, printable, to_csv
from dtbench.registry import Registry, a_callable

if TYPE_CHECKING:  # pandas and rich load when a report is rendered, not when the CLI starts
    import pandas as pd
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text


class Note(str):
    """A report note: a plain ``str`` everywhere, with an optional rich ``style`` for the terminal and HTML.

    Example: ``Note("linear failed: ...", "red")``; a bare ``str`` note has no style.
    """

    style: str | None

    def __new__(cls, text: str, style: str | None = None) -> Note:
        note = super().__new__(cls, text)
        note.style = style
        return note


def style_of(note: str) -> str | None:
    """The rich style of a note (None for a plain ``str``)."""
    return getattr(note, "style", None)


@dataclass
class Report:
    """One report: what every output format draws from.

    Attributes:
        key: machine name (JSON key, file stem), e.g. ``table1_main``.
        title, caption: shown above / below the table; notes: one line each, after the caption (:class:`Note` for a
            styled one).
        display: display strings, one column per shown column (rendered by ``table``, ``markdown`` and ``html``).
        data: the numbers (rendered by ``csv`` and ``json``; columns renamed by :func:`exported`).
        row_styles: optional rich style per display row (``table``; ``html`` as a row class).
        left: display columns aligned left; None: text columns left, numeric ones right (:func:`is_left`).
    """

    key: str
    title: str
    caption: str
    display: pd.DataFrame
    data: pd.DataFrame
    notes: Sequence[str] = field(default_factory=list)
    row_styles: list[str | None] | None = None
    left: frozenset[str] | None = None


@dataclass
class Document:
    """What one command prints, in any format: its reports and the envelope around them.

    Attributes:
        reports: the reports, in order.
        header: the text above the reports (``table``, ``markdown``, ``html``; e.g. the run line), "" for none.
        meta: JSON keys written before the rows (``{"run": 3, "confidence": 0.95}``).
        rows: the JSON key of the rows (``"cells"``): JSON is ``{**meta, rows: [...]}``; None: one JSON object per
            report, by its key, with its title, caption, notes and rows.
        data: the machine-readable rows when the document is one table (CSV; JSON under ``rows``); None: the reports'
            data frames, concatenated.
        precision: significant digits of floats in JSON (pandas' ``double_precision``, at most 15).
        title: the HTML page's title (default: the first report's).
    """

    reports: list[Report]
    header: str = ""
    meta: dict = field(default_factory=dict)
    rows: str | None = None
    data: pd.DataFrame | None = None
    precision: int = 10
    title: str = ""

    def frame(self) -> pd.DataFrame:
        """The machine-readable rows: :attr:`data`, or every report's data frame, concatenated.

        Raises:
            DtbenchError: several reports whose data frames have different columns (they make no one table).
        """
        import pandas as pd

        if self.data is not None:
            return self.data
        frames = [r.data for r in self.reports]
        if len({tuple(f.columns) for f in frames}) > 1:
            raise DtbenchError(
                "these reports have different columns and make no one CSV table: "
                + ", ".join(r.key for r in self.reports)
            )
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


Renderer = Callable[["Document"], object]  # a Document -> text for stdout, or (``table``) a callable(console)

FORMATS_GROUP = "dtbench.formats"  # the entry-point group of report formats, built-in and third-party (issue 40 item 4)
FORMAT_REGISTRY: Registry[Renderer] = Registry(
    FORMATS_GROUP, "report format", a_callable("a renderer function (Document -> text)")
)

#: format name -> renderer: the registry's usable formats once loaded (:func:`load_format_plugins`; built-ins first,
#: sorted), those registered in-process with :func:`renderer` among them.
RENDERERS: dict[str, Renderer] = {}
_WARNED: set[str] = set()  # problem lines already returned by load_format_plugins (each is warned once)


def load_format_plugins() -> list[str]:
    """Load every report format registered under the ``dtbench.formats`` entry-point group into :data:`RENDERERS`.

    An entry point names a renderer function (``tsv = "my_pkg.formats:render_tsv"``), registered under the entry
    point's name by the one :class:`~dtbench.registry.Registry` policy: dtbench's own formats are entry points too, a
    built-in name is never taken over (a plugin claiming one is refused), two distributions claiming one name make it
    ambiguous, ``DTBENCH_DISABLE_PLUGINS=1`` keeps the built-ins. The group is scanned once per process (while
    ``sys.path`` stays the same; issue 58 item 6), each entry point imported once.

    Returns:
        One line per unusable registration (refused, ambiguous, or failed to load), each returned once per process
        (the caller warns with them); the others are registered.
    """
    loaded, problems = FORMAT_REGISTRY.load_all()
    RENDERERS.update(loaded)
    new = [p for p in problems if p not in _WARNED]
    _WARNED.update(new)
    return new


def load_builtin_format(name: str) -> bool:
    """Load the built-in format ``name`` alone into :data:`RENDERERS` (no plugin imported; a report in a built-in
    format needs none). Returns whether ``name`` is a built-in format; False leaves :data:`RENDERERS` unchanged."""
    entry = FORMAT_REGISTRY.scan().entries.get(name)
    if entry is None or not entry.builtin:
        return False
    RENDERERS.setdefault(name, FORMAT_REGISTRY.load(entry))
    return True


def builtin_formats() -> tuple[str, ...]:
    """dtbench's own formats, sorted by name (``csv``, ``html``, ``json``, ``markdown``, ``table``)."""
    return tuple(name for name, entry in FORMAT_REGISTRY.scan().entries.items() if entry.builtin)


def renderer(name: str) -> Callable[[Renderer], Renderer]:
    """Register the renderer of output format ``name`` in this process (a decorator): an entry of
    :data:`FORMAT_REGISTRY` (:meth:`~dtbench.registry.Registry.register`, listed by ``dtbench plugins``; issue 58
    item 6) and a ``--format`` choice (:data:`RENDERERS`). A package registers its formats with entry points instead
    (docs/plugins.md).

    Raises:
        DtbenchError: ``name`` is a built-in format's (never taken over), or ``fn`` is not a function.
    """

    def register(fn: Renderer) -> Renderer:
        FORMAT_REGISTRY.register(name, fn)
        if name in FORMAT_REGISTRY.scan().entries:
            RENDERERS[name] = fn
        else:  # a plugin claims the name too: ambiguous, no choice (load_format_plugins names both)
            RENDERERS.pop(name, None)
        return fn

    return register


def __getattr__(name: str) -> object:
    """``FORMATS``: the built-in formats' names (read from the registry when asked, not at import)."""
    if name == "FORMATS":
        load_format_plugins()
        return builtin_formats()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- frames of display strings ---------------------------------------------------------------------------------


def plain(value, lines: bool = False) -> Text:
    """A rich table's cell, title or caption from data: not parsed as rich markup (a label ``[/x]`` would fail the
    report), control characters escaped (:func:`~dtbench.harness.safetext.printable`; with ``lines``, a caption's
    own line breaks kept)."""
    from rich.text import Text

    text = str(value)
    return Text("\n".join(printable(line) for line in text.split("\n")) if lines else printable(text))


def is_left(values) -> bool:
    """Whether a display column reads left-aligned: not every value is a number (or a dash)."""
    return not all(isinstance(v, (int, float)) or (isinstance(v, str) and v[:1] in "0123456789+-—.") for v in values)


def _left(report: Report, column) -> bool:
    return column in report.left if report.left is not None else is_left(report.display[column])


def rich_frame(report: Report) -> Table:
    """A rich Table of a report's display frame, title and caption (text columns left-aligned, numbers right)."""
    from rich.table import Table

    display = report.display
    table = Table(
        title=plain(report.title),
        caption=plain(report.caption, lines=True) if report.caption else None,
        caption_justify="left",
    )
    for col in display.columns:
        table.add_column(plain(col), justify="left" if _left(report, col) else "right")
    for i, (_, row) in enumerate(display.iterrows()):
        style = report.row_styles[i] if report.row_styles else None
        table.add_row(*("" if v is None else plain(v) for v in row), style=style)
    return table


def markdown_frame(report: Report, level: int = 3) -> str:
    """GitHub Markdown of a report: a heading, the display frame as a table, its caption, its notes as a list."""
    display = report.display
    parts = [f"{'#' * level} {markdown_cell(report.title)}\n"] if report.title else []
    parts.append("| " + " | ".join(markdown_cell(c) for c in display.columns) + " |")
    parts.append("|" + "|".join("---" if _left(report, c) else "---:" for c in display.columns) + "|")
    for _, row in display.iterrows():
        parts.append("| " + " | ".join(markdown_cell(v) for v in row) + " |")
    if report.caption:
        parts.append(f"\n{markdown_cell(report.caption)}")
    if report.notes:
        parts += [""] + [f"- {markdown_cell(n)}" for n in report.notes]
    parts.append("")
    return "\n".join(parts)


# Column names of the machine-readable outputs (CSV and JSON of every report) that differ from the frames': L_max
# keeps the name these outputs have always used, so scripts that read them keep working.
EXPORT_NAMES = {"l_max": "prompt_cap"}


def exported(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with its columns named as the CSV/JSON outputs name them (:data:`EXPORT_NAMES`)."""
    return frame.rename(columns=EXPORT_NAMES)


def records(data: pd.DataFrame, precision: int = 10) -> list[dict]:
    """A data frame's exported rows as JSON-ready records (NaN -> null; nested lists and dicts kept); floats to
    ``precision`` significant digits (pandas ``to_json``'s ``double_precision``)."""
    return json.loads(exported(data).to_json(orient="records", double_precision=precision, default_handler=str))


def flat(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` as CSV holds it: a list value as its items joined by ``;`` (floats to 6 significant digits), a dict
    value (a cell's params or sampling settings) as compact JSON text with sorted keys; scalars unchanged."""

    def cell(v):
        if isinstance(v, (list, tuple)):
            return ";".join(f"{x:.6g}" if isinstance(x, float) else str(x) for x in v)
        if isinstance(v, dict):
            return json.dumps(v, sort_keys=True, separators=(",", ":"), default=str)
        return v

    out = frame.copy()
    for c in out.columns:
        if out[c].map(lambda v: isinstance(v, (list, tuple, dict))).any():
            out[c] = out[c].map(cell)
    return out


# --- the registered formats ------------------------------------------------------------------------------------


def render_table(doc: Document) -> Callable[[Console], None]:
    """The terminal: the header, then each report as a rich table with its notes below it in their styles."""

    def draw(out: Console) -> None:
        if doc.header:
            out.print(printable_lines(doc.header), markup=False, highlight=False)
        for r in doc.reports:
            out.print(rich_frame(r))
            for n in r.notes:
                out.print(printable(n), style=style_of(n), markup=False, highlight=False)

    return draw


def printable_lines(text: str) -> str:
    """``text`` with control characters escaped line by line (its own line breaks kept)."""
    return "\n".join(printable(line) for line in text.split("\n"))


def render_markdown(doc: Document) -> str:
    head = "".join(f"{markdown_cell(line)}\n\n" for line in doc.header.split("\n")) if doc.header else ""
    return head + "\n".join(markdown_frame(r) for r in doc.reports)


def render_csv(doc: Document) -> str:
    """The document's rows as one CSV table (:meth:`Document.frame`, :func:`flat`)."""
    return to_csv(flat(exported(doc.frame())))


def render_json(doc: Document) -> str:
    if doc.rows is not None:
        body = {**doc.meta, doc.rows: records(doc.frame(), doc.precision)}
    else:
        body = {
            **doc.meta,
            **{
                r.key: {
                    "title": r.title,
                    "caption": r.caption,
                    "notes": list(map(str, r.notes)),
                    "rows": records(r.data, doc.precision),
                }
                for r in doc.reports
            },
        }
    return json.dumps(
        redact_json(body, by_value=False), indent=2, default=str
    )  # URL credentials masked, as on every other path


# --- HTML --------------------------------------------------------------------------------------------------------

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px;
       color: #222; line-height: 1.4; padding: 0 1rem; }
h1 { font-size: 1.6rem; } h2 { margin-top: 2.2rem; border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
table { border-collapse: collapse; margin: .6rem 0; font-size: .85rem; }
th, td { border: 1px solid #ccc; padding: .25rem .55rem; text-align: right; }
th { background: #f3f3f3; } th.l, td.l { text-align: left; } td:not(.l) { white-space: nowrap; }
p.caption { font-size: .85rem; color: #555; max-width: 100%; }
p.note { font-size: .8rem; color: #777; font-style: italic; }
figure { margin: 1rem 0 2rem; } figure img { max-width: 100%; border: 1px solid #eee; }
code { background: #f5f5f5; padding: 0 .2rem; }
.red, .note.red { color: #b00020; } .yellow, .note.yellow { color: #8a6d00; } .green, .note.green { color: #1b7f2a; }
.cyan, .note.cyan { color: #00707a; } .magenta, .note.magenta { color: #8b1c8b; } .dim, .note.dim { color: #999; }
.bold { font-weight: bold; }
"""


def _css_class(style: str | None) -> str:
    """A rich style (``"bold red"``) as the CSS classes above (``bold red``); "" for none."""
    return " ".join(w for w in (style or "").split() if re.fullmatch(r"[a-z]+", w))


def html_table(report: Report) -> str:
    """A report's display frame as an HTML table: every value escaped, text columns classed ``l`` (left-aligned),
    rows classed by their style."""
    e = html_text
    cols = list(report.display.columns)
    cells = [_class_attr("l" if _left(report, c) else "") for c in cols]
    out = [
        "<table>",
        "<thead><tr>" + "".join(f"<th{a}>{e(str(c))}</th>" for a, c in zip(cells, cols)) + "</tr></thead>",
        "<tbody>",
    ]
    for i, (_, row) in enumerate(report.display.iterrows()):
        cls = _class_attr(_css_class(report.row_styles[i]) if report.row_styles else "")
        out.append(f"<tr{cls}>" + "".join(f"<td{a}>{e(_html_value(v))}</td>" for a, v in zip(cells, row)) + "</tr>")
    out += ["</tbody>", "</table>"]
    return "\n".join(out)


def _class_attr(classes: str) -> str:
    return f" class='{classes}'" if classes else ""


def _html_value(v) -> str:
    return MISSING if v is None or (isinstance(v, float) and v != v) else str(v)


def html_section(report: Report, level: int = 3) -> str:
    """One report as HTML: its title as a heading, the table, the caption, the notes (styled where they are)."""
    e = html_text
    parts = [f"<h{level}>{e(report.title)}</h{level}>"] if report.title else []
    parts.append(html_table(report))
    if report.caption:
        parts.append(f"<p class='caption'>{e(report.caption)}</p>")
    parts += [html_note(n) for n in report.notes]
    return "\n".join(parts)


def html_note(note: str) -> str:
    """A note as an HTML paragraph (its style as classes)."""
    return f"<p class='{' '.join(['note', *_css_class(style_of(note)).split()])}'>{html_text(note)}</p>"


def html_page(title: str, body: Sequence[str], intro: str = "") -> str:
    """A self-contained HTML document (inline CSS, no scripts or external files) around the ``body`` fragments."""
    e = html_text
    return "\n".join(
        [
            f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{e(title)}</title>",
            f"<style>{CSS}</style></head><body>",
            f"<h1>{e(title)}</h1>",
            f"<p class='caption'>Generated {datetime.now(UTC):%Y-%m-%d %H:%M UTC} from the results database."
            f"{' ' + intro if intro else ''}</p>",
            *body,
            "</body></html>",
        ]
    )


def render_html(doc: Document) -> str:
    """One self-contained HTML page: the header, then every report (``dtbench report --format html > run.html``)."""
    header = [f"<p class='caption'>{html_text(line)}</p>" for line in doc.header.split("\n") if line]
    title = doc.title or (doc.reports[0].title if doc.reports else "dtbench report")
    return html_page(f"dtbench — {title}", [*header, *(html_section(r) for r in doc.reports)])


# --- writing --------------------------------------------------------------------------------------------------


def stdout() -> Console:
    """The console a ``table`` report draws on: the terminal's width, or 220 columns for a pipe or file."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=220)


def rendered(fmt: str, doc: Document | Sequence[Report]) -> object:
    """What the renderer of ``fmt`` returns for ``doc`` (a Document, or a list of reports with no envelope).

    Raises:
        KeyError: an unregistered format (the CLI's choices are :data:`RENDERERS`' keys).
        DtbenchError: the reports make no one table for ``csv`` (:meth:`Document.frame`); a plugin's renderer
            raised or returned something other than text (one line naming the plugin; issue 59 item 8).
    """
    if fmt not in RENDERERS:
        load_format_plugins()  # the registry's formats, loaded at the first use
    render = RENDERERS[fmt]
    doc = doc if isinstance(doc, Document) else Document(list(doc))
    if (
        getattr(render, "__module__", None) == __name__
    ):  # dtbench's own: its errors are dtbench's (``table``: a callable)
        return render(doc)
    try:
        result = render(doc)
    except DtbenchError:
        raise
    except Exception as exc:  # a plugin's failure is the plugin's, named in one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise DtbenchError(f"{_origin(fmt)} failed: {type(exc).__name__}: {clip(first, 200)}") from None
    if not isinstance(result, str):
        raise DtbenchError(f"{_origin(fmt)} returned {type(result).__name__}, not text (a renderer returns a str)")
    return result


def _origin(fmt: str) -> str:
    """A plugin's format as messages name it: with its distribution, or registered in-process (:func:`renderer`)."""
    entry = FORMAT_REGISTRY.scan().entries.get(fmt)
    where = (
        f"from distribution {entry.label}" if entry is not None and not entry.in_process else "(registered in-process)"
    )
    return f"report format '{clip(fmt, 80)}' {where}"


def emit(fmt: str, doc: Document | Sequence[Report]) -> None:
    """Print ``doc`` in ``fmt`` on stdout (``table``: drawn on :func:`stdout`'s console).

    Raises:
        KeyError, DtbenchError: as :func:`rendered`.
    """
    result = rendered(fmt, doc)
    if callable(result):
        result(stdout())
    else:
        click.echo(result, nl=not str(result).endswith("\n"))
