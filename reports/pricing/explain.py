"""Why a speculative cell is as fast as it is, from the run's own forward seconds, with no calibration (issue 58
item 2).

Every speculative-decoding paper explains a speedup the same way: the acceptance, the draft's cost relative to the
target's, and what the two allow. Here each term is measured, per cell at B = 1 (its samples after warmup, summed):

- the **time split**: the share of the cell's wall time inside target forwards, draft forwards apart from the draft's
  prompt prefill, the draft's prefill, and everything else (the loop: Python, masks, cache copies, host reads), from
  the runner's forward hooks (``step_stats.forward_s``, :meth:`dtbench.harness.measurement.forwards.ForwardCounter.forward_seconds`);
- the **cost per forward**: ``c = t_draft / t_AR``, the draft's mean decode forward over the reference ``ar`` cell's
  mean decode forward (one token, the same target, the same prompts), Leviathan et al. 2023's ``c``;
- **what they allow**: ``S_forwards = tau * t_AR / ((F_target + F_draft) / I)``, the speedup if nothing but the decode
  forwards cost time: ``tau`` committed tokens per verification, the prefill's apart (:func:`~dtbench.harness.measurement.metrics.acceptance_length`), ``F_*`` the decode
  forward seconds (prefill apart) and ``I`` the verifications;
- **what the pricing model allows** (issue 68 item 1): ``attainable_speedup``, the one pricing model
  (:class:`~dtbench.reports.pricing.pricing.Pricer`) over the cell's own measured forwards
  (:class:`~dtbench.reports.pricing.pricing.MeasuredCosts`): ``tau * t_AR / (t_verify + D)`` with ``t_verify`` the cell's
  mean verification forward (its K + 1 or tree tokens) priced once per iteration and ``D`` its draft decode seconds
  per iteration (a chain: K drafted tokens at the measured seconds per drafted token). Where the decoder runs one
  verification per iteration it equals ``S_forwards``; the gap is forwards beyond the model's (re-forwards,
  catch-ups);
- for a chain (``family: chain``) also **Leviathan et al. 2023's bound** (eq. 1 and its walltime improvement, Section
  3.4), ``leviathan_bound = (1 - alpha^(K+1)) / ((1 - alpha) (K c + 1))`` with ``alpha`` the measured acceptance rate,
  ``K`` the longest drafted chain and ``c`` the draft forward over AR's: the same Pricer with a verification priced as
  one AR forward and K i.i.d. acceptances, which overstates a chain whose K + 1-token verification costs more than
  one AR forward (it is labelled as that paper's bound, not as what the cell allows).

Beside the measured speedup, the gap is the loop's overhead and the prefills'. Cells stored before the prefill seconds
were recorded (``forward_s.target_prefill``), served cells and batches (B > 1: the batch shares its forwards) get
no explanation; docs/measurement.md gives the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import pandas as pd
from sqlalchemy.orm import Session

from dtbench.harness.measurement.metrics import acceptance_length
from dtbench.reports import loading
from dtbench.reports.pricing.pricing import MeasuredCosts, Pricer, leviathan_bound
from dtbench.reports.stats import baseline_values

# the columns :func:`explain` adds to a summary (CSV and JSON carry them; NaN where a cell has no explanation)
COLUMNS = [
    "time_target_share",
    "time_draft_share",
    "time_draft_prefill_share",
    "time_other_share",
    "target_forward_ms",
    "draft_forward_ms",
    "draft_target_cost",
    "forwards_allow_speedup",
    "attainable_speedup",
    "leviathan_bound",
]
_SUMS = ("wall_s", "target_s", "target_prefill_s", "draft_s", "draft_prefill_s", "target_n", "draft_n", "iterations")


def cell_sums(samples: Iterable[tuple[float, dict[str, Any] | None]]) -> dict[str, float] | None:
    """The sums an explanation is built from, over ``samples`` ((total_s, step_stats) of a cell's samples after
    warmup): wall seconds; target and draft forward seconds and their prefill parts; decode forwards of each (those
    that did not start from an empty cache, from ``step_stats.target_fed``/``draft_fed``); verifications (Steps
    after the first, the prefill's token); drafted and accepted tokens; committed tokens after the prefill's.
    None when a sample lacks the forward seconds or their prefill split (stored before issue 58)."""
    out = dict.fromkeys((*_SUMS, "drafted", "accepted", "committed", "k", "samples"), 0.0)
    n = 0
    for total_s, stats in samples:
        st = stats or {}
        fs = st.get("forward_s") or {}
        if fs.get("target") is None or "target_prefill" not in fs or not st.get("accepted"):
            return None
        n += 1
        out["samples"] += 1
        out["wall_s"] += float(total_s)
        for role in ("target", "draft"):
            out[f"{role}_s"] += float(fs.get(role) or 0.0)
            out[f"{role}_prefill_s"] += float(fs.get(f"{role}_prefill") or 0.0)
            fed = st.get(f"{role}_fed") or []
            out[f"{role}_n"] += sum(1 for step in fed for e in (step or []) if e[1] != 0)
        accepted, drafted = st["accepted"], st.get("drafted") or []
        out["iterations"] += len(accepted) - 1
        out["drafted"] += sum(drafted[1:])
        out["k"] = max(out["k"], *drafted[1:], 0)  # the longest chain drafted: K
        out["accepted"] += sum(accepted[1:])
        out["committed"] += sum(st.get("step_tokens_n") or [a + 1 for a in accepted[1:]])
    return out if n else None


def load_sums(session: Session, cell_ids: list[int]) -> dict[int, dict[str, float] | None]:
    """:func:`cell_sums` of each cell's samples after warmup, read from the database."""
    rows = loading.sample_values(session, cell_ids, "total_s", "step_stats", "step_tokens")
    by_cell: dict[int, list[tuple[float, dict[str, Any] | None]]] = {}
    for cell_id, total_s, stats, step_tokens in rows:
        if stats is not None and step_tokens:
            stats = {**stats, "step_tokens_n": list(step_tokens)[1:]}
        by_cell.setdefault(cell_id, []).append((total_s, stats))
    return {c: cell_sums(v) for c, v in by_cell.items()}


def explain(table: pd.DataFrame, sums: dict[int, dict[str, float] | None]) -> pd.DataFrame:
    """``table`` (a summary, one row per cell) with :data:`COLUMNS` added from ``sums`` (:func:`load_sums`), the
    reference ``ar`` cell's decode forward paired as the speedup is (:func:`~dtbench.reports.stats.baseline_values`).
    Shares are fractions of the wall time; forward times in milliseconds; speedups ratios."""
    if table.empty or not any(sums.values()):  # nothing to explain (an old database): the summary as it was
        return table
    table = table.copy()
    per = [sums.get(c) if (b or 1) == 1 else None for c, b in zip(table["cell_id"], table["batch_size"])]
    t_tgt = [_div(s["target_s"] - s["target_prefill_s"], s["target_n"]) if s else math.nan for s in per]
    table["target_forward_ms"] = [t * 1e3 for t in t_tgt]
    table["draft_forward_ms"] = [
        _div(s["draft_s"] - s["draft_prefill_s"], s["draft_n"]) * 1e3 if s and s["draft_n"] else math.nan for s in per
    ]
    t_ar = baseline_values(table, "target_forward_ms") / 1e3
    for col in COLUMNS:
        if col not in ("target_forward_ms", "draft_forward_ms"):
            table[col] = math.nan
    for i, (s, ar_s) in enumerate(zip(per, t_ar)):
        if not s or not s["wall_s"] > 0 or table["family"].iloc[i] == "ar":
            continue
        at = table.index[i]
        draft_decode = s["draft_s"] - s["draft_prefill_s"]
        table.loc[at, "time_target_share"] = s["target_s"] / s["wall_s"]
        table.loc[at, "time_draft_share"] = draft_decode / s["wall_s"]
        table.loc[at, "time_draft_prefill_share"] = s["draft_prefill_s"] / s["wall_s"]
        table.loc[at, "time_other_share"] = 1 - (s["target_s"] + s["draft_s"]) / s["wall_s"]
        if not ar_s > 0 or not s["iterations"]:
            continue
        c = table.loc[at, "draft_forward_ms"] / 1e3 / ar_s if s["draft_n"] else 0.0
        table.loc[at, "draft_target_cost"] = c
        per_iteration = (s["target_s"] - s["target_prefill_s"] + draft_decode) / s["iterations"]
        # the one acceptance length (committed tokens per drafting iteration, the prefill's left out)
        tau = acceptance_length(s["committed"] + s["samples"], s["iterations"] + s["samples"], s["samples"])
        table.loc[at, "forwards_allow_speedup"] = _div(tau * ar_s, per_iteration)
        for col, value in attainable(table["family"].iloc[i], s, tau, ar_s, c).items():
            table.loc[at, col] = value
    return table


def attainable(family: str, s: dict[str, float], tau: float, ar_s: float, c: float) -> dict[str, float]:
    """``attainable_speedup`` and, for a chain, ``leviathan_bound`` (module docstring) of one cell's :func:`cell_sums`
    ``s``, ``tau`` its committed tokens per verification, ``ar_s`` AR's mean decode forward (seconds) and ``c`` its
    draft forward over AR's; both priced by the one :class:`~dtbench.reports.pricing.pricing.Pricer` on the cell's
    :class:`~dtbench.reports.pricing.pricing.MeasuredCosts`. {} for a family that is neither chain nor tree, or without a
    verification forward."""
    if family not in ("chain", "tree") or not s["target_n"]:
        return {}
    verify = (s["target_s"] - s["target_prefill_s"]) / s["target_n"]
    draft_per_iteration = (s["draft_s"] - s["draft_prefill_s"]) / s["iterations"]
    if family == "tree":
        priced = Pricer(MeasuredCosts(ar_s, verify))
        return {"attainable_speedup": priced.iteration_speedup(tau, verify, draft_per_iteration, None)}
    k_mean = s["drafted"] / s["iterations"]
    per_token = draft_per_iteration / k_mean if k_mean else 0.0
    out = {"attainable_speedup": Pricer(MeasuredCosts(ar_s, verify, per_token)).chain_speedup(tau, k_mean, None)}
    if s["drafted"] > 0:
        out["leviathan_bound"] = leviathan_bound(s["accepted"] / s["drafted"], int(s["k"]), c)
    return out


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def note(row: pd.Series) -> list[str]:
    """The one-line note explaining a speculative cell's speedup (the default report), else []."""
    share = row.get("time_target_share")
    if share is None or pd.isna(share):
        return []
    draft = row["time_draft_share"] + row["time_draft_prefill_share"] >= 0.005 or not pd.isna(row["draft_forward_ms"])
    prefill = (
        f" (+{row['time_draft_prefill_share']:.0%} its prefill)" if row["time_draft_prefill_share"] >= 0.005 else ""
    )
    parts = [
        f"{row['label']}: time in target forwards {share:.0%}"
        + (f", draft {row['time_draft_share']:.0%}{prefill}" if draft else "")
        + f", other {row['time_other_share']:.0%}"
    ]
    allow = row.get("forwards_allow_speedup")
    if allow is not None and not pd.isna(allow):
        cost = row.get("draft_target_cost")
        if cost is not None and not pd.isna(cost) and cost > 0:
            parts.append(f"a draft forward costs {cost:.2f} of AR's")
        parts.append(f"its decode forwards and acceptance allow {allow:.2f}x")
        priced = row.get("attainable_speedup")
        if priced is not None and not pd.isna(priced):
            bound = row.get("leviathan_bound")
            bound_text = (
                f" (Leviathan et al.'s bound, a verification priced as one AR forward: {bound:.2f}x)"
                if bound is not None and not pd.isna(bound)
                else ""
            )
            parts.append(f"priced per forward {priced:.2f}x{bound_text}")
        measured = row.get("speedup")
        if measured is not None and not pd.isna(measured):
            parts.append(f"measured {measured:.2f}x")
    return ["; ".join(parts)]
