"""One self-contained HTML report (``--html FILE``): run metadata, the paper's tables, speedup confidence intervals,
the figures (inline base64 SVG, no external files or scripts) and every cell's summary. Tables, notes and the page
are drawn by the ``html`` renderer's pieces (:mod:`dtbench.reports.rendering.output`), so a report reads the same here as
with ``--format html``."""

from __future__ import annotations

import base64
from pathlib import Path

import pandas as pd

from dtbench.harness.errors import DtbenchError
from dtbench.harness.measurement.metrics import MISSING
from dtbench.harness.safetext import html_text
from dtbench.reports.rendering import render
from dtbench.reports.rendering.output import Report, html_note, html_page, html_section, html_table
from dtbench.reports.rendering.plotting import to_bytes
from dtbench.reports.views.compare import SPEEDUP_CI_METHOD
from dtbench.reports.views.figures import build_figures
from dtbench.reports.views.paper import paper_tables


def _meta(runs) -> pd.DataFrame:
    rows = []
    for r in runs:
        env = r.environment or {}
        rows.append(
            {
                "run": r.id,
                "suite": r.suite_name,
                "status": r.status,
                "started": str(r.started_at)[:19],
                "finished": str(r.finished_at)[:19] if r.finished_at else MISSING,
                "device": env.get("device_name"),
                "dtbench": env.get("dtbench"),
                "torch": env.get("torch"),
                "transformers": env.get("transformers"),
                "git": (env.get("git_sha") or "")[:10],
                "target": (env.get("target") or {}).get("model"),
                "draft": (env.get("draft") or {}).get("model"),
                "hardware": render.hardware_text(env) or MISSING,
            }
        )
    return pd.DataFrame(rows)


def build_html(
    summary: pd.DataFrame,
    runs,
    speedups: dict[int, pd.DataFrame] | None = None,
    confidence: float = 0.95,
    include_partial: bool = False,
    extra_figures: dict | None = None,
) -> str:
    """The report as one HTML document.

    Args:
        summary: :func:`~dtbench.reports.views.summary.combined_summary` of the runs.
        runs: the Run rows (metadata; the hardware flags of ``environment["hardware"]`` where recorded).
        speedups: per run id, :func:`~dtbench.reports.views.compare.speedup_table` (optional section).
        confidence: the level those intervals were computed at (for the column heading).
        include_partial: show partial cells' numbers in the paper tables and figures (always in "Every cell").
        extra_figures: more figures (stem -> matplotlib Figure) shown after the paper's, e.g. the speedup-vs-batch
            figure (:func:`~dtbench.reports.pricing.costmodel_batch.batch_figures`).
    """
    e = html_text
    ids = ", ".join(str(r.id) for r in runs)
    intro = (
        "Throughput in tokens/s; times in ms; memory in MiB (2<sup>20</sup> bytes). Means and standard deviations "
        "exclude the warmup prompts (paper section 4.1); the Lossless column counts every sample, warmup included. "
        "A <em>partial</em> cell failed after some prompts: its numbers come from those prompts only and the paper "
        "tables and figures leave them out unless --include-partial."
    )
    meta = _meta(runs)
    out = ["<h2>Runs</h2>", html_table(Report("runs", "", "", meta, meta))]
    every = summary  # "Every cell" shows every batch size; the paper's tables and figures are its B = 1 protocol
    if "batch_size" in summary:
        summary = summary[summary["batch_size"] == 1].reset_index(drop=True)
    if "execution" in summary:  # the paper's sections read eager cells (compiled ones: report --execution)
        summary = summary[summary["execution"] != "compiled"].reset_index(drop=True)
    tables, skipped = paper_tables(summary, include_partial)
    out.append("<h2>Paper tables</h2>")
    out += [html_section(t) for t in tables]
    out += [html_note(n) for n in skipped]
    if speedups:
        out.append("<h2>Speedup vs AR with confidence intervals</h2>")
        caption = (
            "Speedup = mean throughput / mean AR throughput of the same dataset, L_max, T and batch size B (at "
            "B > 1 per prompt group, throughput over all its rows); "
            f"{SPEEDUP_CI_METHOD}."
        )
        out += [
            html_section(
                Report(
                    f"speedups_{run_id}",
                    f"run {run_id}",
                    caption,
                    render.speedup_display(table, confidence),
                    table,
                    row_styles=[render.verdict_style(v) for v in table["verdict"]],
                )
            )
            for run_id, table in speedups.items()
            if not table.empty
        ]
    figs, notes = build_figures(summary, include_partial)
    figs = {**figs, **(extra_figures or {})}
    out.append("<h2>Figures</h2>")
    for stem, fig in figs.items():
        svg = base64.b64encode(to_bytes(fig, "svg")).decode()
        out.append(
            f"<figure><img alt='{e(stem)}' src='data:image/svg+xml;base64,{svg}'>"
            f"<figcaption><code>{e(stem)}</code></figcaption></figure>"
        )
    out += [html_note(n) for n in notes]
    out.append("<h2>Every cell</h2>")  # the reports `dtbench report` prints (render.cell_reports)
    out += [html_section(r) for r in render.cell_reports(every)]
    return html_page(f"dtbench report — run {ids}", out, intro)


def write_html(path: str | Path, document: str) -> Path:
    """Write the document; raise DtbenchError (one line) if the file cannot be written."""
    path = Path(path)
    try:
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(document, encoding="utf-8")
    except OSError as exc:
        raise DtbenchError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path
