"""Every metric, in one place: its definition (below), and in :data:`METRICS` its name, unit, header, number format,
per-cell aggregation, better direction and ``--fail-if`` aliases. Its per-sample derivation from Steps or from a
server's request is :func:`dtbench.harness.measurement.observation.sample_row`, the one row builder.

Reports (summary, tables, CSV/JSON, run-to-run comparison and gates) iterate over :data:`METRICS`; adding a
metric is one :class:`Metric` entry (plus its samples column, with a migration, and its line in
:func:`~dtbench.harness.measurement.observation.sample_row`).

Definitions (docs/measurement.md):

- throughput = T / total wall time (tokens/s, prefill included); TTFT = time to the first committed token;
  TPOT = (total - TTFT) / (T - 1), seconds.
- iterations = target verifications (the prefill is the first); tokens per iteration L = T / iterations (the
  DynaTree paper's L-bar, Table 3); acceptance_length tau = (T - 1) / (iterations - 1), the field's mean accepted
  length (Spec-Bench's #MAT), pooled over a cell's samples (:func:`acceptance_length`). A server's
  request (:class:`~Served`): its network reads that brought tokens, and its counters are the server's own totals.
- acceptance_rate = committed drafted tokens / drafted depth, summed over iterations (accepted / K for linear
  speculation; for trees the committed path length before the bonus over the drafted tree's depth); at most 1.
- acceptance_incl_bonus = committed tokens *including* the bonus token / drafted depth, summed over the
  iterations that drafted: the DynaTree paper's Table 3 "Accept." convention, which can exceed 100%.
- mean_path_length = mean committed path length before the bonus token over the iterations that drafted;
  mean_path_length_all = the same over every iteration (the paper's ℓ, iterations that drafted nothing count 0;
  None when no iteration drafted, as for ``ar``).
- target_forwards / draft_forwards: forward passes counted by the runner's hooks (never declared by decoders);
  ``step_stats["target_fed"]`` / ``["draft_fed"]`` list each step's forwards as ``[n, past, flags]`` (tokens fed,
  KV positions before the forward, ``measure.FED_MASK | FED_LAST``), what the cost model prices (samples stored
  before they existed lack them).
- lossless: the output equals the reference's token for token (the ``exact`` rule); otherwise the first divergence is
  stored. The runner then applies the suite's ``lossless_check`` (harness/measurement/lossless.py: under ``tie_aware`` a sample
  passes when every emitted token is the target's greedy choice up to a numeric tie).
- energy_j: joules over the sample (:mod:`dtbench.harness.measurement.energy`; None when unavailable or too short, with
  ``energy_status`` saying which); j_per_token = energy_j / T; tokens_per_j = T / energy_j.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dtbench.harness.values import is_missing

if TYPE_CHECKING:
    import pandas as pd


BASELINE = "ar"  # the reference decoder every speedup is measured against
# the columns of a cell's group, (dataset, L_max, T, batch size B): harness.suites.grouping.CellKey (its columns())
GROUP = ["dataset", "l_max", "gen_length", "batch_size"]
MIB = 2**20
MISSING = "—"  # how every report shows a value it does not have (no AR baseline, all warmup, not applicable)


def column_of(record: Any, name: str) -> Any:
    """A column of a sample or cell: an ORM object's attribute, or a mapping's / pandas row's item."""
    return record[name] if isinstance(record, dict) or hasattr(record, "iloc") else getattr(record, name)


def peak_memory_bytes(row: Mapping[str, Any]) -> float | None:
    """The peak memory a reader compares (bytes): torch allocator peak on CUDA, else the process RSS peak (CPU)."""
    for col in ("peak_allocated_bytes", "peak_rss_bytes"):
        v = row.get(col)
        if v is not None and not is_missing(v):
            return float(v)
    return None


def _energy_ratio(row: Mapping[str, Any], per_token: bool) -> float | None:
    """J per token (``per_token``) or tokens per J of a samples row; None without a measured energy."""
    e, n = row.get("energy_j"), row.get("new_tokens")
    if e is None or n is None or (isinstance(e, float) and math.isnan(e)) or e <= 0 or not n:
        return None
    return float(e / n if per_token else n / e)


def acceptance_length(tokens: float, iterations: float, samples: float = 1) -> float:
    """tau, the field's mean accepted length (Spec-Bench's #MAT, EAGLE's tau; issue 68 item 3): tokens committed per
    drafting iteration, the bonus token included, the prefill's iteration and its one token left out:
    (tokens - samples) / (iterations - samples) for ``samples`` samples of ``tokens`` committed tokens and
    ``iterations`` target verifications in all (each sample's first iteration is its prefill). Pooled over a cell's
    samples, as Spec-Bench pools its steps. Tokens; NaN without an iteration after the prefill.

    The one definition: the summary's ``acceptance_length``, the explanation's tau, ``--spec-bench``'s #MAT and the
    batch cost model's L_dec call it. ``tokens_per_iteration`` (T / iterations, the prefill's iteration counted) is
    the DynaTree paper's L-bar (Table 3), kept under that name for the paper tables."""
    decode = float(iterations) - float(samples)
    return (float(tokens) - float(samples)) / decode if decode > 0 else math.nan


def _sample_acceptance_length(row: Mapping[str, Any]) -> float | None:
    """A samples row's :func:`acceptance_length` (None without its counts or an iteration after the prefill)."""
    t, i = row.get("new_tokens"), row.get("iterations")
    if t is None or i is None or is_missing(t) or is_missing(i):
        return None
    got = acceptance_length(t, i)
    return None if math.isnan(got) else got


@dataclass(frozen=True)
class Metric:
    """One per-prompt metric and how every report shows it.

    Attributes:
        name: the name in summaries, CSV/JSON and ``--fail-if`` (its display unit in the name: ``tpot_ms``).
        column: the samples column it is read from, or a function of a samples row (e.g. peak memory).
        header: the column header of the per-cell table (None: not a table column, still in CSV/JSON).
        unit: the display unit ("tokens/s", "ms", "fraction", "tokens", "MiB", ...).
        scale: multiplies the stored value (stored units are seconds, bytes, counts) into the display unit.
        spec: format spec of the displayed number; ``percent`` shows a fraction as a percentage.
        spread: aggregated per cell as mean ± std (columns ``{name}_mean``/``{name}_std``), else the mean (``{name}``).
        higher_is_better: the good direction for comparisons and gates; None: no direction.
        aliases: other names ``--fail-if`` accepts.
        source: where it is defined (docs/, the paper), for docs.
        optional: a table column only where some cell of the table has a value (energy: only where a counter was
            readable); CSV/JSON always carry it.
    """

    name: str
    column: str | Callable[[Mapping[str, Any]], float | None]
    header: str | None
    unit: str
    scale: float = 1.0
    spec: str = ".2f"
    percent: bool = False
    spread: bool = False
    higher_is_better: bool | None = None
    aliases: tuple[str, ...] = ()
    source: str = ""
    optional: bool = False

    @property
    def columns(self) -> list[str]:
        """The summary columns this metric produces."""
        return [f"{self.name}_mean", f"{self.name}_std"] if self.spread else [self.name]

    def values(self, samples: pd.DataFrame) -> pd.Series:
        """Per-sample values in the display unit, a float pandas Series (samples: a frame of samples rows)."""
        import pandas as pd

        if callable(self.column):
            raw = samples.apply(self.column, axis=1) if len(samples) else pd.Series(dtype=float)
        else:
            raw = samples[self.column]
        return pd.to_numeric(raw, errors="coerce").astype(float) * self.scale

    def format(self, mean: float | None, std: float | None = None) -> str:
        """Display string: ``mean ± std`` (std where given and defined), percent if asked, "—" when missing."""

        def one(v: float) -> str:
            return format(v, ".1%") if self.percent else format(v, self.spec)

        if mean is None or is_missing(mean):
            return MISSING
        if std is None or is_missing(std):
            return one(mean)
        return f"{one(mean)} ± {one(std)}"


METRICS: list[Metric] = [
    Metric(
        "throughput",
        "throughput",
        "Throughput (t/s)",
        "tokens/s",
        spec=".1f",
        spread=True,
        higher_is_better=True,
        aliases=("tps",),
        source="T / decode wall time, prefill included",
    ),
    Metric(
        "ttft_ms",
        "ttft_s",
        "TTFT (ms)",
        "ms",
        scale=1e3,
        spec=".1f",
        spread=True,
        higher_is_better=False,
        aliases=("ttft",),
        source="time to the first committed token",
    ),
    Metric(
        "tpot_ms",
        "tpot_s",
        "TPOT (ms)",
        "ms",
        scale=1e3,
        spec=".2f",
        spread=True,
        higher_is_better=False,
        aliases=("tpot",),
        source="(total - TTFT) / (T - 1)",
    ),
    Metric(
        "acceptance_rate",
        "acceptance_rate",
        "Accept.",
        "fraction",
        percent=True,
        higher_is_better=True,
        aliases=("acceptance", "accept"),
        source="committed drafted tokens / drafted depth",
    ),
    Metric(
        "acceptance_incl_bonus",
        "acceptance_incl_bonus",
        None,
        "fraction",
        percent=True,
        higher_is_better=True,
        aliases=("accept_bonus",),
        source="committed tokens incl. the bonus / drafted depth (paper Table 3)",
    ),
    Metric(
        "tokens_per_iteration",
        "tokens_per_iteration",
        "L (tok/iter)",
        "tokens",
        higher_is_better=True,
        aliases=("L",),
        source="T / iterations",
    ),
    Metric(
        "acceptance_length",
        _sample_acceptance_length,
        None,
        "tokens",
        higher_is_better=True,
        aliases=("tau", "mat"),
        source="(T - 1) / (iterations - 1): committed tokens per drafting iteration, the prefill's left out (the "
        "field's mean accepted length; acceptance_length())",
    ),
    Metric(
        "mean_path_length",
        "mean_path_length",
        "ℓ (path)",
        "tokens",
        higher_is_better=True,
        aliases=("l", "path_length"),
        source="committed path before the bonus, iterations that drafted",
    ),
    Metric(
        "mean_path_length_all",
        "mean_path_length_all",
        None,
        "tokens",
        higher_is_better=True,
        aliases=("l_all",),
        source="committed path before the bonus, every iteration (the paper's)",
    ),
    Metric(
        "iterations",
        "iterations",
        "#Iter",
        "iterations",
        spec=".1f",
        higher_is_better=False,
        aliases=("iter",),
        source="target verifications, the prefill first",
    ),
    Metric(
        "peak_mib",
        peak_memory_bytes,
        "Peak mem (MiB)",
        "MiB",
        scale=1 / MIB,
        spec=".0f",
        higher_is_better=False,
        aliases=("memory", "peak_memory", "mem"),
        source="torch allocator peak on CUDA, process RSS peak on CPU",
    ),
    # Issue 37 (harness/calibration/roofline.py): None for samples stored before it; optional so old runs' tables are unchanged.
    Metric(
        "roofline",
        "roofline",
        "Roofline",
        "fraction",
        percent=True,
        higher_is_better=True,
        optional=True,
        source="memory-bandwidth-limit seconds of the sample's forwards (weights + attended KV) / total_s",
    ),
    # Energy (harness/measurement/energy.py): None where no counter was readable or the sample was shorter than its update period.
    Metric(
        "energy_j",
        "energy_j",
        None,
        "J",
        spec=".3g",
        higher_is_better=False,
        aliases=("energy",),
        optional=True,
        source="energy counter increase over the sample (NVML on CUDA, RAPL on CPU), via Zeus",
    ),
    Metric(
        "j_per_token",
        lambda row: _energy_ratio(row, per_token=True),
        "J/token",
        "J/token",
        spec=".3g",
        higher_is_better=False,
        aliases=("joules_per_token",),
        optional=True,
        source="energy_j / T",
    ),
    Metric(
        "tokens_per_j",
        lambda row: _energy_ratio(row, per_token=False),
        "tok/J",
        "tokens/J",
        spec=".3g",
        higher_is_better=True,
        aliases=("tokens_per_joule",),
        optional=True,
        source="T / energy_j",
    ),
]
BY_NAME = {m.name: m for m in METRICS}
PATH_LENGTH = BY_NAME["mean_path_length"]  # ℓ over the iterations that drafted: ``report --profile`` checks it
# Derived per cell against the baseline, not read from one sample: the speedup (throughput / AR throughput).

SPEEDUP = Metric(
    "speedup",
    "speedup",
    "Speedup",
    "×",
    spec=".2f",
    higher_is_better=True,
    source="throughput / AR throughput, same dataset, L_max and T",
)
GATEABLE = {m.name: m for m in [METRICS[0], SPEEDUP, *METRICS[1:]] if m.higher_is_better is not None}
ALIASES = {alias: m.name for m in GATEABLE.values() for alias in m.aliases}
