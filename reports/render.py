"""Rendering of per-cell summaries: rich tables for the terminal, Markdown, CSV and JSON for files and pipes."""

from __future__ import annotations

import json
import math

import pandas as pd
from rich.console import Console
from rich.table import Table

from dtbench.reports.summary import GROUP

COLUMNS = [
    ("Decoder", "label"),
    ("Throughput (t/s)", "throughput"),
    ("Speedup", "speedup"),
    ("TTFT (ms)", "ttft"),
    ("TPOT (ms)", "tpot"),
    ("Accept.", "acceptance_rate"),
    ("L (tok/iter)", "tokens_per_iteration"),
    ("ℓ (path)", "mean_path_length"),
    ("#Iter", "iterations"),
    ("Peak mem (MiB)", "peak_mib"),
    ("Lossless", "lossless"),
]


def _num(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return format(v, fmt)


def _pm(mean, std, fmt: str) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "—"
    if std is None or (isinstance(std, float) and math.isnan(std)):
        return format(mean, fmt)
    return f"{format(mean, fmt)} ± {format(std, fmt)}"


def formatted(row: pd.Series) -> dict[str, str]:
    """Display strings of one summary row, keyed by COLUMNS' keys."""
    if row["status"] == "failed":
        lossless = "FAILED"
    elif row["lossless"] == "—":
        lossless = "—"
    else:
        ref = row["reference"] if row["reference"] and row["reference"] != "ar" else ""
        lossless = f"{row['lossless']} {row['lossless_n']}" + (f" vs {ref}" if ref else "")
        if row["lossless"] == "no" and row["divergences"]:
            lossless += f" (first at {row['divergences'][0]})"
    return {
        "label": row["label"],
        "throughput": _pm(row["throughput_mean"], row["throughput_std"], ".1f"),
        "speedup": _num(row["speedup"], ".2f") + ("×" if not pd.isna(row["speedup"]) else ""),
        "ttft": _pm(row["ttft_ms_mean"], row["ttft_ms_std"], ".1f"),
        "tpot": _pm(row["tpot_ms_mean"], row["tpot_ms_std"], ".2f"),
        "acceptance_rate": "—" if pd.isna(row["acceptance_rate"]) else f"{row['acceptance_rate']:.1%}",
        "tokens_per_iteration": _num(row["tokens_per_iteration"], ".2f"),
        "mean_path_length": _num(row["mean_path_length"], ".2f"),
        "iterations": _num(row["iterations"], ".1f"),
        "peak_mib": _num(row["peak_mib"], ".0f"),
        "lossless": lossless,
    }


def _title(key) -> str:
    dataset, cap, T = key
    return f"{dataset} · prompt cap {cap} · T={T}"


def print_tables(summary: pd.DataFrame, console: Console, caption: str = "") -> None:
    """One rich table per (dataset, prompt cap, T), decoders as rows."""
    for key, group in summary.groupby(GROUP, sort=False):
        n = int(group["n"].max()) if len(group) else 0
        table = Table(title=_title(key), caption=caption or f"mean ± std over {n} prompts after warmup")
        for head, col in COLUMNS:
            table.add_column(head, justify="left" if col in ("label", "lossless") else "right")
        for _, row in group.iterrows():
            f = formatted(row)
            style = "red" if row["status"] == "failed" or row["lossless"] == "no" and row["lossless_expected"] else None
            table.add_row(*(f[c] for _, c in COLUMNS), style=style)
        console.print(table)
        for _, row in group[group["status"] == "failed"].iterrows():
            console.print(f"[red]{row['label']} failed: {row['error']}[/red]")


def markdown(summary: pd.DataFrame) -> str:
    """The same tables as GitHub Markdown, one section per (dataset, prompt cap, T)."""
    parts = []
    for key, group in summary.groupby(GROUP, sort=False):
        parts.append(f"### {_title(key)}\n")
        parts.append("| " + " | ".join(h for h, _ in COLUMNS) + " |")
        parts.append("|" + "|".join("---" if c in ("label", "lossless") else "---:" for _, c in COLUMNS) + "|")
        for _, row in group.iterrows():
            f = formatted(row)
            parts.append("| " + " | ".join(f[c].replace("|", "\\|") for _, c in COLUMNS) + " |")
        parts.append("")
    return "\n".join(parts)


MACHINE_COLUMNS = [
    "dataset", "prompt_cap", "gen_length", "label", "decoder", "n", "throughput_mean", "throughput_std", "speedup",
    "ttft_ms_mean", "ttft_ms_std", "tpot_ms_mean", "tpot_ms_std", "acceptance_rate", "tokens_per_iteration",
    "mean_path_length", "iterations", "peak_mib", "lossless", "lossless_n", "reference", "status", "error",
]


def csv(summary: pd.DataFrame) -> str:
    """Machine-readable summary, one row per cell (units in column names: ms, MiB, tokens/s)."""
    return summary[MACHINE_COLUMNS].to_csv(index=False)


def to_json(summary: pd.DataFrame, run_meta: dict) -> str:
    """The run's metadata and per-cell summary rows as JSON (NaN -> null)."""
    rows = json.loads(summary[MACHINE_COLUMNS + ["params"]].to_json(orient="records"))
    return json.dumps({"run": run_meta, "cells": rows}, indent=2, default=str)


# --- generic frames (paper tables, comparisons) -------------------------------------------------------------


def _is_left(values: pd.Series) -> bool:
    return not all(isinstance(v, (int, float)) or (isinstance(v, str) and v[:1] in "0123456789+-—.") for v in values)


def rich_frame(display: pd.DataFrame, title: str, caption: str = "", row_styles: list[str | None] | None = None) -> Table:
    """A rich Table of a frame of display strings (text columns left-aligned, numbers right-aligned)."""
    table = Table(title=title, caption=caption or None, caption_justify="left")
    for col in display.columns:
        table.add_column(str(col), justify="left" if _is_left(display[col]) else "right")
    for i, (_, row) in enumerate(display.iterrows()):
        style = row_styles[i] if row_styles else None
        table.add_row(*("" if v is None else str(v) for v in row), style=style)
    return table


def markdown_frame(display: pd.DataFrame, title: str = "", caption: str = "", notes: list[str] | None = None,
                   level: int = 3) -> str:
    """GitHub Markdown of a frame of display strings, with an optional heading, caption and notes."""
    parts = [f"{'#' * level} {title}\n"] if title else []
    cols = [str(c) for c in display.columns]
    parts.append("| " + " | ".join(c.replace("|", "\\|") for c in cols) + " |")
    parts.append("|" + "|".join("---" if _is_left(display[c]) else "---:" for c in display.columns) + "|")
    for _, row in display.iterrows():
        parts.append("| " + " | ".join(("" if v is None else str(v)).replace("|", "\\|") for v in row) + " |")
    if caption:
        parts.append(f"\n{caption}")
    for note in notes or []:
        parts.append(f"\n{note}")
    parts.append("")
    return "\n".join(parts)


def _f(v, spec: str, suffix: str = "") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec) + suffix


def speedup_display(table: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Display strings of a :func:`~dtbench.reports.compare.speedup_table` (tokens/s, ×)."""
    ci = f"{confidence:.0%} CI"
    return pd.DataFrame([{
        "Dataset": r["dataset"], "L_max": str(r["prompt_cap"]), "T": str(r["gen_length"]), "Decoder": r["label"],
        "n": str(r["n"]), "Throughput (t/s)": _f(r["throughput_mean"], ".1f"), "AR (t/s)": _f(r["ar_throughput_mean"], ".1f"),
        "Speedup": _f(r["speedup"], ".3f", "×"),
        ci: "—" if pd.isna(r["ci_low"]) else f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]",
        "Verdict": r["verdict"],
    } for _, r in table.iterrows()], columns=["Dataset", "L_max", "T", "Decoder", "n", "Throughput (t/s)", "AR (t/s)",
                                              "Speedup", ci, "Verdict"])


MARK_STYLES = {"better": "green", "worse": "red", "newly failing": "bold red", "still failing": "red",
               "not comparable": "yellow", "new": "cyan", "missing": "magenta", "no longer failing": "green"}
VERDICT_STYLES = {"faster": "green", "slower": "red"}


def compare_display(table: pd.DataFrame) -> pd.DataFrame:
    """Display strings of a run-to-run comparison (:func:`~dtbench.reports.compare.compare_runs`)."""
    return pd.DataFrame([{
        "Dataset": r["dataset"], "L_max": str(r["prompt_cap"]), "T": str(r["gen_length"]), "Decoder": r["label"],
        "Before (t/s)": _f(r["before"], ".2f"), "After (t/s)": _f(r["after"], ".2f"), "Ratio": _f(r["ratio"], ".3f", "×"),
        "p": _f(r["p_value"], ".3g"), "Mark": r["mark"], "Note": r["note"],
    } for _, r in table.iterrows()], columns=["Dataset", "L_max", "T", "Decoder", "Before (t/s)", "After (t/s)", "Ratio",
                                              "p", "Mark", "Note"])
