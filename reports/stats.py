"""The cell-statistics layer every report shares: which cells are compared, how, and how a missing value reads.

- The *group* of a cell is its (dataset, L_max, T, batch size B) (:data:`GROUP`); a cell is identified within a run by
  its group and label (:data:`KEY`). Cells stored before batch sizes existed are B = 1.
- At B > 1 the unit of pairing is the *prompt group* (B prompts decoded together, the same groups for every decoder):
  :func:`collapse_batches` turns a group's rows into one row (total throughput = the rows' tokens / the batch's wall
  time; TTFT, TPOT, acceptance, tokens per iteration the mean over its rows), keyed by the group's first prompt, so
  per-prompt pairs become per-group pairs. A *remainder* group (fewer than B prompts) is kept out of the statistics
  at B and counted apart.
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
import statistics
from collections.abc import Iterable

import pandas as pd

from dtbench.harness.measurement.metrics import BASELINE, GROUP, MISSING, column_of
from dtbench.harness.measurement.sample import aggregated
from dtbench.harness.values import is_missing as is_missing  # the one missing-value test, re-exported for reports

KEY = [*GROUP, "label"]

# Below this many prompts after warmup (paired with AR's for a speedup; per side for a run-to-run test) no
# confidence interval and no verdict is shown, only "n too small". With n = 5 the t quantile of a 95% interval is
# 2.78 (n = 2: 12.7, n = 3: 4.30) and a two-sided Mann-Whitney U test can reach p = 0.008 (n = 3 per side: 0.10,
# never significant at 0.05); below that an interval mostly reflects two or three prompts' luck.
MIN_PROMPTS = 5
N_TOO_SMALL = "n too small"

FAMILY_UNKNOWN = "external"  # a cell whose decoder's family is not recorded (written before it was, not installed)

# The Lossless verdict of a sampled cell: its outputs are random, its exactness is a property of the distribution.
SAMPLED = "sampled (exact by construction, distribution-tested)"
# The Lossless verdict of a sampled cell whose decoder is lossy with its params (medusa's typical acceptance).
LOSSY = "lossy by design"

__all__ = [
    "BASELINE",
    "execution_of",
    "FAMILY_UNKNOWN",
    "collapse_batches",
    "is_remainder",
    "collapse_repeats",
    "per_prompt_rows",
    "remainder_mask",
    "GROUP",
    "KEY",
    "MIN_PROMPTS",
    "MISSING",
    "N_TOO_SMALL",
    "SAMPLED",
    "LOSSY",
    "baseline_values",
    "cell_lossless",
    "cell_throughput",
    "cell_value",
    "decoding",
    "family_of",
    "is_missing",
    "pairing_key",
    "show",
]


def cell_throughput(samples: Iterable) -> float:
    """A cell's throughput (tokens/s): the mean of its samples' throughput (T / total wall time, prefill included)
    after warmup, the repeats of a prompt (suite key ``repeats``) counted once as their median; NaN when no sample
    is left after warmup. The number every report, ``doctor`` and the cost model
    show for a cell (its speedup: this over the baseline cell's).

    Args:
        samples: the cell's samples (ORM rows, mappings or frame rows with ``throughput`` and ``warmup``).
    """
    by_prompt: dict[object, list[float]] = {}
    for i, s in enumerate(samples):
        v = column_of(s, "throughput")
        if bool(column_of(s, "warmup")) or is_missing(v):
            continue
        # repeats of a prompt (suite key repeats) count once, as their median (rows without a repeat are their own)
        by_prompt.setdefault(_prompt_key(s, i), []).append(float(v))
    values = [statistics.median(vs) for vs in by_prompt.values()]
    return sum(values) / len(values) if values else math.nan


def _prompt_key(sample, i: int) -> object:
    """The prompt a sample row measured, (cell, prompt index), so that its repeats are one prompt; a row that is one
    prompt already (collapsed by :func:`collapse_repeats`: it has ``repeats``) or has no such columns is its own."""
    try:
        column_of(sample, "repeats")
        return i  # collapsed already
    except (KeyError, AttributeError):
        pass
    try:
        return (column_of(sample, "cell_id"), column_of(sample, "prompt_index"))
    except (KeyError, AttributeError):
        return i


def cell_lossless(verdicts: Iterable[bool | None], sampled: bool = False, lossy: bool = False) -> str:
    """A cell's lossless verdict over every measured sample, warmup included: ``yes`` (every compared sample
    passed), ``no`` (one did not), :data:`MISSING` (nothing compared), :data:`SAMPLED` (a lossless decoder that
    samples: checked as a distribution by the tests, never against one draw).

    Args:
        verdicts: the samples' ``lossless`` column (None: not compared).
        sampled: the cell samples and its decoder declares itself lossless.
        lossy: the cell samples and its decoder declares itself lossy with its params: :data:`LOSSY`, never
            ``yes`` (medusa's typical acceptance).
    """
    if lossy:
        return LOSSY
    if sampled:
        return SAMPLED
    compared = [bool(v) for v in verdicts if not is_missing(v)]
    if not compared:
        return MISSING
    return "yes" if all(compared) else "no"


def decoding(sampling) -> str:
    """How a cell decodes: ``"greedy"``, or its sampling settings (a ``cells.sampling`` dict) as a canonical JSON
    string. Speedups pair a cell only with a baseline cell of the same decoding."""
    return json.dumps(sampling, sort_keys=True) if isinstance(sampling, dict) and sampling else "greedy"


def cell_value(rows: pd.DataFrame, metric: str) -> float:
    """One cell's value of ``metric`` from its per-prompt rows after warmup (:func:`dtbench.reports.views.compare.per_prompt`).

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


def show(value, spec: str = "", suffix: str = "") -> str:
    """``format(value, spec) + suffix``, or :data:`MISSING` for a missing value (:func:`is_missing`)."""
    return MISSING if is_missing(value) else format(value, spec) + suffix


def execution_of(row) -> str:
    """A cell's (or summary row's) execution mode: ``eager`` or ``compiled``; ``eager`` where it has none (stored
    before compiled execution existed, issue 37)."""
    value = row.get("execution") if hasattr(row, "get") else None
    return value if isinstance(value, str) and value else "eager"


def pairing_key(frame: pd.DataFrame, extra: tuple[str, ...] = ()) -> list[tuple]:
    """Per row: (run_id if the frame has one, dataset, L_max, T, B, *extra, execution, decoding): rows with equal keys
    are compared with each other (a compiled cell with the compiled baseline, issue 37); ``extra`` is e.g.
    ``("prompt_index",)`` for per-prompt pairs."""
    cols = [*(["run_id"] if "run_id" in frame else []), *GROUP, *extra]
    sampling = frame["sampling"] if "sampling" in frame else pd.Series([None] * len(frame), index=frame.index)
    execution = (
        frame["execution"].map(lambda v: v if isinstance(v, str) and v else "eager")
        if "execution" in frame
        else pd.Series(["eager"] * len(frame), index=frame.index)
    )

    def column(c: str):  # a frame from before batch sizes (issue 29) has no batch_size column: every row is B = 1
        return frame[c] if c in frame or c != "batch_size" else pd.Series([1] * len(frame), index=frame.index)

    return (
        [(*vals, e, decoding(s)) for vals, e, s in zip(zip(*(column(c) for c in cols)), execution, sampling)]
        if cols
        else []
    )


def served(measurer: object) -> bool:
    """Whether a cell was measured through requests to a server (issue 30), read from what is stored: its
    ``cells.measurer`` (``served``; revision 0016, backfilled for older cells), given as that value or as a cell, a
    row or a mapping holding it. Such a cell is compared with its own reference server (``cells.reference_label``),
    never with ``ar``: that would compare an engine with dtbench's loop. Anything without a measurer is local."""
    if isinstance(measurer, str):
        return measurer == SERVED
    if isinstance(measurer, dict):
        return measurer.get("measurer") == SERVED
    return getattr(measurer, "measurer", None) == SERVED


SERVED = (
    "served"  # cells.measurer of a cell measured through requests (harness/measurement/measurers.py: measurer_name)
)


def baseline_values(frame: pd.DataFrame, column: str, extra: tuple[str, ...] = (), missing=math.nan) -> pd.Series:
    """For every row of ``frame``, ``column`` of its baseline row: the first row whose decoder is :data:`BASELINE`
    with the same :func:`pairing_key` (same run, dataset, L_max, T and ``extra`` columns, same decoding: greedy
    with greedy, a sampling setting with the same setting). NaN where there is none.

    A cell measured through requests to a server (:func:`served`, read from its stored ``measurer``) is paired with
    its reference server (the row of its ``reference_label``, or the summary's
    ``reference``, with the same key), never with ``ar`` in this process: a server against dtbench's own loop is an
    engine-vs-harness comparison, not a speedup of speculation (issue 42 item 6), so a plain server (no reference)
    has no baseline here; ``report --engine`` shows the same pairing.

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
    by_label: dict[tuple, object] = {}
    labels = frame["label"] if "label" in frame else pd.Series([None] * len(frame), index=frame.index)
    for key, decoder, label, value in zip(keys, frame["decoder"], labels, frame[column]):
        if decoder == BASELINE and key not in base:
            base[key] = value
        by_label.setdefault((key, label), value)
    ref_column = next((c for c in ("reference_label", "reference") if c in frame), None)
    refs = frame[ref_column] if ref_column else pd.Series([None] * len(frame), index=frame.index)
    through = frame["measurer"].map(served) if "measurer" in frame else pd.Series(False, index=frame.index)
    values = [
        (by_label.get((k, ref), missing) if isinstance(ref, str) and ref else missing) if via else base.get(k, missing)
        for k, via, ref in zip(keys, through, refs)
    ]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return pd.Series(values, index=frame.index, dtype=float if numeric else object)


# Per-row columns a prompt group's row averages over its rows (the others are the batch's, or summed); declared with
# each column (harness/measurement/sample.py, ``aggregate`` metadata).
_ROW_MEANS = aggregated("row")


def is_remainder(batch_rows, batch_size, warmup) -> bool:
    """Whether one sample belongs to a remainder group: a batched cell's group of fewer than B prompts after the
    warmup (decoded as a smaller batch and marked, :class:`dtbench.harness.suites.plan.PromptGroup`). The one rule every
    report applies (the cell table through :func:`remainder_mask`, ``--profile`` per sample)."""
    if is_missing(batch_rows) or bool(warmup) is True:
        return False
    size = 1 if is_missing(batch_size) else int(batch_size)
    return int(batch_rows) < size


def remainder_mask(samples: pd.DataFrame) -> pd.Series:
    """Rows of a remainder group (:func:`is_remainder`); all False without batch columns."""
    if "batch_rows" not in samples or "batch_size" not in samples:
        return pd.Series(False, index=samples.index)
    warmup = samples["warmup"].fillna(False) if "warmup" in samples else pd.Series(False, index=samples.index)
    flags = [is_remainder(r, b, w) for r, b, w in zip(samples["batch_rows"], samples["batch_size"], warmup)]
    return pd.Series(flags, index=samples.index, dtype=bool)


def collapse_batches(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per prompt group for batched samples (``batch_group`` set), the other rows unchanged, in order.

    A group's row: ``prompt_index`` the group's first prompt (the pairing key, the same for every decoder),
    ``new_tokens`` the rows' sum, ``total_s`` the batch's wall time (``batch_total_s``), ``throughput`` their ratio
    (the total throughput at B, tokens/s over all rows), the per-row metrics (TTFT, TPOT, acceptance, tokens per
    iteration, ...) the mean over the rows, ``lossless`` True only if every row is; memory and energy are the batch's.
    """
    if "batch_group" not in samples or not samples["batch_group"].notna().any():
        return samples
    batched = samples["batch_group"].notna()
    out = []
    by = ["cell_id", "batch_group", *(["repeat"] if "repeat" in samples else [])]  # a group is batched per repeat
    for _, grp in samples[batched].groupby(by, sort=False):
        row = grp.iloc[0].copy()
        for c in _ROW_MEANS:
            if c in grp:
                values = pd.to_numeric(grp[c], errors="coerce")
                row[c] = float(values.mean()) if values.notna().any() else None
        tokens = int(pd.to_numeric(grp["new_tokens"]).sum())
        total = float(row["batch_total_s"])
        row["new_tokens"], row["total_s"] = tokens, total
        row["throughput"] = tokens / total if total > 0 else float("inf")
        row["prompt_index"] = int(row["batch_group"])
        if "lossless" in grp:
            verdicts = grp["lossless"].dropna()
            row["lossless"] = bool(verdicts.all()) if len(verdicts) else None
        out.append(row)
    groups = pd.DataFrame(out)
    return pd.concat([samples[~batched], groups]).sort_index(kind="stable")


# Per-prompt columns a prompt's row takes the median of over its repeats (the others are the first repeat's).
_REPEAT_MEDIANS = aggregated("row", "whole")


def repeated(samples: pd.DataFrame) -> bool:
    """Whether a samples frame holds repeats (suite key ``repeats``: a ``repeat`` above 0)."""
    return "repeat" in samples and bool((pd.to_numeric(samples["repeat"], errors="coerce").fillna(0) > 0).any())


def collapse_repeats(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per (cell, prompt) for a frame with repeats (``repeats: N``, issue 41), after
    :func:`collapse_batches`; a frame without repeats is returned as it is.

    A prompt's row: every per-prompt metric (throughput, times, acceptance, memory, energy) the *median* over its
    repeats, ``lossless`` True only if every repeat is, ``repeats`` the number of repeats and ``throughput_cv`` the
    coefficient of variation of its throughput over them (sample standard deviation / mean, NaN with one repeat).
    So a prompt counts once in every mean, standard deviation and paired speedup interval: repeats measure the
    machine's noise on a prompt, not more prompts.
    """
    if not repeated(samples):
        return samples
    out = []
    for _, grp in samples.groupby(["cell_id", "prompt_index"], sort=False):
        row = grp.iloc[0].copy()
        for c in _REPEAT_MEDIANS:
            if c in grp:
                values = pd.to_numeric(grp[c], errors="coerce")
                row[c] = float(values.median()) if values.notna().any() else None
        thr = pd.to_numeric(grp["throughput"], errors="coerce").dropna()
        row["repeats"] = len(grp)
        row["throughput_cv"] = float(thr.std(ddof=1) / thr.mean()) if len(thr) > 1 and thr.mean() else math.nan
        if "lossless" in grp:
            verdicts = grp["lossless"].dropna()
            row["lossless"] = bool(verdicts.astype(bool).all()) if len(verdicts) else None
        out.append(row)
    return pd.DataFrame(out)


def per_prompt_rows(samples: pd.DataFrame) -> pd.DataFrame:
    """The rows every statistic counts: a batched prompt group as one row (:func:`collapse_batches`), a prompt's
    repeats as one row (:func:`collapse_repeats`)."""
    return collapse_repeats(collapse_batches(samples))
