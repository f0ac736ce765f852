"""Comparisons with statistics: speedup confidence intervals within a run, and run-to-run regressions.

Two questions, both answered from the stored per-prompt samples (warmup samples excluded, paper section 4.1):

- Within one run (``dtbench report --compare``): is each decoder faster than the AR baseline of the same
  dataset, prompt cap and T, and by how much? Speedup = mean throughput / mean AR throughput (as in Table 1),
  with a bootstrap confidence interval over prompts (:func:`speedup_table`).
- Between two runs (``dtbench report --compare BEFORE AFTER``): for each cell matched by (dataset, prompt cap,
  T, label), did throughput change, and is the change more than noise? A Mann-Whitney U test on the per-prompt
  throughputs gives the mark, asv-style (:func:`compare_runs`); a gate (:class:`Gate`) turns a significant
  change beyond a threshold into exit code 1.
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from dtbench.harness.errors import DtbenchError
from dtbench.reports.summary import GROUP, KEY, MIB

# Marks of a run-to-run comparison, in the order a reader cares about them.
BETTER, WORSE, NOT_SIGNIFICANT = "better", "worse", "not significant"
NOT_COMPARABLE, NEWLY_FAILING, FAILING, FIXED = "not comparable", "newly failing", "still failing", "no longer failing"
NEW, MISSING = "new", "missing"
COMPARABLE_MARKS = (BETTER, WORSE, NOT_SIGNIFICANT)
UNCHANGED_MARKS = (NOT_SIGNIFICANT, FAILING)

# Run environment keys that must match for timings to be comparable (DESIGN.md "Database": runs.environment).
ENV_KEYS = ("dtbench", "torch", "transformers", "device_name")


@dataclass(frozen=True)
class Metric:
    """A per-prompt metric a comparison or gate can read: its column, unit and which direction is better."""

    name: str
    unit: str
    higher_is_better: bool


METRICS = {
    "throughput": Metric("throughput", "tokens/s", True),
    "speedup": Metric("speedup", "×", True),
    "ttft_ms": Metric("ttft_ms", "ms", False),
    "tpot_ms": Metric("tpot_ms", "ms", False),
    "acceptance_rate": Metric("acceptance_rate", "fraction", True),
    "tokens_per_iteration": Metric("tokens_per_iteration", "tokens", True),
    "mean_path_length": Metric("mean_path_length", "tokens", True),
    "iterations": Metric("iterations", "iterations", False),
    "peak_mib": Metric("peak_mib", "MiB", False),
}
ALIASES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "acceptance": "acceptance_rate", "accept": "acceptance_rate",
           "L": "tokens_per_iteration", "l": "mean_path_length", "path_length": "mean_path_length",
           "iter": "iterations", "memory": "peak_mib", "peak_memory": "peak_mib", "mem": "peak_mib",
           "tps": "throughput"}


def per_prompt(frame: pd.DataFrame) -> pd.DataFrame:
    """Non-warmup samples of a :func:`~dtbench.reports.summary.samples_frame`, with every metric of METRICS.

    Adds ``ttft_ms``, ``tpot_ms`` (milliseconds), ``peak_mib`` (MiB: torch allocator peak on CUDA, RSS peak on
    CPU) and ``speedup`` (the sample's throughput over the AR throughput on the same prompt of the same dataset,
    cap and T; NaN without an AR sample).
    """
    s = frame[frame["has_sample"] & ~frame["warmup"].fillna(True).astype(bool)].copy()
    if s.empty:
        return s.assign(ttft_ms=[], tpot_ms=[], peak_mib=[], speedup=[])
    s["ttft_ms"] = s["ttft_s"].astype(float) * 1e3
    s["tpot_ms"] = s["tpot_s"].astype(float) * 1e3
    alloc, rss = s["peak_allocated_bytes"].astype(float), s["peak_rss_bytes"].astype(float)
    s["peak_mib"] = alloc.where(alloc.notna(), rss) / MIB
    for col in ("acceptance_rate", "mean_path_length", "throughput", "tokens_per_iteration", "iterations"):
        s[col] = s[col].astype(float)
    ar = s[s["decoder"] == "ar"].drop_duplicates([*GROUP, "prompt_index"]).set_index([*GROUP, "prompt_index"])["throughput"]
    idx = pd.MultiIndex.from_frame(s[[*GROUP, "prompt_index"]])
    s["speedup"] = s["throughput"].to_numpy() / ar.reindex(idx).to_numpy()
    return s


def _rng_kw(seed: int) -> dict:
    # scipy >= 1.15 names it `rng`; older releases `random_state`.
    name = "rng" if "rng" in inspect.signature(stats.bootstrap).parameters else "random_state"
    return {name: np.random.default_rng(seed)}


def _ratio_of_means(x, y, axis=-1):
    return np.mean(x, axis=axis) / np.mean(y, axis=axis)


def ratio_ci(x, y, *, paired: bool, confidence: float = 0.95, n_resamples: int = 9999,
             seed: int = 0) -> tuple[float, float, str]:
    """Bootstrap confidence interval of mean(x) / mean(y), resampling prompts.

    Args:
        x, y: per-prompt throughputs (tokens/s) of a decoder and of AR; equal length and aligned by prompt
            when ``paired`` (the same prompts resampled together, which cancels prompt difficulty).
        confidence: two-sided level, 0.95 for a 95% interval.

    Returns:
        (low, high, method): BCa interval from scipy.stats.bootstrap; ``percentile`` where BCa is undefined
        (e.g. every resample gives the same ratio); (nan, nan, "n<2") with fewer than two prompts.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or len(y) < 2:
        return math.nan, math.nan, "n<2"
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = stats.bootstrap((x, y), _ratio_of_means, paired=paired, vectorized=True, n_resamples=n_resamples,
                                  confidence_level=confidence, method=method, **_rng_kw(seed))
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if not (math.isnan(low) or math.isnan(high)):
            return low, high, f"{'paired' if paired else 'independent'} {method}"
    point = float(np.mean(x) / np.mean(y))
    return point, point, "degenerate"


def speedup_table(frame: pd.DataFrame, *, confidence: float = 0.95, n_resamples: int = 9999,
                  seed: int = 0) -> pd.DataFrame:
    """Every decoder against the AR cell of the same dataset, prompt cap and T, with a bootstrap CI.

    Args:
        frame: :func:`~dtbench.reports.summary.samples_frame` of one run.
        confidence: CI level (``1 - alpha``).

    Returns:
        One row per non-AR cell: dataset, prompt_cap, gen_length, label, decoder, n (prompts after warmup),
        throughput_mean and ar_throughput_mean (tokens/s), speedup (ratio of means, Table 1's definition),
        ci_low, ci_high, ci_method and verdict: ``faster`` (the CI lies above 1), ``slower`` (below 1),
        ``not significant`` (it contains 1), ``failed``, ``no AR baseline`` or ``too few prompts``. Samples are paired by
        prompt index when the decoder and AR measured the same prompts, otherwise resampled independently.
    """
    s = per_prompt(frame)
    rows = []
    for key, cells in frame.groupby(GROUP, sort=False):
        group = s[(s["dataset"] == key[0]) & (s["prompt_cap"] == key[1]) & (s["gen_length"] == key[2])]
        ar_label = next((lbl for lbl, d in zip(cells["label"], cells["decoder"]) if d == "ar"), None)
        ar = group[group["label"] == ar_label].set_index("prompt_index")["throughput"] if ar_label else None
        for label in dict.fromkeys(cells["label"]):
            if label == ar_label:
                continue
            first = cells[cells["label"] == label].iloc[0]
            mine = group[group["label"] == label].set_index("prompt_index")["throughput"]
            row = dict(zip(GROUP, key), label=label, decoder=first["decoder"], status=first["status"], n=len(mine),
                       throughput_mean=mine.mean() if len(mine) else math.nan, ar_throughput_mean=math.nan,
                       speedup=math.nan, ci_low=math.nan, ci_high=math.nan, ci_method="")
            if first["status"] == "failed" and not len(mine):
                row["verdict"] = "failed"
            elif ar is None or ar.empty:
                row["verdict"] = "no AR baseline"
            else:
                row["ar_throughput_mean"] = ar.mean()
                row["speedup"] = row["throughput_mean"] / ar.mean() if len(mine) else math.nan
                paired = len(mine) > 0 and set(mine.index) == set(ar.index)
                x, y = (mine.sort_index().to_numpy(), ar.sort_index().to_numpy()) if paired else (mine.to_numpy(), ar.to_numpy())
                low, high, method = ratio_ci(x, y, paired=paired, confidence=confidence, n_resamples=n_resamples, seed=seed)
                row.update(ci_low=low, ci_high=high, ci_method=method)
                if math.isnan(low):
                    row["verdict"] = "too few prompts"
                else:
                    row["verdict"] = "faster" if low > 1 else "slower" if high < 1 else NOT_SIGNIFICANT
            rows.append(row)
    return pd.DataFrame(rows, columns=[*GROUP, "label", "decoder", "status", "n", "throughput_mean",
                                       "ar_throughput_mean", "speedup", "ci_low", "ci_high", "ci_method", "verdict"])


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
    def parse(cls, text: str) -> "Gate":
        """Parse ``METRIC:THRESHOLD``.

        Raises:
            DtbenchError: unknown metric or malformed threshold (one line naming the valid forms).
        """
        name, sep, threshold = text.partition(":")
        name = ALIASES.get(name.strip(), name.strip())
        if not sep or name not in METRICS:
            raise DtbenchError(f"--fail-if {text!r}: expected METRIC:THRESHOLD with METRIC one of "
                               f"{', '.join(METRICS)} (e.g. throughput:-5%)")
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


def _cells(frame: pd.DataFrame) -> dict[tuple, pd.Series]:
    return {tuple(r[k] for k in KEY): r for _, r in frame.drop_duplicates("cell_id").iterrows()}


def _norm(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


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
    """The ENV_KEYS on which two runs' environments differ, as ``"torch 2.5.0 → 2.6.0"``."""
    before_env, after_env = before_env or {}, after_env or {}
    return [f"{k} {before_env.get(k)} → {after_env.get(k)}" for k in ENV_KEYS if before_env.get(k) != after_env.get(k)]


def compare_runs(before: pd.DataFrame, after: pd.DataFrame, *, before_env: dict, after_env: dict,
                 alpha: float = 0.05, gates: list[Gate] = ()) -> tuple[pd.DataFrame, list[str]]:
    """Match two runs' cells by (dataset, prompt cap, T, label) and mark each change.

    Args:
        before, after: :func:`~dtbench.reports.summary.samples_frame` of the two runs.
        before_env, after_env: the runs' ``environment`` JSON (versions and device).
        alpha: significance level of the Mann-Whitney U test.
        gates: ``--fail-if`` gates to evaluate on comparable cells.

    Returns:
        (table, gate_failures). Table rows: dataset, prompt_cap, gen_length, label, before and after (mean
        throughput after warmup, tokens/s), ratio (after / before), p_value, mark and note. Marks: ``better`` /
        ``worse`` (p < alpha, by the direction of the mean), ``not significant``, ``not comparable`` (params,
        decoder or its version, models, or dtbench/torch/transformers/device differ; or no samples after warmup),
        ``newly failing``, ``still failing``, ``no longer failing``, ``new`` (only after), ``missing`` (only
        before). gate_failures: one line per tripped (gate, cell); a newly failing cell trips every gate.
    """
    pb, pa = per_prompt(before), per_prompt(after)
    cb, ca = _cells(before), _cells(after)
    env_reasons = env_differences(before_env, after_env)
    rows, failures = [], []
    for key in list(cb) + [k for k in ca if k not in cb]:
        b, a = cb.get(key), ca.get(key)
        row = dict(zip(KEY, key), before=math.nan, after=math.nan, ratio=math.nan, p_value=math.nan, note="")
        vb = pb[pb["cell_id"] == b["cell_id"]] if b is not None else pb.iloc[0:0]
        va = pa[pa["cell_id"] == a["cell_id"]] if a is not None else pa.iloc[0:0]
        if len(vb):
            row["before"] = vb["throughput"].mean()
        if len(va):
            row["after"] = va["throughput"].mean()
        if len(vb) and len(va):
            row["ratio"] = row["after"] / row["before"]
        where = f"{key[0]} L={key[1]} T={key[2]} {key[3]}"
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
            row["mark"], row["note"] = NOT_COMPARABLE, "no samples after warmup " + ("before" if not len(vb) else "after")
        else:
            p = mann_whitney(vb["throughput"], va["throughput"])
            row["p_value"] = p
            if p < alpha:
                row["mark"] = BETTER if row["after"] > row["before"] else WORSE
            else:
                row["mark"] = NOT_SIGNIFICANT
            for g in gates:
                col = g.metric.name
                mb, ma = vb[col].mean(), va[col].mean()
                if g.beyond(mb, ma):
                    pg = mann_whitney(vb[col], va[col])
                    if pg < alpha:
                        change = f"{100 * (ma - mb) / abs(mb):+.1f}%" if g.relative and mb else f"{ma - mb:+.4g} {g.metric.unit}"
                        failures.append(f"{g.text}: {where} {col} {mb:.4g} → {ma:.4g} ({change}, p={pg:.3g})")
        rows.append(row)
    return pd.DataFrame(rows, columns=[*KEY, "before", "after", "ratio", "p_value", "mark", "note"]), failures
