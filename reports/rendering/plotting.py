"""The figure toolkit every report's figures share (matplotlib's object-oriented API, no pyplot state): the palette,
axis style, wrapped and formatted bar labels, the speedup = 1 line, PNG/SVG encoding and writing; and the
speedup-vs-batch-size figure of the cost model (issue 29)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from dtbench.harness.errors import DtbenchError
from dtbench.reports.views.paper import tps_spec

# tab10 is a ListedColormap whose colors are ten RGB triples (matplotlib's stubs: a Colormap, colors an ArrayLike)
PALETTE: tuple[tuple[float, float, float], ...] = cast(Any, colormaps["tab10"]).colors
PARTIAL_HATCH = "///"  # bars of partial cells (shown only with include_partial)


def style_axes(ax, ylabel: str, title: str) -> None:
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def wrap_label(label: str, width: int = 16) -> str:
    words, lines, cur = label.split(), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}".strip()
    return "\n".join(lines + [cur])


def as_number(v) -> float:
    return math.nan if v is None else float(v)


def bar_labels(values, spec: str | None = None) -> list[str]:
    """Bar labels; empty for a missing value (a failed cell), never "nan". No spec: throughput precision."""
    out = []
    for v in values:
        if v is None or math.isnan(float(v)):
            out.append("")
        else:
            out.append((spec or "{:" + tps_spec(float(v)) + "}").format(float(v)))
    return out


def unity_line(ax, values) -> None:
    """A dashed line at speedup 1 when it falls near the data; far from it, it would flatten the curves."""
    vals = np.asarray([float(v) for v in values], dtype=float)
    vals = vals[np.isfinite(vals)]
    if not len(vals):
        return
    lo, hi = vals.min(), vals.max()
    pad = max(0.5 * (hi - lo), 0.1 * hi)
    if lo - pad <= 1.0 <= hi + pad:
        ax.axhline(1.0, color="gray", ls="--", lw=1)


def to_bytes(fig: Figure, fmt: str, dpi: int = 150) -> bytes:
    """The figure encoded as ``png`` or ``svg``."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=dpi)
    return buf.getvalue()


def save_figures(figs: dict, outdir: str | Path) -> list[Path]:
    """Write each figure (stem -> matplotlib Figure) to ``outdir`` as ``<stem>.png`` and ``<stem>.svg``.

    Raises:
        DtbenchError: if the folder cannot be created or written.
    """
    outdir = Path(outdir)
    paths = []
    try:
        outdir.mkdir(parents=True, exist_ok=True)
        for stem, fig in figs.items():
            for fmt in ("png", "svg"):
                path = outdir / f"{stem}.{fmt}"
                path.write_bytes(to_bytes(fig, fmt))
                paths.append(path)
    except OSError as exc:
        raise DtbenchError(f"cannot write figures to {outdir}: {exc.strerror or exc}") from None
    return paths


BATCH_FIG_STEM = "speedup_vs_batch"


def speedup_vs_batch(measured: pd.DataFrame, predicted: pd.DataFrame | None = None) -> Figure | str:
    """Figure (issue 29): speedup vs batch size B per decoder, against ar at the same (dataset, L_max, T, B).

    Args:
        measured: :func:`~dtbench.reports.views.compare.speedup_table` rows (dataset, l_max, gen_length, batch_size, label,
            speedup, ci_low, ci_high): the measured speedup (solid, markers) and its 95% paired CI (a band where the
            CI exists; ``n too small`` leaves a gap).
        predicted: :func:`~dtbench.reports.pricing.costmodel_batch.batch_table` rows (label, batch_size, predicted_speedup), or
            None: the cost model's prediction (dashed).

    Returns:
        the Figure (log2 x axis; the line speedup = 1; B*, the first B with measured speedup below 1, marked with
        a vertical tick), or a one-line reason when no decoder has two batch sizes.
    """
    rows = measured[measured["speedup"].notna()] if not measured.empty else measured
    groups = [
        (k, g.sort_values("batch_size"))
        for k, g in rows.groupby(["dataset", "l_max", "gen_length", "label"], sort=False)
        if g["batch_size"].nunique() > 1
    ]
    if not groups:
        return "speedup-vs-batch figure skipped: no decoder was measured at two or more batch sizes"
    points = {(k[0], k[1], k[2]) for k, _ in groups}
    fig = Figure(figsize=(7.5, 4.6))
    ax = fig.add_subplot(1, 1, 1)
    cmap = colormaps["tab10"]
    for i, ((ds, l_max, T, label), g) in enumerate(groups):
        color = cmap(i % 10)
        name = label if len(points) == 1 else f"{label} ({ds}, L_max={l_max}, T={T})"
        x = g["batch_size"].to_numpy(dtype=float)
        ax.plot(x, g["speedup"], marker="o", color=color, label=name)
        lo, hi = g["ci_low"].to_numpy(dtype=float), g["ci_high"].to_numpy(dtype=float)
        ok = np.isfinite(lo) & np.isfinite(hi)
        if ok.any():
            ax.fill_between(x, np.where(ok, lo, np.nan), np.where(ok, hi, np.nan), color=color, alpha=0.15, linewidth=0)
        below = g[g["speedup"] < 1]
        if not below.empty:
            b_star = float(below["batch_size"].iloc[0])
            ax.plot(
                [b_star], [float(below["speedup"].iloc[0])], marker="v", markersize=11, color=color, linestyle="none"
            )
            ax.annotate(
                f"B*={int(b_star)}",
                (b_star, float(below["speedup"].iloc[0])),
                textcoords="offset points",
                xytext=(4, -14),
                fontsize=7,
                color=color,
            )
        if predicted is not None and not predicted.empty:
            p = predicted[
                (predicted["dataset"] == ds)
                & (predicted["l_max"] == l_max)
                & (predicted["gen_length"] == T)
                & (predicted["label"] == label)
            ].sort_values("batch_size")
            p = p[p["predicted_speedup"].notna()]
            if len(p):
                ax.plot(p["batch_size"], p["predicted_speedup"], linestyle="--", color=color, alpha=0.9)
    ax.axhline(1.0, color="0.4", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    sizes = sorted({int(b) for _, g in groups for b in g["batch_size"]})
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(b) for b in sizes])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("load: batch size B (prompts decoded together) or a server's requests in flight")
    style_axes(
        ax, "speedup vs ar at the same B (×)", "Speedup vs batch size (bands: 95% CI; dashed: cost model; ▼: B*)"
    )
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig
