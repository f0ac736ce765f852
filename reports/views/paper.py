"""The DynaTree paper's tables (Tables 1-5 of the DynaTree paper, docs/architecture.md "The paper") regenerated from the results database.

Input is a per-cell summary (:func:`~dtbench.reports.views.summary.combined_summary`: one or more runs). Which
cells go where:

- The *main setting* is the generation length T with the most non-sweep cells (ties: the largest T) and, per
  dataset, the prompt cap L_max with the most non-sweep cells at that T (ties: the largest cap). The paper's
  is T=1500, L_max=800 on WikiText-2 and 1000 on PG-19.
- *Methods* (rows of Tables 1, 2, 3, 5 and Figure 3) are the non-sweep decoders measured on every dataset of
  the main setting. Labels that differ only in their trailing parenthesis and cover disjoint datasets are one
  method (``Linear Spec (K=8)`` on WikiText-2 and ``Linear Spec (K=5)`` on PG-19 are the paper's one
  "Linear Spec" row).
- *Ablation variants* (Table 4, Figure 4) are the non-sweep cells of tree-family decoders (``family: tree``,
  built-in or plugin) of the dataset with the most of them, in suite order; Δ is relative to the first.
- Sweep points (cells a suite expanded from ``sweep:``) feed Figures 6 and 7 only.

A *partial* cell (it failed after some prompts were measured) keeps its row but shows no numbers unless
``include_partial`` is set (``--include-partial``); either way a note names it, and with the option its method is
marked `` (partial)`` per dataset in the display and ``<dataset>.partial`` in the data. A note also names every
cell whose samples, warmup included, diverged from the reference, and every cell whose samples are all warmup.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dtbench.reports.rendering.output import Report
from dtbench.reports.rendering.render import fmt, fmt_pm, speedup_mark
from dtbench.reports.stats import BASELINE, is_missing
from dtbench.reports.views.notes import cell_notes
from dtbench.reports.views.summary import base_label, without_partial


@dataclass(frozen=True)
class Setting:
    """The main experimental setting: T and, per dataset (in run order), its prompt cap L_max."""

    T: int
    l_maxes: dict[str, int]

    def describe(self) -> str:
        l_maxes = ", ".join(f"{d} L_max={c}" for d, c in self.l_maxes.items())
        return f"T={self.T}; {l_maxes}"

    def cells(self, summary: pd.DataFrame, dataset: str | None = None) -> pd.DataFrame:
        """Summary rows at this setting (one dataset, or all), in their stored order."""
        mask = summary["gen_length"] == self.T
        l_maxes = self.l_maxes if dataset is None else {dataset: self.l_maxes[dataset]}
        mask &= pd.Series(
            [l_maxes.get(d) == c for d, c in zip(summary["dataset"], summary["l_max"])], index=summary.index
        )
        return summary[mask]


@dataclass
class Method:
    """One row of the main tables: a display name and its summary row per dataset."""

    name: str
    cells: dict[str, pd.Series] = field(default_factory=dict)

    @property
    def is_ar(self) -> bool:
        return all(c["decoder"] == BASELINE for c in self.cells.values())


#: A regenerated paper table is a :class:`~dtbench.reports.rendering.output.Report`: display strings for Markdown/terminal,
#: numbers for JSON/CSV, rendered by the one output layer.
PaperTable = Report


def non_sweep(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary's cells that are no sweep's points (the paper's tables and figures; sweeps have their own)."""
    return summary[~summary["sweep"].astype(bool)] if "sweep" in summary else summary


def main_setting(summary: pd.DataFrame) -> Setting | None:
    """The main setting of a summary (see the module docstring), or None for an empty summary."""
    base = non_sweep(summary)
    if base.empty:
        base = summary
    if base.empty:
        return None
    counts = base.groupby("gen_length").size()
    T = int(max(counts.index, key=lambda t: (counts[t], t)))
    at_T = base[base["gen_length"] == T]
    l_maxes = {}
    for ds in dict.fromkeys(at_T["dataset"]):
        c = at_T[at_T["dataset"] == ds].groupby("l_max").size()
        l_maxes[ds] = int(max(c.index, key=lambda k: (c[k], k)))
    return Setting(T=T, l_maxes=l_maxes)


def methods(summary: pd.DataFrame, setting: Setting) -> tuple[list[Method], list[str]]:
    """The rows of Tables 1, 2, 3, 5: non-sweep decoders present on every dataset of the setting.

    Returns:
        (methods in stored order, notes naming merged labels, e.g. which K linear speculation used per dataset).
    """
    cells = non_sweep(setting.cells(summary, None))
    by_label: dict[str, dict[str, pd.Series]] = {}
    for _, row in cells.iterrows():
        by_label.setdefault(row["label"], {})[row["dataset"]] = row
    # Merge labels with a common base and disjoint datasets into one method (the paper's "Linear Spec" row).
    groups: dict[tuple[str, str], list[str]] = {}
    for label, per_ds in by_label.items():
        decoder = next(iter(per_ds.values()))["decoder"]
        groups.setdefault((decoder, base_label(label)), []).append(label)
    out, notes, done = [], [], set()
    for label in by_label:
        if label in done:
            continue
        decoder = next(iter(by_label[label].values()))["decoder"]
        members = groups[(decoder, base_label(label))]
        datasets = [d for m in members for d in by_label[m]]
        if len(members) > 1 and len(datasets) == len(set(datasets)):
            m = Method(base_label(label), {d: by_label[x][d] for x in members for d in by_label[x]})
            notes.append(f"{m.name}: " + ", ".join(f"{x} on {', '.join(by_label[x])}" for x in members))
            done.update(members)
        else:
            m = Method(label, dict(by_label[label]))
            done.add(label)
        out.append(m)
    datasets = list(setting.l_maxes)
    full = [m for m in out if all(d in m.cells for d in datasets)]
    for m in full:
        for ds, c in m.cells.items():
            notes += cell_notes(c, f" on {ds}")
    return full, notes


def _display_name(name: str, cells: dict[str, pd.Series]) -> str:
    """A method's display name, marked partial on the datasets where its numbers (shown) are partial."""
    shown = [
        ds for ds, c in cells.items() if bool(c.get("partial", False)) and not bool(c.get("partial_hidden", False))
    ]
    return name + (f" (partial: {', '.join(shown)})" if shown else "")


def ablation(summary: pd.DataFrame, setting: Setting) -> tuple[str | None, pd.DataFrame]:
    """Table 4's variants: (dataset, its non-sweep tree cells in stored order), or (None, empty) if < 2."""
    best, rows = None, summary.iloc[0:0]
    for ds in setting.l_maxes:
        cells = non_sweep(setting.cells(summary, ds))
        tree = cells[cells["family"] == "tree"]
        if len(tree) > len(rows):
            best, rows = ds, tree
    return (best, rows) if len(rows) >= 2 else (None, summary.iloc[0:0])


# --- formatting ---------------------------------------------------------------------------------------------


def tps_spec(v) -> str:
    """Format spec for a throughput (tokens/s): one decimal from 10 t/s up (the paper's), two below (CPU runs)."""
    return ".1f" if is_missing(v) or abs(v) >= 10 else ".2f"


def _protocol(rows: list[pd.Series]) -> str:
    n = max((int(r["n"]) for r in rows), default=0)
    w = max((int(r["warmup_n"]) for r in rows), default=0)
    return f"mean ± std over {n} prompts after {w} warmup"


# --- the tables ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One per-dataset display column of a method table: its header after ``"<dataset> "`` and its cell text.

    ``text`` maps a summary row (one cell: a decoder on one dataset) to the string shown; missing numbers are a dash
    (:func:`~dtbench.reports.rendering.render.fmt`).
    """

    header: str
    text: Callable[[pd.Series], str]


@dataclass(frozen=True)
class MethodTableSpec:
    """A paper table whose rows are the methods (Tables 1, 2, 3, 5): what :func:`method_table` builds it from.

    Attributes:
        key, title: the :class:`PaperTable`'s key (JSON key, file stem) and title.
        columns: display columns repeated per dataset, in order (``"<dataset> <header>"``).
        fields: summary columns copied per dataset into the data frame as ``"<dataset>.<field>"`` (NaN if absent).
        caption: callable(setting, the tables' summary rows) returning the caption.
        totals: optional callable(method, all methods) returning (display, data) columns appended after the
            per-dataset ones (Table 5's average and relative change).
    """

    key: str
    title: str
    columns: tuple[Column, ...]
    fields: tuple[str, ...]
    caption: Callable[[Setting, list[pd.Series]], str]
    totals: Callable[[Method, list[Method]], tuple[dict, dict]] | None = None


def method_table(spec: MethodTableSpec, ms: list[Method], setting: Setting, notes: list[str]) -> PaperTable:
    """The one builder of the method tables (paper Tables 1, 2, 3, 5): one row per method, ``spec``'s columns per
    dataset; the data frame keeps the numbers (``method``, ``<dataset>.partial``, ``<dataset>.<field>``...)."""
    disp, data = [], []
    for m in ms:
        d: dict[str, str] = {"Method": _display_name(m.name, m.cells)}
        n: dict[str, Any] = {"method": m.name}
        for ds, c in m.cells.items():
            n[f"{ds}.partial"] = bool(c.get("partial", False))
            d.update({f"{ds} {col.header}": col.text(c) for col in spec.columns})
            n.update({f"{ds}.{k}": c.get(k, float("nan")) for k in spec.fields})
        if spec.totals is not None:
            td, tn = spec.totals(m, ms)
            d.update(td)
            n.update(tn)
        disp.append(d)
        data.append(n)
    rows = [c for m in ms for c in m.cells.values()]
    return PaperTable(
        spec.key, spec.title, spec.caption(setting, rows), pd.DataFrame(disp), pd.DataFrame(data), list(notes)
    )


def _acceptance_pct(c: pd.Series) -> str:
    bonus = c.get("acceptance_incl_bonus", float("nan"))
    return fmt(bonus * 100 if not is_missing(bonus) else None, ".1f", "%")


def _avg_peak(m: Method) -> float:
    vals = [c["peak_mib"] for c in m.cells.values() if not is_missing(c["peak_mib"])]
    return sum(vals) / len(vals) if vals else math.nan


def _memory_totals(m: Method, ms: list[Method]) -> tuple[dict, dict]:
    """Table 5's last columns: the method's average peak over datasets and its relative change vs AR's."""
    ar = next((x for x in ms if x.is_ar), None)
    ar_avg = _avg_peak(ar) if ar else math.nan
    a = _avg_peak(m)
    rel = 100 * (a - ar_avg) / ar_avg if not (is_missing(a) or is_missing(ar_avg) or ar_avg == 0) else math.nan
    return (
        {"Average (MiB)": fmt(a, ".1f"), "Rel. change": fmt(rel, "+.2f", "%")},
        {"average_mib": a, "rel_change_pct": rel},
    )


def _failed_mark(c) -> str:
    """A shown speedup's not-lossless mark (the partial mark is the tables' own, on every number)."""
    return speedup_mark({**dict(c), "partial": False}) if not pd.isna(c["speedup"]) else ""


#: Table 1: throughput (tokens/s, mean ± std over prompts after warmup) and speedup vs AR per dataset.
TABLE1 = MethodTableSpec(
    "table1_main",
    "Table 1 — Main results",
    (
        Column(
            "Throughput (t/s)",
            lambda c: fmt_pm(c["throughput_mean"], c["throughput_std"], tps_spec(c["throughput_mean"])),
        ),
        Column("Speedup", lambda c: fmt(c["speedup"], ".2f", "×") + _failed_mark(c)),
    ),
    ("throughput_mean", "throughput_std", "speedup", "label", "n"),
    lambda setting, rows: (
        f"{setting.describe()}. Throughput in tokens/s, {_protocol(rows)}; speedup = mean throughput / "
        "mean AR throughput of the same dataset, L_max and T."
    ),
)

#: Table 2: TTFT and TPOT (ms, mean ± std over prompts after warmup) per dataset.
TABLE2 = MethodTableSpec(
    "table2_latency",
    "Table 2 — Latency",
    (
        Column("TTFT (ms)", lambda c: fmt_pm(c["ttft_ms_mean"], c["ttft_ms_std"], ".1f")),
        Column("TPOT (ms)", lambda c: fmt_pm(c["tpot_ms_mean"], c["tpot_ms_std"], ".2f")),
    ),
    ("ttft_ms_mean", "ttft_ms_std", "tpot_ms_mean", "tpot_ms_std"),
    lambda setting, rows: (
        f"{setting.describe()}. TTFT: start (prefill included) to the first token; TPOT: (total - TTFT) "
        f"/ (T - 1); milliseconds, {_protocol(rows)}."
    ),
)

#: Table 3: acceptance rate, tokens per iteration L, committed path length ℓ, #iterations per dataset.
TABLE3 = MethodTableSpec(
    "table3_efficiency",
    "Table 3 — Verification efficiency",
    (
        Column("Accept.ᵃ", _acceptance_pct),
        Column("L̄", lambda c: fmt(c["tokens_per_iteration"], ".2f")),
        Column("ℓ̄ᵇ", lambda c: fmt(c.get("mean_path_length_all", float("nan")), ".2f")),
        Column("#Iter.", lambda c: fmt(c["iterations"], ".0f")),
    ),
    (
        "acceptance_incl_bonus",
        "acceptance_rate",
        "tokens_per_iteration",
        "mean_path_length_all",
        "mean_path_length",
        "iterations",
    ),
    lambda setting, rows: (
        f"{setting.describe()}. ᵃ Accept. follows the paper's Table 3 convention: committed tokens "
        "*including* the bonus token / drafted depth, summed over the iterations that drafted, so it "
        "can exceed 100% (dtbench's `acceptance_rate`, without the bonus and at most 100%, is in the "
        "CSV/JSON). L̄ = T / iterations. ᵇ ℓ̄ = committed path length before the bonus token averaged "
        "over every iteration, as the paper does (`mean_path_length_all`; `mean_path_length` "
        "averages the iterations that drafted). #Iter. = target verifications, the prefill first; "
        f"{_protocol(rows).replace(' ± std', '')}."
    ),
)

#: Table 5: peak memory (MiB = 2^20 bytes) per dataset, their average and the relative change vs AR.
TABLE5 = MethodTableSpec(
    "table5_memory",
    "Table 5 — Peak memory",
    (Column("Peak (MiB)", lambda c: fmt(c["peak_mib"], ".1f")),),
    ("peak_mib",),
    lambda setting, rows: (
        f"{setting.describe()}. Peak per sample (torch allocator peak on CUDA, process RSS peak on "
        f"CPU), MiB = 2^20 bytes, mean over {max((int(r['n']) for r in rows), default=0)} prompts "
        "after warmup; Average over datasets; relative change vs the AR average."
    ),
    _memory_totals,
)


def table4(dataset: str, rows: pd.DataFrame, setting: Setting) -> PaperTable:
    """Table 4: ablation — throughput (tokens/s), speedup vs AR and Δ throughput vs the first tree variant."""
    first = rows.iloc[0]["throughput_mean"]
    disp, data = [], []
    for _, c in rows.iterrows():
        delta = 100 * (c["throughput_mean"] - first) / first if first else math.nan
        disp.append(
            {
                "Variant": _display_name(c["label"], {dataset: c}),
                "Throughput (t/s)": fmt_pm(c["throughput_mean"], c["throughput_std"], tps_spec(c["throughput_mean"])),
                "Speedup": fmt(c["speedup"], ".2f", "×") + _failed_mark(c),
                f"Δ vs {rows.iloc[0]['label']}": fmt(delta, "+.1f", "%"),
            }
        )
        data.append(
            {
                "variant": c["label"],
                "decoder": c["decoder"],
                "params": c["params"],
                "partial": bool(c.get("partial", False)),
                "throughput_mean": c["throughput_mean"],
                "throughput_std": c["throughput_std"],
                "speedup": c["speedup"],
                "delta_pct": delta,
                "tokens_per_iteration": c["tokens_per_iteration"],
                "iterations": c["iterations"],
                "acceptance_rate": c["acceptance_rate"],
            }
        )
    return PaperTable(
        "table4_ablation",
        "Table 4 — Ablation",
        f"{dataset}, L_max={setting.l_maxes[dataset]}, T={setting.T}; {_protocol([c for _, c in rows.iterrows()])}; "
        "Δ = relative throughput change vs the first tree variant.",
        pd.DataFrame(disp),
        pd.DataFrame(data),
        [n for _, c in rows.iterrows() for n in cell_notes(c, f" on {dataset}")],
    )


def prepare(summary: pd.DataFrame, include_partial: bool = False) -> pd.DataFrame:
    """The summary the paper's tables and figures draw: partial cells' numbers blanked
    (:func:`~dtbench.reports.views.summary.without_partial`) unless ``include_partial``."""
    if include_partial:
        return summary.assign(partial_hidden=False)
    return without_partial(summary)


def paper_tables(summary: pd.DataFrame, include_partial: bool = False) -> tuple[list[PaperTable], list[str]]:
    """All paper tables the summary has data for, and one-line notes for those skipped.

    Args:
        summary: :func:`~dtbench.reports.views.summary.combined_summary` of one or more runs.
        include_partial: show the numbers of cells that failed after some prompts (marked partial); by default
            they are left out (a dash) and a note names them.
    """
    summary = prepare(summary, include_partial)
    setting = main_setting(summary)
    if setting is None:
        return [], ["no cells: no paper tables"]
    ms, notes = methods(summary, setting)
    tables, skipped = [], []
    if ms:
        tables += [method_table(spec, ms, setting, notes) for spec in (TABLE1, TABLE2, TABLE3)]
    else:
        skipped.append("Tables 1-3, 5 skipped: no decoder was measured on every dataset of the main setting")
    ds, rows = ablation(summary, setting)
    if ds is not None:
        tables.append(table4(ds, rows, setting))
    else:
        skipped.append(
            "Table 4 skipped: fewer than two non-sweep tree variants (tree-family decoders) at the main setting"
        )
    if ms:
        tables.append(method_table(TABLE5, ms, setting, notes))
    return tables, skipped
