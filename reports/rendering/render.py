"""Display strings of the reports: the run's cell table (:func:`cell_reports`, :func:`cell_document`), speedups,
run-to-run comparisons, cell notes and the run header. What they become in each format is
:mod:`dtbench.reports.rendering.output`'s (one registered renderer per format)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from dtbench.harness.measurement import load
from dtbench.harness.measurement.metrics import METRICS, SPEEDUP, Metric
from dtbench.harness.safetext import printable
from dtbench.harness.suites.grouping import CellKey
from dtbench.reports.pricing import explain
from dtbench.reports.rendering.output import Document, Note, Report
from dtbench.reports.stats import BASELINE, GROUP, MIN_PROMPTS, MISSING, N_TOO_SMALL, SAMPLED, is_missing, show
from dtbench.reports.views.notes import cell_notes, lossless_detail
from dtbench.reports.views.summary import lossless_failed

# The per-cell table: the decoder, throughput, speedup, every metric with a header, then the lossless verdict.
_SHOWN = [METRICS[0], SPEEDUP, *(m for m in METRICS[1:] if m.header)]


def _header(metric: Metric) -> str:
    """The column header of a shown metric (every metric in :data:`_SHOWN` has one)."""
    assert metric.header is not None, metric.name
    return metric.header


COLUMNS = [
    ("Decoder", "label"),
    ("Execution", "execution"),
    *((_header(m), m.name) for m in _SHOWN),
    ("Lossless", "lossless"),
]
# With repeats (suite key repeats), after the throughput: its median and its coefficient of variation over repeats.
REPEAT_COLUMNS = [("Median (t/s)", "throughput_median"), ("CV", "throughput_cv")]


def shown_columns(group: pd.DataFrame) -> list[tuple[str, str]]:
    """COLUMNS without the optional metrics (energy, roofline) that no row of ``group`` has a value for, and without
    Execution where every row ran eager (the tables of runs before compiled execution are unchanged)."""
    empty = {
        m.name
        for m in _SHOWN
        if m.optional and not any(not _missing(v) for c in m.columns for v in (group[c] if c in group else []))
    }
    if "execution" not in group or all(v in (None, "eager") or _missing(v) for v in group["execution"]):
        empty.add("execution")
    return [(h, c) for h, c in COLUMNS if c not in empty]


_missing = is_missing


def fmt(v, spec: str, suffix: str = "") -> str:
    """``v`` formatted with ``spec`` and ``suffix``; :data:`~dtbench.reports.stats.MISSING` for a missing value
    (:func:`~dtbench.reports.stats.show`)."""
    return show(v, spec, suffix)


def fmt_pm(mean, std, spec: str) -> str:
    """``mean ± std`` (std omitted when undefined, "—" when the mean is)."""
    if _missing(mean):
        return MISSING
    return format(mean, spec) if _missing(std) else f"{format(mean, spec)} ± {format(std, spec)}"


# Appended to the numbers of a partial cell (failed after some prompts were measured) wherever they are shown.
PARTIAL_MARK = " (partial)"


def partial_mark(row) -> str:
    """:data:`PARTIAL_MARK` for a partial summary row, else ""."""
    return PARTIAL_MARK if bool(row.get("partial", False)) else ""


# Appended to the speedup of a cell declared lossless that failed its lossless check, wherever a speedup is shown: a
# decoder that emits other tokens than the target's can be arbitrarily fast, so its speedup is no speculative
# decoding speedup (the tuning line and the figures' best configuration leave such cells out).
NOT_LOSSLESS_MARK = " (not lossless)"


def speedup_mark(row) -> str:
    """The marks owed to a speedup: :data:`PARTIAL_MARK` and :data:`NOT_LOSSLESS_MARK` where they apply."""
    failed = bool(row.get("not_lossless", False)) or lossless_failed(row)
    return partial_mark(row) + (NOT_LOSSLESS_MARK if failed else "")


def formatted(row: pd.Series) -> dict[str, str]:
    """Display strings of one summary row, keyed by COLUMNS' keys."""
    mark = partial_mark(row)
    if row["lossless"] in (MISSING, SAMPLED):
        lossless = row["lossless"]
    else:  # over every measured sample, warmup included
        ref = row["reference"] if isinstance(row["reference"], str) and row["reference"] != BASELINE else ""
        lossless = f"{row['lossless']} {row['lossless_n']}" + (f" vs {ref}" if ref else "") + lossless_detail(row)
    if row["status"] == "failed":
        lossless = "FAILED" + (f"{mark}, {lossless}" if mark and lossless != MISSING else mark)
    out = {
        "label": row["label"],
        "lossless": lossless,
        "execution": execution_display(row),
        "throughput_median": fmt(row.get("throughput_median"), ".1f") + mark,
        "throughput_cv": fmt(row.get("throughput_cv"), ".1%"),
    }
    for m in _SHOWN:
        value = m.format(row[f"{m.name}_mean"], row[f"{m.name}_std"]) if m.spread else m.format(row[m.name])
        if m is SPEEDUP and value != MISSING:
            value += "×"
        out[m.name] = value + (
            speedup_mark(row) if m is SPEEDUP and value != MISSING else mark if m is METRICS[0] else ""
        )
    return out


def execution_display(row) -> str:
    """The Execution column: ``eager``, or ``compiled`` with the cell's compile time (seconds, before its warmup)."""
    mode = row.get("execution") or "eager"
    compile_s = row.get("compile_s")
    return mode if _missing(compile_s) or compile_s is None else f"{mode} (compile {compile_s:.1f} s)"


def cell_reports(summary: pd.DataFrame) -> list[Report]:
    """The run's cell table as reports: one per (dataset, L_max, T), decoders as rows.

    Each report's display frame holds :data:`COLUMNS` (less the optional metrics no row has, :func:`shown_columns`)
    as :func:`formatted` strings; its data frame the same cells' :data:`MACHINE_COLUMNS` and ``params``; its notes
    :func:`cell_notes` (red for a failed cell, yellow otherwise); a failed cell's row, or a lossless decoder's that
    diverged, is red.
    """
    reports = []
    for i, (_, group) in enumerate(summary.groupby(GROUP, sort=False)):
        key = CellKey.of_row(group.iloc[0])
        columns = shown_columns(group)
        repeats = int(group["repeats"].max()) if "repeats" in group and len(group) else 1
        if repeats > 1:  # the median and the coefficient of variation over repeats, after the mean throughput
            at = next(i for i, (_, c) in enumerate(columns) if c == METRICS[0].name) + 1
            columns[at:at] = REPEAT_COLUMNS
        rows = [row for _, row in group.iterrows()]
        display = pd.DataFrame(
            [[formatted(row)[c] for _, c in columns] for row in rows], columns=[h for h, _ in columns]
        )
        styles = [
            "red" if row["status"] == "failed" or row["lossless"] == "no" and row["lossless_expected"] else None
            for row in rows
        ]
        notes = [
            Note(note, "red" if row["status"] == "failed" else "yellow") for row in rows for note in cell_notes(row)
        ] + [Note(note, None) for row in rows for note in explain.note(row)]
        n = int(group["n"].max()) if len(group) else 0
        unit = (
            "prompts"
            if key.batch_size == 1
            else f"prompt groups of B={key.batch_size} (throughput: all rows; TTFT/TPOT/accept.: mean over rows)"
        )
        rem = int(group["remainder_n"].max()) if "remainder_n" in group and len(group) else 0
        each = f" (each the median of {repeats} repeats; CV: median over prompts of the CV over repeats)"
        lost = "failed_requests" in group and bool((group["failed_requests"].fillna(0) > 0).any())
        left = (  # a served cell's partial blocks lost a failed request: no smaller batch was decoded (issue 67)
            f"; {rem} prompts in blocks that lost a failed request, left out (failed requests: the notes)"
            if lost
            else f"; remainder: {rem} prompts decoded as a smaller batch, left out"
        )
        caption = f"mean ± std over {n} {unit} after warmup" + (each if repeats > 1 else "") + (left if rem else "")
        reports.append(
            Report(
                f"cells_{i}",
                key.title(),
                caption,
                display,
                group[[c for c in CELL_DATA if c in group]],  # explain.COLUMNS where explained
                notes=notes,
                row_styles=styles,
                left=frozenset({"Decoder", "Execution", "Lossless"}),
            )
        )
    return reports


def cell_document(summary: pd.DataFrame, run_meta: dict) -> Document:
    """Every cell of a run as one :class:`~dtbench.reports.rendering.output.Document`: the run line (:func:`run_header`)
    above :func:`cell_reports`; CSV and JSON are one row per cell in the summary's order (:data:`CELL_DATA`; JSON
    ``{"run": run_meta, "cells": [...]}``), the cell's params last."""
    return Document(
        cell_reports(summary),
        header=run_header(run_meta),
        meta={"run": run_meta},
        rows="cells",
        data=summary[[c for c in CELL_DATA if c in summary]],
        title=f"run {run_meta['id']}: every cell",
    )


MACHINE_COLUMNS = [
    "dataset",
    "l_max",
    "gen_length",
    "label",
    "decoder",
    "n",
    *METRICS[0].columns,
    "speedup",
    *(c for m in METRICS[1:] for c in m.columns),
    "lossless",
    "lossless_n",
    "lossless_rule",
    "target_dtype",
    "lossless_checked_n",
    "lossless_ties",
    "lossless_tie_samples",
    "lossless_error_samples",
    "lossless_first_error",
    "lossless_error_margin",
    "lossless_max_tie_margin",
    "lossless_check_s",
    "reference",
    "status",
    "error",
    "warmup_n",
    "partial",
    "all_warmup",
    "mixed_devices",
    "batch_size",
    "remainder_n",
    "requests",
    "failed_requests",
    "failure_rate",
    "execution",
    "compile_s",
    "repeats",
    "throughput_median",
    "throughput_cv",
    *load.COLUMNS,
    "others_cpu_share",
    "busy",
    "load_note",
    *explain.COLUMNS,
]


# The machine-readable cell table (CSV and JSON; the params as JSON text in CSV, an object in JSON).
CELL_DATA = MACHINE_COLUMNS + ["params"]


def speedup_display(table: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Display strings of a :func:`~dtbench.reports.views.compare.speedup_table` (tokens/s, ×); "n too small" in place
    of the interval below :data:`~dtbench.reports.stats.MIN_PROMPTS` paired prompts."""
    ci = f"{confidence:.0%} CI"

    def interval(r) -> str:
        if r["ci_method"] == N_TOO_SMALL:
            return f"{N_TOO_SMALL} (n < {MIN_PROMPTS})"
        return MISSING if pd.isna(r["ci_low"]) else f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]"

    out = pd.DataFrame(
        [
            {
                "Dataset": r["dataset"],
                "L_max": str(r["l_max"]),
                "T": str(r["gen_length"]),
                "B": str(int(r.get("batch_size", 1) or 1)),
                "Decoder": r["label"],
                "n": str(r["n"]),
                "Throughput (t/s)": fmt(r["throughput_mean"], ".1f") + partial_mark(r),
                "AR (t/s)": fmt(r["ar_throughput_mean"], ".1f"),
                "Speedup": fmt(r["speedup"], ".3f", "×") + speedup_mark(r),
                "Per-prompt (geo. mean)": fmt(r["paired_speedup"], ".3f", "×"),
                ci: interval(r),
                "Verdict": r["verdict"],
            }
            for _, r in table.iterrows()
        ],
        columns=[
            "Dataset",
            "L_max",
            "T",
            "B",
            "Decoder",
            "n",
            "Throughput (t/s)",
            "AR (t/s)",
            "Speedup",
            "Per-prompt (geo. mean)",
            ci,
            "Verdict",
        ],
    )
    return _batch_column(out, table)


def _batch_column(display: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """``display`` with its "B" (batch size) column only when some row is at B > 1 (B = 1 reports look as before)."""
    batched = "batch_size" in table and bool((pd.to_numeric(table["batch_size"]).fillna(1) != 1).any())
    return display if batched else display.drop(columns=["B"])


MARK_STYLES = {
    "better": "green",
    "worse": "red",
    "newly failing": "bold red",
    "still failing": "red",
    "not comparable": "yellow",
    "new": "cyan",
    "missing": "magenta",
    "no longer failing": "green",
    N_TOO_SMALL: "dim",
}
VERDICT_STYLES = {"faster": "green", "slower": "red", N_TOO_SMALL: "dim"}


def verdict_style(verdict: str) -> str | None:
    """The rich style of a speedup verdict: yellow for a partial cell's, else VERDICT_STYLES'."""
    return "yellow" if verdict.endswith(PARTIAL_MARK) else VERDICT_STYLES.get(verdict)


def compare_display(table: pd.DataFrame) -> pd.DataFrame:
    """Display strings of a run-to-run comparison (:func:`~dtbench.reports.views.compare.compare_runs`)."""

    def side(r, which: str) -> str:
        return fmt(r[which], ".2f") + (PARTIAL_MARK if bool(r.get(f"{which}_partial", False)) else "")

    out = pd.DataFrame(
        [
            {
                "Dataset": r["dataset"],
                "L_max": str(r["l_max"]),
                "T": str(r["gen_length"]),
                "B": str(int(r.get("batch_size", 1) or 1)),
                "Decoder": r["label"],
                "Before (t/s)": side(r, "before"),
                "After (t/s)": side(r, "after"),
                "Ratio": fmt(r["ratio"], ".3f", "×"),
                "p": fmt(r["p_value"], ".3g"),
                "Mark": r["mark"],
                "Note": r["note"],
            }
            for _, r in table.iterrows()
        ],
        columns=["Dataset", "L_max", "T", "B", "Decoder", "Before (t/s)", "After (t/s)", "Ratio", "p", "Mark", "Note"],
    )
    return _batch_column(out, table)


# --- the run's environment ----------------------------------------------------------------------------------


def hardware_text(env: dict | None) -> str:
    """The dtype-relevant hardware flags of a run (``environment["hardware"]``, written by
    :func:`~dtbench.harness.measurement.machine.hardware_flags`) as one line; "" for runs recorded without them.

    Example: ``CPU avx2 avx512f avx512_bf16 (no avx512_fp16 amx_bf16 amx_tile); torch CPU kernels AVX512;
    CUDA compute capability 9.0, native bf16``.
    """
    hw = (env or {}).get("hardware")
    if not isinstance(hw, dict):
        return ""
    parts = []
    flags = hw.get("cpu_flags")
    if isinstance(flags, dict) and flags:
        on = [f for f, v in flags.items() if v]
        off = [f for f, v in flags.items() if not v]
        parts.append(
            "CPU "
            + (" ".join(on) if on else "none of the AVX2/AVX-512/AMX flags")
            + (f" (no {' '.join(off)})" if on and off else "")
        )
    if hw.get("torch_cpu_capability"):
        parts.append(f"torch CPU kernels {hw['torch_cpu_capability']}")
    if hw.get("cuda_capability"):
        bf16_labels: dict[Any, str] = {True: ", native bf16", False: ", no native bf16"}  # None or absent: ""
        bf16 = bf16_labels.get(hw.get("cuda_bf16"), "")
        parts.append(f"CUDA compute capability {hw['cuda_capability']}{bf16}")
    return "; ".join(parts)


def run_header(meta: dict) -> str:
    """The line above a run's tables: id, suite, status, device, versions, and a second line of hardware flags."""
    env = meta.get("environment") or {}
    line = (
        f"run {meta['id']} · suite {meta['suite']} · {meta['status']} · {env.get('device_name')} · "
        f"torch {env.get('torch')} · transformers {env.get('transformers')}"
    )
    hw = hardware_text(env)
    return printable(line) + (f"\nhardware: {printable(hw)}" if hw else "")
