"""The cell-statistics layer every report shares: which cells are compared, how, and how a missing value reads.

- The *group* of a cell is its (dataset, L_max, T) (:data:`GROUP`); a cell is identified within a run by its group
  and label (:data:`KEY`).
- A cell's *reference for speedups* is the baseline decoder's (:data:`BASELINE`, greedy full-cache AR) cell of the
  same group that decodes the same way (:func:`decoding`: greedy, or the same sampling settings). Sampled cells are
  never divided by greedy AR.
- Fewer than :data:`MIN_PROMPTS` prompts after warmup give no interval and no verdict: :data:`N_TOO_SMALL`.

The paper's speedup (section 4.1, Table 1) is mean throughput over the reference's mean throughput; the paired
per-prompt ratios (decoder / reference throughput on the same prompt) give its confidence interval.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from dtbench.harness.metrics import BASELINE

GROUP = ["dataset", "l_max", "gen_length"]
KEY = [*GROUP, "label"]

# Below this many prompts after warmup (paired with AR's for a speedup; per side for a run-to-run test) no
# confidence interval and no verdict is shown, only "n too small". With n = 5 the t quantile of a 95% interval is
# 2.78 (n = 2: 12.7, n = 3: 4.30) and a two-sided Mann-Whitney U test can reach p = 0.008 (n = 3 per side: 0.10,
# never significant at 0.05); below that an interval mostly reflects two or three prompts' luck.
MIN_PROMPTS = 5
N_TOO_SMALL = "n too small"

FAMILY_UNKNOWN = "external"  # a cell whose decoder's family is not recorded (written before it was, not installed)
MISSING = "—"  # how every report shows a value it does not have (no AR baseline, all warmup, not applicable)

__all__ = ["BASELINE", "FAMILY_UNKNOWN", "GROUP", "KEY", "MIN_PROMPTS", "MISSING", "N_TOO_SMALL", "baseline_values",
           "cell_value", "decoding", "family_of", "is_missing", "pairing_key", "show"]


def decoding(sampling) -> str:
    """How a cell decodes: ``"greedy"``, or its sampling settings (a ``cells.sampling`` dict) as a canonical JSON
    string. Speedups pair a cell only with a baseline cell of the same decoding."""
    return json.dumps(sampling, sort_keys=True) if isinstance(sampling, dict) and sampling else "greedy"


def cell_value(rows: pd.DataFrame, metric: str) -> float:
    """One cell's value of ``metric`` from its per-prompt rows after warmup (:func:`dtbench.reports.compare.per_prompt`).

    ``speedup`` is the paper's (Table 1): mean throughput / mean baseline throughput over the paired prompts (those
    with a baseline sample), the number every report shows for the cell; every other metric is the mean of the
    per-prompt values. NaN without rows (or, for speedup, without a paired baseline).
    """
    if metric == "speedup":
        paired = rows[rows["baseline_throughput"].notna()] if "baseline_throughput" in rows else rows.iloc[0:0]
        return float(paired["throughput"].mean() / paired["baseline_throughput"].mean()) if len(paired) else math.nan
    return float(rows[metric].mean()) if len(rows) else math.nan


def family_of(stored) -> str:
    """A cell's decoder family (``cells.family``), :data:`FAMILY_UNKNOWN` when none is recorded."""
    return stored if isinstance(stored, str) and stored else FAMILY_UNKNOWN


def is_missing(value) -> bool:
    """None, NaN (float or pandas NA) or an empty string."""
    if value is None or (isinstance(value, str) and not value):
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # lists, dicts
        return False


def show(value, spec: str = "", suffix: str = "") -> str:
    """``format(value, spec) + suffix``, or :data:`MISSING` for a missing value (:func:`is_missing`)."""
    return MISSING if is_missing(value) else format(value, spec) + suffix


def pairing_key(frame: pd.DataFrame, extra: tuple[str, ...] = ()) -> list[tuple]:
    """Per row: (run_id if the frame has one, dataset, L_max, T, *extra, decoding): rows with equal keys are compared
    with each other; ``extra`` is e.g. ``("prompt_index",)`` for per-prompt pairs."""
    cols = [*(["run_id"] if "run_id" in frame else []), *GROUP, *extra]
    sampling = frame["sampling"] if "sampling" in frame else pd.Series([None] * len(frame), index=frame.index)
    return [(*vals, decoding(s)) for vals, s in zip(zip(*(frame[c] for c in cols)), sampling)] if cols else []


def baseline_values(frame: pd.DataFrame, column: str, extra: tuple[str, ...] = (), missing=math.nan) -> pd.Series:
    """For every row of ``frame``, ``column`` of its baseline row: the first row whose decoder is :data:`BASELINE`
    with the same :func:`pairing_key` (same run, dataset, L_max, T and ``extra`` columns, same decoding: greedy
    with greedy, a sampling setting with the same setting). NaN where there is none.

    Args:
        frame: one row per cell (a summary) or per sample (``extra=("prompt_index",)``), with ``decoder``,
            ``sampling`` and the group columns.
        column: the value to fetch, e.g. ``throughput_mean``, ``throughput`` or ``label``.
        missing: the value of rows without a baseline (NaN; None for labels).

    Returns:
        A Series aligned with ``frame``'s index.
    """
    keys = pairing_key(frame, extra)
    base: dict[tuple, object] = {}
    for key, decoder, value in zip(keys, frame["decoder"], frame[column]):
        if decoder == BASELINE and key not in base:
            base[key] = value
    values = [base.get(k, missing) for k in keys]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return pd.Series(values, index=frame.index, dtype=float if numeric else object)
