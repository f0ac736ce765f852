"""Comparisons with statistics: speedup confidence intervals within a run, and run-to-run regressions.

Two questions, both answered from the stored per-prompt samples (warmup samples excluded, paper section 4.1):

- Within one run (``dtbench report --compare``): is each decoder faster than the AR baseline of the same
  dataset, L_max and T, and by how much? Speedup = mean throughput / mean AR throughput (as in Table 1),
  with a t confidence interval over the paired per-prompt ratios (:func:`speedup_table`, :func:`paired_ratio_ci`).
- Fewer than :data:`MIN_PROMPTS` prompts after warmup give no interval and no verdict or mark: "n too small".
- Between two runs (``dtbench report --compare BEFORE AFTER``): for each cell matched by (dataset, L_max,
  T, label), did throughput change, and is the change more than noise? A Mann-Whitney U test on the per-prompt
  throughputs gives the mark, asv-style (:func:`compare_runs`); a gate (:class:`Gate`) turns a significant
  change beyond a threshold into exit code 1.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from dtbench.harness.errors import DtbenchError
from dtbench.harness.measurement.metrics import ALIASES, GATEABLE, Metric
from dtbench.harness.measurement.metrics import METRICS as REGISTRY
from dtbench.harness.store.runs import MUST_MATCH
from dtbench.harness.suites.grouping import CellKey
from dtbench.reports.stats import (
    GROUP,
    MIN_PROMPTS,
    N_TOO_SMALL,
    baseline_values,
    cell_value,
    is_missing,
    per_prompt_rows,
    remainder_mask,
)

# Marks of a run-to-run comparison, in the order a reader cares about them.
BETTER, WORSE, NOT_SIGNIFICANT = "better", "worse", "not significant"
NOT_COMPARABLE, NEWLY_FAILING, FAILING, FIXED = "not comparable", "newly failing", "still failing", "no longer failing"
NEW, MISSING = "new", "missing"
COMPARABLE_MARKS = (BETTER, WORSE, NOT_SIGNIFICANT)
UNCHANGED_MARKS = (NOT_SIGNIFICANT, FAILING)


# Metrics a comparison or gate can read, and the names --fail-if also accepts: from the one metric registry.
METRICS = GATEABLE


def per_prompt(frame: pd.DataFrame) -> pd.DataFrame:
    """Non-warmup samples of a :func:`~dtbench.reports.views.summary.samples_frame`, with every metric of METRICS.

    Adds every metric of the registry (:data:`dtbench.harness.measurement.metrics.METRICS`) in its display unit (``ttft_ms``,
    ``tpot_ms`` in ms, ``peak_mib`` in MiB, ...) and ``speedup``: the paired per-prompt ratio, the sample's
    throughput over its baseline's on the same prompt (:func:`~dtbench.reports.stats.baseline_values`: the AR cell
    of the same dataset, L_max, T and batch size that decodes the same way); NaN without one. At B > 1 a row is a
    prompt group (:func:`~dtbench.reports.stats.collapse_batches`: total throughput over its rows), so the pairs are
    per group; remainder groups are left out. With repeats a row is a prompt, the median over its repeats
    (:func:`~dtbench.reports.stats.collapse_repeats`): speedups pair prompts, never repeats.
    """
    s = frame[frame["has_sample"] & ~frame["warmup"].fillna(True).astype(bool)]
    # B > 1: one row per prompt group, remainder left out; repeats: one row per prompt, the median over its repeats
    s = per_prompt_rows(s[~remainder_mask(s)]).copy()
    if s.empty:
        return s.assign(**{m.name: [] for m in REGISTRY}, baseline_throughput=[], speedup=[])
    for m in REGISTRY:
        s[m.name] = m.values(s)
    s["baseline_throughput"] = baseline_values(s, "throughput", ("prompt_index",))
    s["speedup"] = s["throughput"] / s["baseline_throughput"]
    return s


# How the within-run speedup interval is computed, for captions (terminal, Markdown, HTML).
SPEEDUP_CI_METHOD = (
    f"CI: Student t-interval on the log of the paired per-prompt ratios (decoder / AR throughput on "
    f"the same prompt), i.e. around their geometric mean; '{N_TOO_SMALL}' below {MIN_PROMPTS} paired "
    "prompts after warmup"
)


def paired_ratio_ci(ratios, confidence: float = 0.95) -> tuple[float, float, float, str]:
    """Confidence interval of the typical per-prompt speedup from paired ratios r_i = decoder / AR throughput on
    prompt i (same prompt, same T, both after warmup).

    Method: a Student t-interval on log r_i (``scipy.stats.t``), exponentiated: exp(mean ± t_{n-1} · sd / √n), a
    CI of the geometric mean of the ratios. Why this and not a bootstrap:

    - *Paired*: the decoder and AR ran on the same prompts, so the per-prompt ratio cancels prompt difficulty
      (prompt length and text shift both throughputs); resampling the two throughput lists apart ignores that.
    - *Logs*: speedups multiply; on the log scale 0.5× and 2× are symmetric and ratios are close to normal.
    - *t, not bootstrap*: with the paper's 8 prompts after warmup a bootstrap interval is too narrow (a resample of
      8 values has few distinct means and the plug-in spread ignores the n - 1 correction): simulated on normal
      data (400 draws, scipy.stats.bootstrap), a nominal 95% interval covered 87% (percentile) and 86% (BCa) at
      n = 8, 85% at n = 5, against 94-96% for the t-interval, whose n - 1 degrees of freedom account for
      estimating the spread.

    Args:
        ratios: positive per-prompt speedups (×), NaN and non-positive values dropped.
        confidence: two-sided level, 0.95 for a 95% interval.

    Returns:
        (geometric mean, low, high, method). Method ``paired t (log ratios)``; ``degenerate`` when every ratio is
        the same (low = high = that ratio); ``n too small`` with fewer than :data:`MIN_PROMPTS` ratios (low and
        high NaN; the point is still the geometric mean of those given, NaN if none).
    """
    r = np.asarray([v for v in np.asarray(ratios, dtype=float) if np.isfinite(v) and v > 0])
    logs = np.log(r)
    point = float(np.exp(logs.mean())) if len(r) else math.nan
    if len(r) < MIN_PROMPTS:
        return point, math.nan, math.nan, N_TOO_SMALL
    sd = float(logs.std(ddof=1))
    if sd == 0:
        return point, point, point, "degenerate"
    half = float(stats.t.ppf(0.5 + confidence / 2, len(r) - 1)) * sd / math.sqrt(len(r))
    return point, float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half)), "paired t (log ratios)"


def speedup_table(frame: pd.DataFrame, *, confidence: float = 0.95) -> pd.DataFrame:
    """Every decoder against the AR cell of the same dataset, L_max and T that decodes the same way (greedy, or
    the same sampling settings), with a paired confidence interval.

    Args:
        frame: :func:`~dtbench.reports.views.summary.samples_frame` of one run.
        confidence: CI level (``1 - alpha``).

    Returns:
        One row per non-AR cell: dataset, l_max, gen_length, label, decoder, status, partial (the cell failed
        after some prompts), not_lossless (declared lossless, and a sample failed the lossless check), n (prompts after warmup measured by both the decoder and AR), throughput_mean and
        ar_throughput_mean (tokens/s, every prompt after warmup), speedup (ratio of those means, Table 1's
        definition), paired_speedup (geometric mean of the n per-prompt ratios), ci_low, ci_high and ci_method
        (:func:`paired_ratio_ci`) and verdict: ``faster`` (the CI lies above 1), ``slower`` (below 1), ``not
        significant`` (it contains 1), ``n too small`` (n < :data:`MIN_PROMPTS`: no CI either), ``failed`` (no
        sample) or ``no AR baseline``; a partial cell's verdict ends in `` (partial)``.
    """
    s = per_prompt(frame)
    s_keys = [CellKey.of_row(r) for _, r in s.iterrows()]
    rows = []
    for _, cells in frame.groupby(GROUP, sort=False):
        ck = CellKey.of_row(cells.iloc[0])
        group = s[[k == ck for k in s_keys]]
        first_rows = cells.drop_duplicates("cell_id")
        ar_label_of = dict(zip(first_rows["label"], baseline_values(first_rows, "label", missing=None)))
        for label in dict.fromkeys(cells["label"]):
            if ar_label_of[label] == label:  # a baseline cell itself
                continue
            ar_label = ar_label_of[label]
            ar = group[group["label"] == ar_label].set_index("prompt_index")["throughput"] if ar_label else None
            mine_cells = cells[cells["label"] == label]
            first = mine_cells.iloc[0]
            partial = first["status"] == "failed" and bool(mine_cells["has_sample"].any())
            # a cell declared lossless with a sample that failed the check (render.NOT_LOSSLESS_MARK)
            not_lossless = bool(first["lossless_expected"]) and bool((mine_cells["lossless"] == False).any())  # noqa: E712
            mine = group[group["label"] == label].set_index("prompt_index")["throughput"]
            row = dict(
                **ck.columns(),
                label=label,
                decoder=first["decoder"],
                status=first["status"],
                partial=partial,
                not_lossless=not_lossless,
                n=0,
                throughput_mean=mine.mean() if len(mine) else math.nan,
                ar_throughput_mean=math.nan,
                speedup=math.nan,
                paired_speedup=math.nan,
                ci_low=math.nan,
                ci_high=math.nan,
                ci_method="",
            )
            if first["status"] == "failed" and not partial:
                row["verdict"] = "failed"
            elif ar is None or ar.empty:
                row["verdict"] = "no AR baseline"
            else:
                row["ar_throughput_mean"] = ar.mean()
                row["speedup"] = row["throughput_mean"] / ar.mean() if len(mine) else math.nan
                common = mine.index.intersection(ar.index)
                ratios = (mine.loc[common] / ar.loc[common]).to_numpy()
                point, low, high, method = paired_ratio_ci(ratios, confidence)
                row.update(n=len(common), paired_speedup=point, ci_low=low, ci_high=high, ci_method=method)
                if math.isnan(low):
                    row["verdict"] = N_TOO_SMALL
                else:
                    row["verdict"] = "faster" if low > 1 else "slower" if high < 1 else NOT_SIGNIFICANT
                if partial:
                    row["verdict"] += " (partial)"
            rows.append(row)
    # batch_size last: the columns before it are those of the tables before batch sizes existed
    return pd.DataFrame(
        rows,
        columns=[
            *GROUP[:3],
            "label",
            "decoder",
            "status",
            "partial",
            "not_lossless",
            "n",
            "throughput_mean",
            "ar_throughput_mean",
            "speedup",
            "paired_speedup",
            "ci_low",
            "ci_high",
            "ci_method",
            "verdict",
            "batch_size",
        ],
    )


# --- run to run --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gate:
    """``--fail-if METRIC:THRESHOLD``: trip when a comparable cell's metric changed beyond the threshold in the
    bad direction AND the change is significant (Mann-Whitney U, p < alpha).

    ``THRESHOLD`` is relative with ``%`` (``-5%``: a drop of more than 5%) or absolute in the metric's unit
    (``+2``: ms for ``ttft_ms``). Its sign names the bad direction; without a sign the metric's own bad
    direction is used (lower throughput, speedup, acceptance, L, ℓ; higher TTFT, TPOT, #Iter, memory).
    """

    text: str
    metric: Metric
    amount: float  # > = 0, percent points when relative
    relative: bool
    bad_is_increase: bool

    @classmethod
    def parse(cls, text: str) -> Gate:
        """Parse ``METRIC:THRESHOLD``.

        Raises:
            DtbenchError: unknown metric or malformed threshold (one line naming the valid forms).
        """
        name, sep, threshold = text.partition(":")
        name = ALIASES.get(name.strip(), name.strip())
        if not sep or name not in METRICS:
            raise DtbenchError(
                f"--fail-if {text!r}: expected METRIC:THRESHOLD with METRIC one of "
                f"{', '.join(METRICS)} (e.g. throughput:-5%)"
            )
        m = re.fullmatch(r"\s*([+-])?\s*(\d+(?:\.\d+)?)\s*(%)?\s*", threshold)
        if not m:
            raise DtbenchError(f"--fail-if {text!r}: threshold must look like -5%, +10%, 5% or an absolute +2")
        metric = METRICS[name]
        sign, amount, pct = m.groups()
        bad_up = (sign == "+") if sign else not metric.higher_is_better
        return cls(text=text, metric=metric, amount=float(amount), relative=bool(pct), bad_is_increase=bad_up)

    def beyond(self, before: float, after: float) -> bool:
        """True when the change before -> after exceeds the threshold in the bad direction."""
        if any(v is None or math.isnan(v) for v in (before, after)):
            return False
        change = after - before
        if self.relative:
            if before == 0:
                return False
            change = 100.0 * change / abs(before)
        return change > self.amount if self.bad_is_increase else change < -self.amount


def mann_whitney(before, after) -> float:
    """Two-sided Mann-Whitney U p-value of two samples (NaN dropped); NaN if either side is empty, 1.0 if every
    value on both sides is the same."""
    b = np.asarray([v for v in before if not pd.isna(v)], dtype=float)
    a = np.asarray([v for v in after if not pd.isna(v)], dtype=float)
    if len(a) == 0 or len(b) == 0:
        return math.nan
    if np.all(a == a[0]) and np.all(b == a[0]):
        return 1.0
    return float(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue)


Labelled = tuple[CellKey, str]  # a cell of a run: its point and B (CellKey), its label


def _cells(frame: pd.DataFrame) -> dict[Labelled, pd.Series]:
    return {(CellKey.of_row(r), str(r["label"])): r for _, r in frame.drop_duplicates("cell_id").iterrows()}


def _pairing(row: dict, key: Labelled, paired: dict[Labelled, Labelled]) -> str:
    """For a cell paired across a label change: ``row``'s label set to ``before → after``; the note saying so."""
    if key not in paired:
        return ""
    (_, before), (_, after) = key, paired[key]
    row["label"] = f"{before} → {after}"
    return f"paired by decoder and params (labelled '{before}' before, '{after}' after)"


def _paired_by_identity(cb: dict[Labelled, pd.Series], ca: dict[Labelled, pd.Series]) -> dict[Labelled, Labelled]:
    """{before key: after key} for cells that match under no label but do by what they measured (issue 67): the
    same point (dataset, L_max, T, B), decoder and params, and exactly one such cell on each side. The label is a
    name the user chose; renaming it between runs must not turn one cell into a "missing" and a "new" one."""

    def identity(key: Labelled, row: pd.Series) -> tuple[CellKey, str, str]:
        return (key[0], row["decoder"], json.dumps(row["params"] or {}, sort_keys=True, default=str))

    def unique(
        cells: dict[Labelled, pd.Series], others: dict[Labelled, pd.Series]
    ) -> dict[tuple[CellKey, str, str], Labelled]:
        seen: dict[tuple[CellKey, str, str], list[Labelled]] = {}
        for key, row in cells.items():
            if key not in others:
                seen.setdefault(identity(key, row), []).append(key)
        return {ident: keys[0] for ident, keys in seen.items() if len(keys) == 1}

    before, after = unique(cb, ca), unique(ca, cb)
    return {key: after[ident] for ident, key in before.items() if ident in after}


def _partial_cells(frame: pd.DataFrame) -> set[int]:
    """Ids of the cells of a samples frame that failed after some prompts were measured."""
    measured = frame[frame["has_sample"] & (frame["status"] == "failed")]
    return set(int(c) for c in measured["cell_id"].unique())


def _norm(v):
    return None if is_missing(v) else v


def _differences(b: pd.Series, a: pd.Series, env_reasons: list[str]) -> list[str]:
    reasons = []
    if b["decoder"] != a["decoder"]:
        reasons.append(f"decoder {b['decoder']} → {a['decoder']}")
    if str(b["decoder_version"]) != str(a["decoder_version"]):
        reasons.append(f"decoder version {b['decoder_version']} → {a['decoder_version']}")
    if (b["params"] or {}) != (a["params"] or {}):
        pb, pa = b["params"] or {}, a["params"] or {}
        changed = [f"{k} {pb.get(k)!r} → {pa.get(k)!r}" for k in sorted(set(pb) | set(pa)) if pb.get(k) != pa.get(k)]
        reasons.append("params " + ", ".join(changed))
    for col, what in (("target_model", "target"), ("draft_model", "draft")):
        if _norm(b.get(col)) != _norm(a.get(col)):
            reasons.append(f"{what} {b.get(col)} → {a.get(col)}")
    return reasons + env_reasons


def env_differences(before_env: dict, after_env: dict) -> list[str]:
    """The environment keys two measurements must share (:data:`dtbench.harness.store.runs.MUST_MATCH`, the list
    ``--resume-run`` checks too) on which two runs' environments differ, as ``"torch 2.5.0 → 2.6.0"``, and the hardware flags
    (``environment["hardware"]``, :func:`~dtbench.harness.measurement.machine.hardware_flags`) when both runs recorded them:
    the same CPU model with and without AVX-512 BF16 (a VM hiding it) gives opposite bf16 results."""
    before_env, after_env = before_env or {}, after_env or {}
    out = [f"{k} {before_env.get(k)} → {after_env.get(k)}" for k in MUST_MATCH if before_env.get(k) != after_env.get(k)]
    hb, ha = before_env.get("hardware"), after_env.get("hardware")
    if hb and ha and hb != ha:
        from dtbench.reports.rendering.render import hardware_text

        out.append(f"hardware {hardware_text(before_env) or '?'} → {hardware_text(after_env) or '?'}")
    return out


def _tripped(gates: Sequence[Gate], vb: pd.DataFrame, va: pd.DataFrame, where: str, alpha: float) -> list[str]:
    """One line per gate tripped by a comparable cell: its metric moved beyond the threshold in the bad direction
    and the change is significant (Mann-Whitney U p < ``alpha`` on the per-prompt values ``vb`` -> ``va``)."""
    failures = []
    for g in gates:
        col = g.metric.name
        mb, ma = cell_value(vb, col), cell_value(va, col)
        if g.beyond(mb, ma):
            pg = mann_whitney(vb[col], va[col])
            if pg < alpha:
                change = (
                    f"{100 * (ma - mb) / abs(mb):+.1f}%" if g.relative and mb else f"{ma - mb:+.4g} {g.metric.unit}"
                )
                failures.append(f"{g.text}: {where} {col} {mb:.4g} → {ma:.4g} ({change}, p={pg:.3g})")
    return failures


# the columns of compare_runs' table, in order
RUN_COLUMNS = [*GROUP[:3], "label", "before", "after", "before_partial", "after_partial", "ratio", "p_value", "mark"]
RUN_COLUMNS += ["note", "batch_size"]


def compare_runs(
    before: pd.DataFrame,
    after: pd.DataFrame,
    *,
    before_env: dict,
    after_env: dict,
    alpha: float = 0.05,
    gates: Sequence[Gate] = (),
) -> tuple[pd.DataFrame, list[str]]:
    """Match two runs' cells by (dataset, L_max, T, label) and mark each change.

    Args:
        before, after: :func:`~dtbench.reports.views.summary.samples_frame` of the two runs.
        before_env, after_env: the runs' ``environment`` JSON (versions and device).
        alpha: significance level of the Mann-Whitney U test.
        gates: ``--fail-if`` gates to evaluate on comparable cells.

    Returns:
        (table, gate_failures). Table rows: dataset, l_max, gen_length, label, before and after (mean
        throughput after warmup, tokens/s), before_partial and after_partial (that run's cell failed after some
        prompts: its mean covers those only), ratio (after / before), p_value, mark and note. Marks: ``better`` /
        ``worse`` (p < alpha, by the direction of the mean), ``not significant``, ``n too small`` (fewer than
        :data:`MIN_PROMPTS` prompts after warmup on either side: no test, no gate), ``not comparable`` (params,
        decoder or its version, models, or dtbench/torch/transformers/device or hardware flags differ; or no samples after warmup),
        ``newly failing``, ``still failing``, ``no longer failing``, ``new`` (only after), ``missing`` (only
        before). gate_failures: one line per tripped (gate, cell); a newly failing cell trips every gate.
    """
    pb, pa = per_prompt(before), per_prompt(after)
    cb, ca = _cells(before), _cells(after)
    partial_b, partial_a = _partial_cells(before), _partial_cells(after)
    env_reasons = env_differences(before_env, after_env)
    paired = _paired_by_identity(cb, ca)
    rows, failures = [], []
    for key in list(cb) + [k for k in ca if k not in cb and k not in paired.values()]:
        b, a = cb.get(key), ca.get(key if key not in paired else paired[key])
        ck, label = key
        row = dict(
            **ck.columns(),
            label=label,
            before=math.nan,
            after=math.nan,
            ratio=math.nan,
            p_value=math.nan,
            note="",
            before_partial=b is not None and b["cell_id"] in partial_b,
            after_partial=a is not None and a["cell_id"] in partial_a,
        )
        vb = pb[pb["cell_id"] == b["cell_id"]] if b is not None else pb.iloc[0:0]
        va = pa[pa["cell_id"] == a["cell_id"]] if a is not None else pa.iloc[0:0]
        if len(vb):
            row["before"] = vb["throughput"].mean()
        if len(va):
            row["after"] = va["throughput"].mean()
        if len(vb) and len(va):
            row["ratio"] = row["after"] / row["before"]
        pairing = _pairing(row, key, paired)
        where = f"{ck.dataset} L_max={ck.l_max} T={ck.gen_length}" + (
            f" B={ck.batch_size}" if ck.batch_size != 1 else ""
        )
        where += f" {label}"
        if b is None:
            row["mark"] = NEW
        elif a is None:
            row["mark"] = MISSING
        elif a["status"] == "failed" and b["status"] != "failed":
            row["mark"], row["note"] = NEWLY_FAILING, str(a["error"] or "")[:200]
            failures += [f"{g.text}: {where} newly failing" for g in gates]
        elif a["status"] == "failed":
            row["mark"], row["note"] = FAILING, str(a["error"] or "")[:200]
        elif b["status"] == "failed":
            row["mark"] = FIXED
        elif reasons := _differences(b, a, env_reasons):
            row["mark"], row["note"] = NOT_COMPARABLE, "; ".join(reasons)
        elif not len(vb) or not len(va):
            row["mark"], row["note"] = (
                NOT_COMPARABLE,
                "no samples after warmup " + ("before" if not len(vb) else "after"),
            )
        elif min(len(vb), len(va)) < MIN_PROMPTS:
            row["mark"] = N_TOO_SMALL
            row["note"] = f"{len(vb)} before, {len(va)} after: fewer than {MIN_PROMPTS} prompts after warmup"
        else:
            p = mann_whitney(vb["throughput"], va["throughput"])
            row["p_value"] = p
            if p < alpha:
                row["mark"] = BETTER if row["after"] > row["before"] else WORSE
            else:
                row["mark"] = NOT_SIGNIFICANT
            failures += _tripped(gates, vb, va, where, alpha)
        if pairing:
            row["note"] = f"{pairing}; {row['note']}" if row["note"] else pairing
        rows.append(row)
    return pd.DataFrame(rows, columns=RUN_COLUMNS), failures
