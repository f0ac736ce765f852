"""One self-contained HTML report: run metadata, the paper's tables, speedup confidence intervals, the
figures (inline base64 SVG, no external files or scripts) and every cell's summary."""

from __future__ import annotations

import base64
import html
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from dtbench.harness.errors import DtbenchError
from dtbench.reports import render
from dtbench.reports.compare import SPEEDUP_CI_METHOD
from dtbench.reports.figures import build_figures, to_bytes
from dtbench.reports.paper import paper_tables

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px;
       color: #222; line-height: 1.4; padding: 0 1rem; }
h1 { font-size: 1.6rem; } h2 { margin-top: 2.2rem; border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
table { border-collapse: collapse; margin: .6rem 0; font-size: .85rem; }
th, td { border: 1px solid #ccc; padding: .25rem .55rem; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
p.caption { font-size: .85rem; color: #555; max-width: 100%; }
p.note { font-size: .8rem; color: #777; font-style: italic; }
figure { margin: 1rem 0 2rem; } figure img { max-width: 100%; border: 1px solid #eee; }
code { background: #f5f5f5; padding: 0 .2rem; }
"""


def _table(display: pd.DataFrame) -> str:
    return display.to_html(index=False, escape=True, border=0, na_rep="—")


def _meta(runs) -> pd.DataFrame:
    rows = []
    for r in runs:
        env = r.environment or {}
        rows.append({"run": r.id, "suite": r.suite_name, "status": r.status,
                     "started": str(r.started_at)[:19], "finished": str(r.finished_at)[:19] if r.finished_at else "—",
                     "device": env.get("device_name"), "dtbench": env.get("dtbench"), "torch": env.get("torch"),
                     "transformers": env.get("transformers"), "git": (env.get("git_sha") or "")[:10],
                     "target": (env.get("target") or {}).get("model"), "draft": (env.get("draft") or {}).get("model"),
                     "hardware": render.hardware_text(env) or "—"})
    return pd.DataFrame(rows)


def build_html(summary: pd.DataFrame, runs, speedups: dict[int, pd.DataFrame] | None = None,
               confidence: float = 0.95, include_partial: bool = False) -> str:
    """The report as one HTML document.

    Args:
        summary: :func:`~dtbench.reports.summary.combined_summary` of the runs.
        runs: the Run rows (metadata; the hardware flags of ``environment["hardware"]`` where recorded).
        speedups: per run id, :func:`~dtbench.reports.compare.speedup_table` (optional section).
        confidence: the level those intervals were computed at (for the column heading).
        include_partial: show partial cells' numbers in the paper tables and figures (always in "Every cell").
    """
    e = html.escape
    ids = ", ".join(str(r.id) for r in runs)
    out = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>dtbench report — run {e(ids)}</title>",
           f"<style>{CSS}</style></head><body>",
           f"<h1>dtbench report — run {e(ids)}</h1>",
           f"<p class='caption'>Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} from the results database. "
           "Throughput in tokens/s; times in ms; memory in MiB (2<sup>20</sup> bytes). Means and standard deviations "
           "exclude the warmup prompts (paper section 4.1); the Lossless column counts every sample, warmup included. "
           "A <em>partial</em> cell failed after some prompts: its numbers come from those prompts only and the paper "
           "tables and figures leave them out unless --include-partial.</p>",
           "<h2>Runs</h2>", _table(_meta(runs))]
    tables, skipped = paper_tables(summary, include_partial)
    out.append("<h2>Paper tables</h2>")
    for t in tables:
        out += [f"<h3>{e(t.title)}</h3>", _table(t.display), f"<p class='caption'>{e(t.caption)}</p>"]
        out += [f"<p class='note'>{e(n)}</p>" for n in t.notes]
    out += [f"<p class='note'>{e(n)}</p>" for n in skipped]
    if speedups:
        out.append("<h2>Speedup vs AR with confidence intervals</h2>")
        for run_id, table in speedups.items():
            if table.empty:
                continue
            out += [f"<h3>run {run_id}</h3>", _table(render.speedup_display(table, confidence)),
                    f"<p class='caption'>Speedup = mean throughput / mean AR throughput of the same dataset, L_max and T; "
                    f"{e(SPEEDUP_CI_METHOD)}.</p>"]
    figs, notes = build_figures(summary, include_partial)
    out.append("<h2>Figures</h2>")
    for stem, fig in figs.items():
        svg = base64.b64encode(to_bytes(fig, "svg")).decode()
        out.append(f"<figure><img alt='{e(stem)}' src='data:image/svg+xml;base64,{svg}'>"
                   f"<figcaption><code>{e(stem)}</code></figcaption></figure>")
    out += [f"<p class='note'>{e(n)}</p>" for n in notes]
    out.append("<h2>Every cell</h2>")
    for key, group in summary.groupby(["dataset", "l_max", "gen_length"], sort=False):
        disp = pd.DataFrame([{h: render.formatted(row)[c] for h, c in render.COLUMNS} for _, row in group.iterrows()])
        out += [f"<h3>{e(key[0])} · L_max {key[1]} · T={key[2]}</h3>", _table(disp)]
        out += [f"<p class='note'>{e(n)}</p>" for _, row in group.iterrows() for n in render.cell_notes(row)]
    out.append("</body></html>")
    return "\n".join(out)


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
