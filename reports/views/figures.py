"""The DynaTree paper's figures (Figures 3-8 of the DynaTree paper, docs/architecture.md "The paper") drawn from the results database.

Each figure is built from a per-cell summary (:func:`~dtbench.reports.views.summary.combined_summary`) with
matplotlib's object-oriented API (``matplotlib.figure.Figure``, no pyplot state: PNG through the Agg canvas,
SVG through the SVG canvas), so it works headless and never touches a user's interactive backend. A figure
whose data the runs do not hold is skipped with a one-line note, never an error.

| file stem | paper | data it needs |
|---|---|---|
| fig3_throughput_speedup | Figure 3 | the main tables' methods (:mod:`dtbench.reports.views.paper`) |
| fig4_ablation | Figure 4 | >= 2 non-sweep tree variants (Table 4) |
| fig5_length_scaling | Figure 5 | non-sweep decoders at >= 2 generation lengths T on one dataset and cap |
| fig6_dynatree_sensitivity | Figure 6 | >= 2 configurations of a dynamic tree (sweep: tau_h/tau_l, b_min/b_max, d0/d_max) |
| fig7_fixed_tree_sweep | Figure 7 | >= 2 configurations of a static tree (sweep: depth D, branching B, tau) |
| fig8_prompt_length | Figure 8 | non-sweep decoders at >= 2 prompt caps L_max on one dataset at the main T |

Figures 6 and 7 read capabilities and params, never decoder names: their cells are tree-family cells
(``family: tree``) whose params hold the figure's axes (:data:`DYNAMIC_TREE_PARAMS`, :data:`STATIC_TREE_PARAMS`), of
the one decoder with the most such cells, so a plugin tree decoder with those params is drawn like the built-ins.

Partial cells (failed after some prompts were measured) are left out of every figure, with a note, unless
``include_partial``; then their bars in Figures 3 and 4 are hatched and a note names them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from dtbench.reports.rendering.plotting import (
    PALETTE,
    PARTIAL_HATCH,
    as_number,
    bar_labels,
    save_figures,
    style_axes,
    unity_line,
    wrap_label,
)
from dtbench.reports.stats import BASELINE
from dtbench.reports.views.paper import Setting, ablation, main_setting, methods, non_sweep, prepare
from dtbench.reports.views.summary import lossless_failed

# The params a figure's axes need (the paper's names for them: DynaTree's thresholds and bounds, the fixed tree's D/B/tau).
DYNAMIC_TREE_PARAMS = ("tau_h", "tau_l", "b_min", "b_max", "d0", "d_max")
STATIC_TREE_PARAMS = ("depth", "branching", "tau")

# --- Figure 3 -----------------------------------------------------------------------------------------------


def figure3(summary: pd.DataFrame, setting: Setting) -> Figure | str:
    """Figure 3: throughput (tokens/s, mean ± std) and speedup vs AR per method, one bar per dataset."""
    ms, _ = methods(summary, setting)
    if not ms:
        return "Figure 3 skipped: no decoder measured on every dataset of the main setting"
    datasets = list(setting.l_maxes)
    fig = Figure(figsize=(max(8, 1.6 * len(ms) * 2), 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    x = np.arange(len(ms))
    width = 0.8 / len(datasets)
    for j, ds in enumerate(datasets):
        off = x - 0.4 + width * (j + 0.5)
        thr = [as_number(m.cells[ds]["throughput_mean"]) for m in ms]
        std = [as_number(m.cells[ds]["throughput_std"]) for m in ms]
        spd = [as_number(m.cells[ds]["speedup"]) for m in ms]
        lbl = f"{ds} (L_max={setting.l_maxes[ds]})"
        hatch = [PARTIAL_HATCH if bool(m.cells[ds].get("partial", False)) else None for m in ms]
        mark = ["\npartial" if h else "" for h in hatch]
        bars = axes[0].bar(
            off, thr, width, yerr=np.nan_to_num(std), capsize=3, label=lbl, color=PALETTE[j], hatch=hatch
        )
        axes[0].bar_label(
            bars,
            labels=[t + m if t else t for t, m in zip(bar_labels(thr), mark)],
            fontsize=7,
            label_type="center",
            color="white",
        )
        bars = axes[1].bar(off, spd, width, label=lbl, color=PALETTE[j], hatch=hatch)
        axes[1].bar_label(
            bars, labels=[t + m if t else t for t, m in zip(bar_labels(spd, "{:.2f}×"), mark)], fontsize=7, padding=2
        )
    axes[1].axhline(1.0, color="gray", ls="--", lw=1)
    for ax in axes:
        ax.set_xticks(x, [wrap_label(m.name) for m in ms], fontsize=8)
    style_axes(axes[0], "throughput (tokens/s)", "(a) throughput, mean ± std over prompts")
    style_axes(axes[1], "speedup vs AR (×)", "(b) speedup")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Figure 3 — throughput and speedup across datasets (T={setting.T})", fontsize=11)
    return fig


# --- Figure 4 -----------------------------------------------------------------------------------------------


def figure4(summary: pd.DataFrame, setting: Setting) -> Figure | str:
    """Figure 4: ablation progression — throughput and #Iter (left), tokens/iteration L and acceptance (right)."""
    ds, rows = ablation(summary, setting)
    if ds is None:
        return "Figure 4 skipped: fewer than two non-sweep tree variants at the main setting"
    labels = [wrap_label(lbl, 18) for lbl in rows["label"]]
    x = np.arange(len(rows))
    fig = Figure(figsize=(max(10, 1.5 * len(rows) * 2), 4.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    hatch = [PARTIAL_HATCH if bool(r.get("partial", False)) else None for _, r in rows.iterrows()]
    bars = left.bar(
        x,
        rows["throughput_mean"].astype(float),
        0.6,
        yerr=np.nan_to_num(rows["throughput_std"].astype(float)),
        capsize=3,
        color=PALETTE[0],
        label="throughput",
        hatch=hatch,
    )
    left.bar_label(bars, labels=bar_labels(rows["throughput_mean"]), fontsize=7, label_type="center", color="white")
    twin = left.twinx()
    twin.plot(x, rows["iterations"].astype(float), "o-", color=PALETTE[3], label="#Iter.")
    twin.set_ylabel("#Iter. (verifications)", color=PALETTE[3])
    bars = right.bar(x, rows["tokens_per_iteration"].astype(float), 0.6, color=PALETTE[2], label="L̄", hatch=hatch)
    right.bar_label(
        bars, labels=bar_labels(rows["tokens_per_iteration"], "{:.2f}"), fontsize=7, label_type="center", color="white"
    )
    twin2 = right.twinx()
    twin2.plot(x, 100 * rows["acceptance_rate"].astype(float), "s-", color=PALETTE[1], label="acceptance")
    twin2.set_ylabel("acceptance (%)", color=PALETTE[1])
    for ax in (left, right):
        ax.set_xticks(x, labels, fontsize=8)
    style_axes(left, "throughput (tokens/s)", "throughput (bars) and #Iter. (line)")
    style_axes(right, "tokens per iteration L̄", "L̄ (bars) and acceptance (line)")
    fig.suptitle(f"Figure 4 — ablation progression ({ds}, L_max={setting.l_maxes[ds]}, T={setting.T})", fontsize=11)
    return fig


# --- Figures 5 and 8: one axis varies ------------------------------------------------------------------------


def _lines(ax, cells: pd.DataFrame, axis: str, metric: str, scale: float = 1.0) -> None:
    for i, (label, grp) in enumerate(cells.groupby("label", sort=False)):
        grp = grp.sort_values(axis)
        y = grp[metric].astype(float) * scale
        if y.notna().sum() == 0:
            continue
        ax.plot(grp[axis], y, "o-", color=PALETTE[i % len(PALETTE)], label=label, ms=4)


def figure5(summary: pd.DataFrame, setting: Setting) -> Figure | str:
    """Figure 5: sequence-length scaling — throughput, L̄, ℓ̄ and acceptance vs T (one dataset and cap)."""
    base = non_sweep(summary)
    best, cells = None, base.iloc[0:0]
    for (ds, l_max), grp in base.groupby(["dataset", "l_max"], sort=False):
        if grp["gen_length"].nunique() > max(1, cells["gen_length"].nunique() if len(cells) else 1):
            best, cells = (ds, l_max), grp
    if best is None:
        return "Figure 5 skipped: no dataset has non-sweep cells at two or more generation lengths T"
    keep = cells.groupby("label")["gen_length"].transform("nunique") >= 2
    cells = cells[keep]
    fig = Figure(figsize=(12, 7.5), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    for ax, (metric, scale, ylabel, title) in zip(
        axes,
        [
            ("throughput_mean", 1, "throughput (tokens/s)", "(a) throughput"),
            ("tokens_per_iteration", 1, "tokens per iteration L̄", "(b) tokens per iteration"),
            ("mean_path_length", 1, "committed path length ℓ̄", "(c) path length before the bonus token"),
            ("acceptance_rate", 100, "acceptance (%)", "(d) acceptance rate"),
        ],
    ):
        _lines(ax, cells, "gen_length", metric, scale)
        style_axes(ax, ylabel, title)
        ax.set_xlabel("generation length T (tokens)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Figure 5 — sequence length scaling ({best[0]}, L_max={best[1]})", fontsize=11)
    return fig


def figure8(summary: pd.DataFrame, setting: Setting) -> Figure | str:
    """Figure 8: prompt-length sensitivity — throughput and speedup vs the prompt cap L_max at the main T."""
    base = non_sweep(summary)
    base = base[base["gen_length"] == setting.T]
    best, cells = None, base.iloc[0:0]
    for ds, grp in base.groupby("dataset", sort=False):
        if grp["l_max"].nunique() > max(1, cells["l_max"].nunique() if len(cells) else 1):
            best, cells = ds, grp
    if best is None:
        return f"Figure 8 skipped: no dataset has non-sweep cells at two or more prompt caps (T={setting.T})"
    cells = cells[cells.groupby("label")["l_max"].transform("nunique") >= 2]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    a, b = fig.subplots(1, 2)
    _lines(a, cells, "l_max", "throughput_mean")
    _lines(b, cells, "l_max", "speedup")
    unity_line(b, cells["speedup"])
    style_axes(a, "throughput (tokens/s)", "(a) throughput")
    style_axes(b, "speedup vs AR at the same L_max (×)", "(b) speedup")
    for ax in (a, b):
        ax.set_xlabel("maximum prompt length L_max (tokens)")
    a.legend(fontsize=8)
    fig.suptitle(f"Figure 8 — prompt length sensitivity ({best}, T={setting.T})", fontsize=11)
    return fig


# --- Figures 6 and 7: sweeps ---------------------------------------------------------------------------------


def _tree_kind(summary: pd.DataFrame, keys: tuple[str, ...]) -> pd.Series:
    """Whether each cell is a tree-family cell whose params hold every key of ``keys``."""
    return pd.Series(
        [f == "tree" and all(k in (p or {}) for k in keys) for f, p in zip(summary["family"], summary["params"])],
        index=summary.index,
        dtype=bool,
    )


def _decoder_cells(summary: pd.DataFrame, setting: Setting, keys: tuple[str, ...]) -> tuple[str | None, pd.DataFrame]:
    """Tree-family cells with the params ``keys`` (sweep points included) of the decoder with the most of them, at
    the main T on the dataset/cap holding the most."""
    cells = summary[_tree_kind(summary, keys) & (summary["gen_length"] == setting.T)]
    if cells.empty:
        return None, cells
    decoders = cells.groupby("decoder", sort=False).size()
    cells = cells[cells["decoder"] == max(decoders.index, key=lambda d: decoders[d])]
    counts = cells.groupby(["dataset", "l_max"], sort=False).size()
    ds, l_max = max(counts.index, key=lambda k: (counts[k], setting.l_maxes.get(k[0]) == k[1]))
    return ds, cells[(cells["dataset"] == ds) & (cells["l_max"] == l_max)]


def _param(cells: pd.DataFrame, name: str) -> pd.Series:
    """A param of each cell, from the cells' stored params (the runner stores every param, defaults included)."""
    return pd.Series([(p or {}).get(name) for p in cells["params"]], index=cells.index)


def _baselines(
    ax, summary: pd.DataFrame, setting: Setting, ds: str, l_max: int, metric: str = "throughput_mean"
) -> None:
    """AR and static-tree lines (Figure 6): the static tree of the main tables if there is one, else the first."""
    same = non_sweep(summary)
    same = same[(same["dataset"] == ds) & (same["l_max"] == l_max) & (same["gen_length"] == setting.T)]
    main = (
        {m.cells[ds]["label"] for m in methods(summary, setting)[0] if ds in m.cells}
        if ds in setting.l_maxes
        else set()
    )
    for kind, color, ls in (
        (same["decoder"] == BASELINE, "black", "--"),
        (_tree_kind(same, STATIC_TREE_PARAMS), "gray", ":"),
    ):
        rows = same[kind]
        rows = pd.concat([rows[rows["label"].isin(main)], rows[~rows["label"].isin(main)]])
        if len(rows):
            ax.axhline(float(rows.iloc[0][metric]), color=color, ls=ls, lw=1, label=rows.iloc[0]["label"])


def _mean_std_panel(ax, cells: pd.DataFrame, keys: tuple[str, str], xlabel: str) -> bool:
    pairs = list(zip(_param(cells, keys[0]), _param(cells, keys[1])))
    known = [not any(pd.isna(v) for v in p) for p in pairs]
    pairs = [p for p, k in zip(pairs, known) if k]
    if len(set(pairs)) < 2:
        return False
    frame = pd.DataFrame({"pair": pairs, "thr": cells["throughput_mean"].astype(float).to_numpy()[known]})
    agg = frame.groupby("pair", sort=True)["thr"].agg(["mean", "std", "size"])
    x = np.arange(len(agg))
    ax.errorbar(x, agg["mean"], yerr=np.nan_to_num(agg["std"]), fmt="o-", capsize=4, color=PALETTE[0], label="DynaTree")
    ax.set_xticks(x, [f"({a:g}, {b:g})\nn={n}" for (a, b), n in zip(agg.index, agg["size"])], fontsize=8)
    ax.set_xlabel(xlabel)
    return True


def figure6(summary: pd.DataFrame, setting: Setting) -> Figure | str:
    """Figure 6: DynaTree sensitivity — (a) (tau_h, tau_l) scatter coloured by throughput, (b) throughput
    mean ± std over configurations per (B_min, B_max), (c) per (D_0, D_max); AR and fixed-tree lines."""
    ds, cells = _decoder_cells(summary, setting, DYNAMIC_TREE_PARAMS)
    if ds is not None:
        full = [
            all((p or {}).get(k, True) for k in ("dynamic_breadth", "dynamic_depth", "history_adaptation"))
            for p in cells["params"]
        ]
        cells = cells[full]
    if ds is None or len(cells) < 2:
        return "Figure 6 skipped: fewer than two full DynaTree configurations at the main T"
    l_max = int(cells.iloc[0]["l_max"])
    tau = pd.DataFrame(
        {"h": _param(cells, "tau_h"), "l": _param(cells, "tau_l"), "thr": cells["throughput_mean"].astype(float)}
    ).dropna()
    panels: list[str | tuple[str, str]] = []  # "tau", or a pair of params
    if len(set(zip(tau["h"], tau["l"]))) >= 2:
        panels.append("tau")
    for keys in (("b_min", "b_max"), ("d0", "d_max")):
        pairs = {p for p in zip(_param(cells, keys[0]), _param(cells, keys[1])) if not any(pd.isna(v) for v in p)}
        if len(pairs) >= 2:
            panels.append(keys)
    if not panels:
        return "Figure 6 skipped: the DynaTree configurations do not vary tau_h/tau_l, b_min/b_max or d0/d_max"
    fig = Figure(figsize=(5.2 * len(panels), 4.4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    names = {"tau": "thresholds", ("b_min", "b_max"): "breadth", ("d0", "d_max"): "depth"}
    for i, (ax, panel) in enumerate(zip(axes, panels)):
        tag = f"({'abc'[i]}) {names[panel]}"
        if isinstance(panel, str):  # "tau"
            sc = ax.scatter(tau["h"], tau["l"], c=tau["thr"], cmap="viridis", s=70, edgecolors="black", linewidths=0.5)
            fig.colorbar(sc, ax=ax, label="throughput (tokens/s)")
            ax.set_xlabel("τ_h (high-confidence threshold)")
            ax.set_ylabel("τ_ℓ (low-confidence threshold)")
            ax.set_title(f"{tag}: (τ_h, τ_ℓ) coloured by throughput", fontsize=10)
        else:
            xl = "(B_min, B_max)" if panel[0] == "b_min" else "(D_0, D_max)"
            _mean_std_panel(ax, cells, panel, xl)
            _baselines(ax, summary, setting, ds, l_max)
            style_axes(ax, "throughput (tokens/s)", f"{tag}: mean ± std over configurations")
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(
        f"Figure 6 — DynaTree parameter sensitivity ({ds}, L_max={l_max}, T={setting.T}, {len(cells)} configurations)",
        fontsize=11,
    )
    return fig


def figure7(summary: pd.DataFrame, setting: Setting) -> Figure | str:
    """Figure 7: fixed-tree sweep — speedup vs depth D per branching B (at the best tau), vs tau per D (at the
    best B), and a D x B heatmap at the best tau. Throughput replaces speedup when the run has no AR cell."""
    ds, cells = _decoder_cells(summary, setting, STATIC_TREE_PARAMS)
    if ds is not None and len(cells):  # a configuration that failed its lossless check is no configuration to pick
        cells = cells[~cells.apply(lossless_failed, axis=1).astype(bool)]
    if ds is None or len(cells) < 2:
        return "Figure 7 skipped: fewer than two fixed-tree configurations at the main T"
    grid = pd.DataFrame(
        {
            "D": _param(cells, "depth"),
            "B": _param(cells, "branching"),
            "tau": _param(cells, "tau"),
            "speedup": cells["speedup"].astype(float),
            "thr": cells["throughput_mean"].astype(float),
        }
    )
    metric, ylabel = (
        ("speedup", "speedup vs AR (×)") if grid["speedup"].notna().any() else ("thr", "throughput (tokens/s)")
    )
    grid = grid.dropna(subset=["D", "B", "tau", metric])
    if grid.empty or max(grid["D"].nunique(), grid["B"].nunique(), grid["tau"].nunique()) < 2:
        return "Figure 7 skipped: the fixed-tree configurations do not vary depth, branching or tau"
    # One value per (D, B, tau): the mean if a grid point was measured twice (e.g. the main fixed tree).
    grid = grid.groupby(["D", "B", "tau"], as_index=False)[metric].mean()
    best = grid.loc[grid[metric].idxmax()]
    l_max = int(cells.iloc[0]["l_max"])
    fig = Figure(figsize=(16, 4.6), layout="constrained")
    a, b, c = fig.subplots(1, 3)
    at_tau = grid[grid["tau"] == best["tau"]]
    for i, (B, g) in enumerate(at_tau.groupby("B")):
        g = g.sort_values("D")
        a.plot(g["D"], g[metric], "o-", color=PALETTE[i % 10], label=f"B={B:g}")
    a.set_xlabel("depth D")
    style_axes(a, ylabel, f"(a) vs depth, τ={best['tau']:g}")
    a.legend(fontsize=8)
    at_b = grid[grid["B"] == best["B"]]
    for i, (D, g) in enumerate(at_b.groupby("D")):
        g = g.sort_values("tau")
        b.plot(
            g["tau"], g[metric], "o-", color=colormaps["viridis"](i / max(1, at_b["D"].nunique() - 1)), label=f"D={D:g}"
        )
    b.set_xscale("log")
    b.xaxis.set_minor_formatter(NullFormatter())
    b.set_xticks(sorted(at_b["tau"].unique()), [f"{t:g}" for t in sorted(at_b["tau"].unique())])
    b.set_xlabel("pruning threshold τ (log scale)")
    style_axes(b, ylabel, f"(b) vs τ, B={best['B']:g}")
    b.legend(fontsize=8, ncol=2)
    if metric == "speedup":
        unity_line(a, at_tau[metric])
        unity_line(b, at_b[metric])
    heat = at_tau.pivot_table(index="D", columns="B", values=metric)
    im = c.imshow(heat.to_numpy(dtype=float), cmap="viridis", aspect="auto", origin="lower")
    c.set_xticks(range(len(heat.columns)), [f"{v:g}" for v in heat.columns])
    c.set_yticks(range(len(heat.index)), [f"{v:g}" for v in heat.index])
    c.set_xlabel("branching B")
    c.set_ylabel("depth D")
    vals = heat.to_numpy(dtype=float)
    mid = np.nanmean(vals) if np.isfinite(vals).any() else 0
    for (i, j), v in np.ndenumerate(vals):
        if not math.isnan(v):
            c.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8, color="white" if v < mid else "black")
    fig.colorbar(im, ax=c, label=ylabel)
    c.set_title(f"(c) D × B at τ={best['tau']:g}", fontsize=10)
    fig.suptitle(
        f"Figure 7 — fixed-tree sweep ({ds}, L_max={l_max}, T={setting.T}, {len(grid)} configurations; best "
        f"D={best['D']:g}, B={best['B']:g}, τ={best['tau']:g}: {best[metric]:.2f})",
        fontsize=11,
    )
    return fig


FIGURES: list[tuple[str, Callable[[pd.DataFrame, Setting], Figure | str]]] = [
    ("fig3_throughput_speedup", figure3),
    ("fig4_ablation", figure4),
    ("fig5_length_scaling", figure5),
    ("fig6_dynatree_sensitivity", figure6),
    ("fig7_fixed_tree_sweep", figure7),
    ("fig8_prompt_length", figure8),
]


def partial_note(summary: pd.DataFrame, include_partial: bool) -> list[str]:
    """One note naming the partial cells: left out of the figures, or drawn (hatched) with ``include_partial``."""
    if summary.empty or "partial" not in summary:
        return []
    cells = summary[summary["partial"].fillna(False).astype(bool)]
    if cells.empty:
        return []
    names = ", ".join(
        f"{r['label']} ({r['dataset']}, L_max={r['l_max']}, T={r['gen_length']})" for _, r in cells.iterrows()
    )
    if include_partial:
        return [f"figures include partial cells (failed after some prompts; hatched bars): {names}"]
    return [f"partial cells left out of the figures (failed after some prompts; --include-partial draws them): {names}"]


def build_figures(summary: pd.DataFrame, include_partial: bool = False) -> tuple[dict[str, Figure], list[str]]:
    """Every figure the summary has data for, keyed by file stem, and one-line notes for those skipped.

    Partial cells are drawn only with ``include_partial`` (:func:`~dtbench.reports.views.paper.prepare`)."""
    notes = partial_note(summary, include_partial)
    summary = prepare(summary, include_partial)
    setting = main_setting(summary)
    if setting is None:
        return {}, notes + ["no cells: no figures"]
    figs = {}
    for stem, make in FIGURES:
        out = make(summary, setting)
        if isinstance(out, str):
            notes.append(out)
        else:
            figs[stem] = out
    return figs, notes


def write_figures(
    summary: pd.DataFrame, outdir: str | Path, include_partial: bool = False
) -> tuple[list[Path], list[str]]:
    """Write each available figure as ``<stem>.png`` and ``<stem>.svg`` under ``outdir`` (created if needed);
    partial cells only with ``include_partial``.

    Returns:
        (paths written, notes for figures skipped).

    Raises:
        DtbenchError: if the folder cannot be created or written.
    """
    figs, notes = build_figures(summary, include_partial)
    return save_figures(figs, outdir), notes
