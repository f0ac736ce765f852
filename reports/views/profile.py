"""Acceptance profiles (issue 34 item 1): how far each drafted path got, per position, the way the field reads it.

Every decoder's samples store, per target verification (a *step*), ``step_stats["accepted"]`` (drafted tokens
committed before the bonus token: for a tree, the accepted path's length) and ``step_stats["depth"]`` (the drafted
depth: K for a chain, the tree's depth for a tree) (:func:`dtbench.harness.measurement.observation.sample_row`). A *drafting step*
has depth > 0; steps that drafted nothing (the prefill, ``ar``) are left out. Position j (1-based) is depth j along
the accepted path, for chains and trees alike. Over a cell's drafting steps after warmup:

- *conditional* acceptance at j: P(draft j accepted | drafts 1..j-1 accepted and position j drafted): steps that
  accepted >= j over steps that drafted depth >= j and accepted >= j - 1 (the steps *at risk* at j). This is the
  one per-position acceptance dtbench uses: :mod:`dtbench.reports.pricing.costmodel` reads it through
  :func:`conditional_acceptance`.
- *cumulative* acceptance at j: P(accepted >= j): steps whose accepted path reached depth j over all drafting
  steps (specdec_bench's ``marginal_accept_rates``, vLLM's per-position rate). With one drafted depth for every
  step it is the product of the conditionals; a decoder whose depth varies (dynamic trees, the truncated last step)
  counts a step that did not draft j as not reaching it, which the conditional does not.
- the accepted-length histogram: drafting steps per acceptance length *including* the bonus token (1 = no draft
  accepted), as specdec_bench's ``Acceptance_Length_Histogram``.
- mean acceptance length per step (every drafting step weighs the same) and per request (each request's per-step
  mean, then the mean over requests: a long completion weighs as much as a short one, vLLM issue 42690), each with
  and without the bonus token (EAGLE issues 169, 195).
- percentile bootstrap CIs of both per-position rates, resampling requests (steps of one request are not
  independent), numpy; none below :data:`~dtbench.reports.stats.MIN_PROMPTS` requests.

The JSON written by ``dtbench report --profile`` is one profile per cell in the schema of NVIDIA specdec_bench's
``speculation_profile.py`` (NVIDIA/Model-Optimizer ``examples/specdec_bench/specdec_bench/speculation_profile.py``
and ``tests/test_speculation_profile.py``, read at commit 095124e9d582ea52b3aeb636efc281919f3aa4db, schema_version
"1.0"), with dtbench's additions under the ``dtbench`` key; ``reports/speculation_profile.schema.json`` is its JSON
schema. Its consistency check (:func:`consistency`) is specdec_bench's (mean = 1 + sum of marginals, tolerance
0.02) plus two against the samples' own counters (``accepted`` and the path length,
:data:`~dtbench.harness.measurement.metrics.PATH_LENGTH`, written by the measurement when the sample was stored): a profile that disagrees with them fails ``dtbench report --profile`` with one line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dtbench.harness.measurement.metrics import PATH_LENGTH
from dtbench.reports.stats import LOSSY, MIN_PROMPTS, is_missing

SCHEMA_VERSION = "1.0"  # specdec_bench's speculation_profile SCHEMA_VERSION at the commit read
SPECDEC_BENCH_SOURCE = (
    "NVIDIA/Model-Optimizer examples/specdec_bench/specdec_bench/speculation_profile.py "
    "@ 095124e9d582ea52b3aeb636efc281919f3aa4db"
)
TOLERANCE = 0.02  # specdec_bench's _consistency_check tolerance (tokens per step)
BOOTSTRAP_RESAMPLES = 2000
SCHEMA_PATH = Path(__file__).with_name("speculation_profile.schema.json")


def _drafting(accepted: Sequence[int], depth: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(list(accepted), dtype=np.int64)
    d = np.asarray(list(depth), dtype=np.int64)
    if a.shape != d.shape:
        raise ValueError(f"accepted and depth differ in length ({a.size} vs {d.size})")
    keep = d > 0
    return a[keep], d[keep]


def position_counts(accepted: Sequence[int], depth: Sequence[int], positions: int | None = None) -> dict[str, Any]:
    """Per-position counts over one request's (or a pooled list of) steps.

    Args:
        accepted: per step, drafted tokens accepted before the bonus (``step_stats["accepted"]``), ints.
        depth: per step, the drafted depth (``step_stats["depth"]``); steps with depth 0 drafted nothing and are
            skipped.
        positions: how many positions to count (default: the largest depth).

    Returns:
        ``{"steps": drafting steps, "accepted": sum of accepted, "at_risk": [J], "ok": [J], "reached": [J]}`` as
        int64 numpy arrays of length J: steps at risk at position j (depth >= j and accepted >= j - 1), of those
        the ones that accepted j, and steps whose accepted path reached j (accepted >= j).

    Raises:
        ValueError: the two lists differ in length.
    """
    a, d = _drafting(accepted, depth)
    J = int(d.max(initial=0)) if positions is None else positions
    j = np.arange(1, J + 1)[:, None]
    at_risk = ((d[None, :] >= j) & (a[None, :] >= j - 1)).sum(axis=1)
    ok = ((d[None, :] >= j) & (a[None, :] >= j)).sum(axis=1)
    reached = (a[None, :] >= j).sum(axis=1)
    return {"steps": int(a.size), "accepted": int(a.sum()), "at_risk": at_risk, "ok": ok, "reached": reached}


def conditional_acceptance(accepted: Sequence[int], depth: Sequence[int]) -> list[float]:
    """p_j, j = 1..max depth: P(draft j accepted | drafts 1..j-1 accepted and position j drafted) over the steps
    at risk at j (module docstring). The one per-position acceptance of dtbench: the profile's conditional and the
    cost model's p_j (:func:`dtbench.reports.pricing.pricing.expected_tokens`). A position no step was at risk at carries
    the previous position's rate (0.0 at position 1), what the cost model's extrapolation needs; the profile shows
    it as missing with its at-risk count 0.

    Args:
        accepted, depth: per-step lists as :func:`position_counts`.
    """
    c = position_counts(accepted, depth)
    out: list[float] = []
    for tried, ok in zip(c["at_risk"], c["ok"]):
        out.append(float(ok / tried) if tried else (out[-1] if out else 0.0))
    return out


@dataclass
class Request:
    """One request's (sample's) per-step counters and its stored per-sample counters.

    Attributes:
        accepted, depth: ``step_stats["accepted"]`` and ``["depth"]`` (ints per step).
        accepted_total: the samples column ``accepted`` (sum over steps, stored by the measurement).
        path_length: the samples' path-length column (:data:`~dtbench.harness.measurement.metrics.PATH_LENGTH`: mean accepted
            over drafting steps; None when nothing was drafted).
    """

    accepted: list[int]
    depth: list[int]
    accepted_total: int | None = None
    path_length: float | None = None


@dataclass
class Profile:
    """One cell's acceptance profile (module docstring for every definition).

    Attributes:
        cell: the cell's identity (label, decoder, family, dataset, l_max, gen_length, batch_size, sampling).
        requests: requests (samples after warmup) with at least one drafting step; steps: drafting steps.
        positions: per position j: ``position``, ``at_risk``, ``conditional`` (None at 0 at risk), its CI
            ``conditional_lo``/``conditional_hi``, ``reached``, ``cumulative``, ``cumulative_lo``/``_hi`` (None
            without CI: fewer than MIN_PROMPTS requests).
        histogram: acceptance length including the bonus (1..K+1) -> drafting steps.
        means: ``per_step_incl_bonus``, ``per_step_excl_bonus``, ``per_request_incl_bonus``,
            ``per_request_excl_bonus`` (tokens).
        confidence: the CIs' level.
        checks: the consistency checks (:func:`consistency`), filled by :func:`consistency`.
    """

    cell: dict[str, Any]
    requests: int
    steps: int
    positions: list[dict[str, Any]]
    histogram: dict[int, int]
    means: dict[str, float]
    confidence: float
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.checks)


def _bootstrap(num: np.ndarray, den: np.ndarray, confidence: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap CI of sum(num) / sum(den) per column, resampling rows (requests). num, den: (R, J)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num.shape[0], size=(BOOTSTRAP_RESAMPLES, num.shape[0]))
    with np.errstate(invalid="ignore", divide="ignore"):
        stats = num[idx].sum(axis=1) / den[idx].sum(axis=1)  # (B, J)
    tail = (1 - confidence) / 2 * 100
    lo = np.full(num.shape[1], np.nan)
    hi = np.full(num.shape[1], np.nan)
    for j in range(num.shape[1]):
        col = stats[:, j][~np.isnan(stats[:, j])]
        if col.size:
            lo[j], hi[j] = np.percentile(col, [tail, 100 - tail])
    return lo, hi


def _num(x: float) -> float | None:
    return None if is_missing(x) else float(x)


def build_profile(
    requests: Sequence[Request], cell: dict[str, Any], confidence: float = 0.95, seed: int = 0
) -> Profile | None:
    """The acceptance profile of one cell's requests after warmup; None when no request drafted anything (``ar``).

    Args:
        requests: the cell's samples after warmup (:class:`Request`).
        cell: identity columns carried into the profile and its JSON.
        confidence: level of the bootstrap CIs; seed: the bootstrap's generator seed (fixed: reruns print the same).
    """
    counts = [position_counts(r.accepted, r.depth) for r in requests]
    drafting = [(r, c) for r, c in zip(requests, counts) if c["steps"] > 0]
    if not drafting:
        return None
    J = max(len(c["at_risk"]) for _, c in drafting)
    padded = [position_counts(r.accepted, r.depth, J) for r, _ in drafting]
    at_risk = np.stack([c["at_risk"] for c in padded])  # (R, J)
    ok = np.stack([c["ok"] for c in padded])
    reached = np.stack([c["reached"] for c in padded])
    steps = np.array([c["steps"] for c in padded])
    total_steps = int(steps.sum())
    ci = len(padded) >= MIN_PROMPTS
    if ci:
        clo, chi = _bootstrap(ok, at_risk, confidence, seed)
        mlo, mhi = _bootstrap(reached, np.repeat(steps[:, None], J, axis=1), confidence, seed)
    positions = []
    for j in range(J):
        tried, okj, reach = int(at_risk[:, j].sum()), int(ok[:, j].sum()), int(reached[:, j].sum())
        positions.append(
            {
                "position": j + 1,
                "at_risk": tried,
                "conditional": okj / tried if tried else None,
                "conditional_lo": _num(clo[j]) if ci and tried else None,
                "conditional_hi": _num(chi[j]) if ci and tried else None,
                "reached": reach,
                "cumulative": reach / total_steps,
                "cumulative_lo": _num(mlo[j]) if ci else None,
                "cumulative_hi": _num(mhi[j]) if ci else None,
            }
        )
    histogram: dict[int, int] = {}
    for r, _ in drafting:
        a, _d = _drafting(r.accepted, r.depth)
        for length, n in zip(*np.unique(a + 1, return_counts=True)):
            histogram[int(length)] = histogram.get(int(length), 0) + int(n)
    accepted_sum = sum(c["accepted"] for c in padded)
    per_request = [c["accepted"] / c["steps"] for c in padded]
    means = {
        "per_step_excl_bonus": accepted_sum / total_steps,
        "per_step_incl_bonus": 1 + accepted_sum / total_steps,
        "per_request_excl_bonus": float(np.mean(per_request)),
        "per_request_incl_bonus": 1 + float(np.mean(per_request)),
    }
    profile = Profile(
        dict(cell), len(padded), total_steps, positions, dict(sorted(histogram.items())), means, confidence
    )
    profile.checks = consistency(profile, [r for r, _ in drafting])
    return profile


def _check(name: str, profile_value: float, counter_value: float, what: str) -> dict[str, Any]:
    delta = abs(profile_value - counter_value)
    return {
        "name": name,
        "what": what,
        "profile": round(profile_value, 6),
        "counters": round(counter_value, 6),
        "abs_delta": round(delta, 6),
        "tolerance": TOLERANCE,
        "passed": bool(delta <= TOLERANCE),
    }


def consistency(profile: Profile, requests: Sequence[Request]) -> list[dict[str, Any]]:
    """The profile against itself and the samples' stored counters, each within :data:`TOLERANCE` (tokens):

    - ``mean_consistency`` (specdec_bench's): per-step mean length incl. bonus = 1 + sum of the cumulative rates;
    - ``accepted_total``: per-step mean excl. bonus = the samples' ``accepted`` column summed / drafting steps;
    - the path length's (named as :data:`~dtbench.harness.measurement.metrics.PATH_LENGTH`): per-request mean excl. bonus = the
      mean of the samples' path-length column.

    A counter that was not stored (None) skips its check. Returns the checks (dicts with ``passed``).
    """
    cumulative = sum(p["cumulative"] for p in profile.positions)
    checks = [
        _check(
            "mean_consistency",
            profile.means["per_step_incl_bonus"],
            1 + cumulative,
            "mean acceptance length per step (incl. bonus) vs 1 + sum of cumulative acceptance",
        )
    ]
    totals = [r.accepted_total for r in requests]
    if all(t is not None for t in totals):
        checks.append(
            _check(
                "accepted_total",
                profile.means["per_step_excl_bonus"],
                sum(int(t) for t in totals if t is not None) / profile.steps,
                "accepted tokens per drafting step vs the samples' accepted column / drafting steps",
            )
        )
    paths = [r.path_length for r in requests]
    if all(p is not None and not math.isnan(p) for p in paths):
        checks.append(
            _check(
                PATH_LENGTH.name,
                profile.means["per_request_excl_bonus"],
                float(np.mean([float(p) for p in paths if p is not None])),
                f"mean acceptance length per request (excl. bonus) vs the samples' {PATH_LENGTH.name} column",
            )
        )
    return checks


def specdec_json(profile: Profile) -> dict[str, Any]:
    """One profile in specdec_bench's ``speculation_profile.json`` schema (``build_profile`` at the commit in
    :data:`SPECDEC_BENCH_SOURCE`), dtbench's own numbers under ``dtbench``.

    specdec_bench's fields: ``num_speculative_tokens`` = the largest drafted depth (the vectors' length, so none is
    truncated); ``conditional_accept_rates`` in its convention, cumulative_j / cumulative_{j-1} (0 after a zero);
    ``marginal_accept_rates`` = cumulative; ``mean_accept_length`` per step and ``mean_accept_length_per_request``,
    both incl. the bonus; ``acceptance_length_histogram`` keyed by length incl. the bonus (string keys);
    ``verification_method`` ``longest_prefix`` for chains, ``tree`` for trees (dtbench's value); ``accept_length_model``
    ``chain_analytic`` for chains, ``measured_per_k`` otherwise (specdec_bench: tree drafting re-plans when K
    changes).
    """
    cell = profile.cell
    marginal = [p["cumulative"] for p in profile.positions]
    conditional, prev = [], 1.0
    for m in marginal:
        conditional.append(m / prev if prev > 0 else 0.0)
        prev = m
    k = len(marginal)
    chain = cell.get("family") == "chain"
    mean = profile.means["per_step_incl_bonus"]
    mcheck = next(c for c in profile.checks if c["name"] == "mean_consistency")
    violations = [
        {"position": i, "value": marginal[i], "previous": marginal[i - 1]}
        for i in range(1, k)
        if marginal[i] > marginal[i - 1] + 1e-9
    ]
    return {
        "schema_version": SCHEMA_VERSION,
        "measured": True,
        "method": cell.get("decoder"),
        "draft_checkpoint": {"id": cell.get("draft_model")} if cell.get("draft_model") else None,
        "target_model": {"id": cell.get("target_model")} if cell.get("target_model") else None,
        "num_speculative_tokens": k,
        "block_size": None,
        "max_supported_k": k,
        "verification_method": "longest_prefix" if chain else "tree",
        "conditional_accept_rates": [round(x, 6) for x in conditional],
        "marginal_accept_rates": [round(x, 6) for x in marginal],
        "mean_accept_length": round(mean, 6),
        "mean_accept_length_per_request": round(profile.means["per_request_incl_bonus"], 6),
        "accept_length_model": "chain_analytic" if chain else "measured_per_k",
        "accept_length_by_k": {str(k): round(mean, 6)},
        "acceptance_length_histogram": {str(length): n for length, n in profile.histogram.items()},
        "per_category": None,
        "measurement_conditions": {
            "dataset": cell.get("dataset"),
            "l_max": cell.get("l_max"),
            "gen_length": cell.get("gen_length"),
            "batch_size": cell.get("batch_size"),
            "sampling": cell.get("sampling"),
            "engine": "dtbench",
        },
        "validation": {
            "mean_consistency": {
                "implied_mean_accept_length": mcheck["counters"],
                "reported_mean_accept_length": mcheck["profile"],
                "abs_delta": mcheck["abs_delta"],
                "tolerance": TOLERANCE,
                "passed": mcheck["passed"],
            },
            "marginal_monotonicity": {"passed": not violations, "violations": violations},
        },
        "dtbench": {
            "label": cell.get("label"),
            "family": cell.get("family"),
            "lossless": LOSSY if cell.get("lossy_by_design") else None,
            "requests": profile.requests,
            "drafting_steps": profile.steps,
            "confidence": profile.confidence,
            "positions": profile.positions,
            "mean_acceptance_length": {k2: round(v, 6) for k2, v in profile.means.items()},
            "checks": profile.checks,
            "source": SPECDEC_BENCH_SOURCE,
        },
    }


def load_schema() -> dict[str, Any]:
    """The JSON schema of one profile (``reports/speculation_profile.schema.json``)."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
