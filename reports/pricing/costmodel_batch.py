"""Batch sizes in the cost model (issue 29): the speedup predicted at B, the crossover B*, the best K and node budget per B, and the speedup-vs-batch figure."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd

from dtbench.harness.calibration.curves import DEFAULT_FACTOR
from dtbench.harness.measurement.metrics import acceptance_length
from dtbench.harness.suites.grouping import CellKey, PointKey
from dtbench.reports import loading
from dtbench.reports.pricing.batch_replay import replay_speedup, row_traces
from dtbench.reports.pricing.pricing import Pricer, position_acceptance
from dtbench.reports.stats import (
    FAMILY_UNKNOWN,
    N_TOO_SMALL,
    family_of,
)

# --- batch sizes (issue 29): predicted speedup at B, the crossover B*, best K / node budget per B -------------------

# Two predicted speedups answer two questions (issue 42 item 9), so each table names its own: the cell table's is
# what the forwards a cell's samples ran cost (priced one by one, prefill included, calibrated draft costs); the batch
# table's is the batch model (the B = 1 rows replayed in groups of B on the calibrated curves, measured draft
# seconds), so the same B = 1 cell shows two different numbers, each right for its question.
PRED_FORWARDS = "Speedup pred. (its forwards)"
PRED_STEADY = "Speedup pred. (batch model)"

BATCH_CAPTION = (
    "speedup at batch size B vs ar at the same (dataset, L_max, T, B), measured per prompt group (95% CI: paired t on "
    "the log ratios; 'n too small' below 5 groups) and predicted (" + PRED_STEADY + ", not the cell table's "
    "prediction from every forward run) by replaying the decoder's B = 1 rows in the run's prompt groups on the "
    "calibrated (B, new tokens) target curves: greedy lossless rows commit the same tokens in the same iterations at "
    "any B, so a group costs the prefill of its B prompts (where calibrated; a draft model adds one draft prefill per "
    "row), then per iteration one verification at the widest active row's width (a batch pads every row to it) over "
    "the rows still decoding, plus every active row's draft seconds and its proposer's CPU time beyond ar's (drafts "
    "run per row); ar's group: the same prefill and T - 1 one-token steps; the prediction is the ratio of mean group "
    "throughputs, the measured speedup's definition. Samples stored without per-step drafts fall back to S(B) = L x "
    "c_B(1) / (E[c_B(w_max)] + B x d) from the cell's means; external loops (hf_generate, servers) are not "
    "predicted. B* = the first batch size whose speedup is below 1 (measured: the point estimate; predicted: over "
    "the calibrated batch sizes). Best K / N_max per B: from the B = 1 per-position acceptance (chain, K up to the "
    "deepest drafted position) and the largest calibrated tree verified within 2x one ar step at B (tree)."
)


def b1_frame(samples) -> pd.DataFrame:
    """The columns :func:`b1_parameters` reads, one row per stored sample (ORM ``Sample`` objects)."""
    return pd.DataFrame(
        [
            {
                "prompt_index": s.prompt_index,
                "repeat": s.repeat or 0,
                "warmup": s.warmup,
                "iterations": s.iterations,
                "drafted": s.drafted,
                "new_tokens": s.new_tokens,
                "total_s": s.total_s,
                "step_stats": s.step_stats,
            }
            for s in samples
        ]
    )


@dataclass(frozen=True)
class B1Params:
    """A greedy B = 1 cell's parameters, what the batch model predicts the same decoder at B > 1 from (issue 68 item
    4: typed, frozen; :func:`b1_parameters` makes one, :func:`price_proposers` returns them with the proposer's work).

    Attributes:
        L: tokens per iteration T / iterations (the prefill's iteration counted; the DynaTree paper's L-bar).
        n: mean verification width, tokens (1 + drafted per iteration).
        d: draft seconds per iteration (the draft forwards, plus ``proposer_s`` once priced).
        p: per-position acceptance (:func:`~dtbench.reports.pricing.pricing.position_acceptance`).
        draft_tokens_s: draft seconds per drafted token.
        widths: {verification width: share of decode iterations} (:func:`width_distribution`).
        L_dec: tokens per decode iteration, the prefill's left out (:func:`~dtbench.harness.measurement.metrics.acceptance_length`).
        iters, samples: iterations and samples after warmup (None: a steady-state-only parameter set).
        has_draft: whether any draft seconds were measured (a draft prefill per row at B > 1).
        outside: seconds per iteration outside model forwards (None where unknown).
        family: the decoder's family (:func:`~dtbench.reports.stats.family_of`): ar, chain, tree, external.
        proposer_s: the proposer's own CPU seconds per iteration beyond ar's, added to ``d`` (:func:`price_proposers`).
        traces: the rows' iteration traces for the replay (:func:`~dtbench.reports.pricing.batch_replay.row_traces`).
    """

    L: float
    n: float
    d: float
    p: list[float] = field(default_factory=list)
    draft_tokens_s: float = 0.0
    widths: dict[int, float] = field(default_factory=dict)
    L_dec: float = 1.0
    iters: float | None = None
    samples: float | None = None
    has_draft: bool = False
    outside: float | None = None
    family: str = "chain"
    proposer_s: float = 0.0
    traces: Any = None


def b1_parameters(rows: pd.DataFrame, family: str = "chain") -> B1Params | None:
    """(L, n, d, per-position acceptance, drafted per iteration) of a B = 1 cell from its samples after warmup, and
    ``outside``: its seconds per iteration outside model forwards (the loop and the proposer's own CPU work; None
    where the samples' total or forward times are unknown); ``L_dec``: tokens per decode iteration (the prefill's
    iteration left out), ``widths``: :func:`width_distribution`, ``iters`` / ``samples`` / ``has_draft`` for
    :func:`predicted_batch_speedup`'s whole-cell form."""
    basis = rows[~rows["warmup"].astype(bool)]
    if basis.empty:
        return None
    iters = float(basis["iterations"].sum())
    if iters <= 0:
        return None
    drafted = float(basis["drafted"].sum())
    draft_s = 0.0
    for stats in basis["step_stats"]:
        fs = (stats or {}).get("forward_s") or {}
        draft_s += float(fs.get("draft") or 0.0)
    accepted = [a for st in basis["step_stats"] for a in (st or {}).get("accepted", [])]
    widths = [1 + int(d) for st in basis["step_stats"] for d in ((st or {}).get("drafted") or [])[1:]]
    per_it = [d for st in basis["step_stats"] for d in (st or {}).get("depth", [])]
    outside = None
    if "total_s" in basis:
        forward = 0.0
        for stats in basis["step_stats"]:
            fs = (stats or {}).get("forward_s") or {}
            forward += float(fs.get("target") or 0.0) + float(fs.get("draft") or 0.0)
        if forward > 0:
            outside = max(0.0, float(basis["total_s"].sum()) - forward) / iters
    samples = float(len(basis))
    decode = iters - samples  # every sample's first iteration is its prefill (one token)
    return B1Params(
        outside=outside,
        iters=iters,
        samples=samples,
        has_draft=draft_s > 0,
        L_dec=acceptance_length(float(basis["new_tokens"].sum()), iters, samples) if decode > 0 else 1.0,
        L=float(basis["new_tokens"].sum()) / iters,
        n=1.0 + drafted / iters,
        d=draft_s / iters,
        p=position_acceptance(accepted, per_it),
        draft_tokens_s=draft_s / drafted if drafted else 0.0,
        widths=width_distribution(widths),
        family=family,
    )


def width_distribution(widths: list[int]) -> dict[int, float]:
    """{verification width w: share of decode iterations} from per-iteration widths (pending token + drafts, the
    prefill left out); empty without any."""
    if not widths:
        return {}
    counts = pd.Series(widths).value_counts(normalize=True).sort_index()
    return {int(w): float(share) for w, share in counts.items()}


def widest_of(widths: dict[int, float], batch: int) -> dict[int, float]:
    """{w: P(the widest of ``batch`` rows verifies w tokens)} for rows drawing their widths independently from
    ``widths`` (:func:`width_distribution`): P(max <= w) = F(w)^B. A batch pads every row to its widest
    (:meth:`~dtbench.decoders.kv.RaggedBatch.forward`), so this, not the mean width, is what a batched verification
    feeds per row: a copy method that drafts 10 tokens in one iteration of five feeds 11 per row at B = 16 in nearly
    every iteration."""
    out, below, cdf = {}, 0.0, 0.0
    for w in sorted(widths):
        cdf += widths[w]
        at = min(1.0, cdf) ** batch
        out[w] = at - below
        below = at
    return out


def price_proposers(params: dict[tuple[PointKey, str], B1Params]) -> dict[tuple[PointKey, str], B1Params]:
    """Each decoder's own CPU work priced as draft cost (issue 39 item 5): the same keys, new parameters.

    ``params``: {(point, label): :class:`B1Params`} (:class:`~dtbench.harness.suites.grouping.PointKey`). A decoder's seconds per iteration
    outside model forwards beyond ``ar``'s of the same (dataset, L_max, T) are its proposer's own work (an n-gram
    lookup, a suffix automaton, a tree's bookkeeping), which a batch pays per row as it pays draft forwards: added to
    ``d`` (seconds per row and iteration) and, spread over the drafted tokens, to ``draft_tokens_s``; stored as
    ``proposer_s``. Nothing is added where either side's forward times are unknown.
    """
    base = {p: v.outside for (p, _), v in params.items() if v.family == "ar" and v.outside is not None}
    out = {}
    for key, v in params.items():
        point = key[0]
        extra = 0.0
        if v.family != "ar" and v.outside is not None and point in base:
            extra = max(0.0, v.outside - base[point])
        per_token = extra / (v.n - 1) if v.n > 1 else 0.0
        out[key] = replace(v, proposer_s=extra, d=v.d + extra, draft_tokens_s=v.draft_tokens_s + per_token)
    return out


NOT_PRICED = (
    "its own decoding loop (family external): the model prices drafts and verification forwards per iteration, which "
    "such a loop does not expose, and its batching is its own forward path, not the calibrated one"
)


def priced(params: B1Params | None) -> bool:
    """Whether the steady-state model predicts a decoder at B > 1: it has B = 1 parameters and is not an external
    loop (:data:`NOT_PRICED`; transformers' generate, a server)."""
    return params is not None and params.family != FAMILY_UNKNOWN


def predicted_batch_speedup(
    curves, params: B1Params, batch: int, past: int, gen_length: int | None = None, l_max: int | None = None
) -> float:
    """S(B) of :data:`BATCH_CAPTION` for one decoder's B = 1 parameters (:class:`B1Params`, its ``family`` pricing the
    verification) at batch size B.

    The verification is priced at the widest row's width (:func:`widest_of`, its expected cost over the width
    distribution) where the B = 1 cell recorded per-iteration widths, else at the mean width ``n``. With
    ``gen_length`` T and ``l_max`` given and a calibration that measured the prefill of B prompts
    (:meth:`~dtbench.harness.calibration.curves.Curves.batched_prefill`), the whole cell: ar pays P_B + (T - 1) x c_B(1), the
    decoder P_B + B x P_draft + (T - 1) / L_dec x (E[c_B(w_max)] + B x d_dec), with P_B the target's prefill of B
    prompts, P_draft one draft prefill per row (drafts run per row; 0 without a draft model) and d_dec the draft
    seconds per decode iteration without it, because measured speedups are whole-cell ratios and at B = 16 the
    prefill is a quarter of ar's time on the embedded pair. Otherwise the steady state L x c_B(1) / (E[c_B(w_max)] +
    B x d) (no prefill).
    """
    pricer = Pricer(curves)

    def verify_at(n: float) -> float:
        return pricer.verify_cost(n, past, batch, params.family)

    widths = params.widths
    verify = sum(p * verify_at(w) for w, p in widest_of(widths, batch).items()) if widths else verify_at(params.n)
    iters, samples = params.iters, params.samples
    prefill = None
    if gen_length and l_max and iters is not None and samples is not None:
        prefill = pricer.prefill(l_max, batch)
    if prefill is None or gen_length is None or l_max is None or iters is None or samples is None:
        return pricer.iteration_speedup(params.L, verify, params.d, past, batch)
    draft_prefill = pricer.draft_prefill(l_max, params.has_draft)
    decode = max(iters - samples, 1.0)
    d_dec = max(0.0, params.d * iters - samples * draft_prefill) / decode
    ar = prefill + (gen_length - 1) * pricer.target_cost(1, past, batch)
    spec = prefill + batch * draft_prefill + (gen_length - 1) / params.L_dec * (verify + batch * d_dec)
    return ar / spec


def best_k_at(
    curves, p: list[float], draft_token_s: float, batch: int, past: int, k_max: int | None = None
) -> tuple[int, float] | None:
    """The chain length K maximising S(K) at batch size B with ``draft_token_s`` seconds per drafted token, K up to
    len(p) (at most ``k_max``): :meth:`~dtbench.reports.pricing.pricing.Pricer.best_k`, the one S(K); None without p."""
    return Pricer(curves).best_k(p, past, batch, draft_token_s, k_max)


def budget_at(curves, batch: int, past: int, factor: float = DEFAULT_FACTOR, ceiling: int | None = None) -> int:
    """The node budget at batch size B: :func:`~dtbench.harness.calibration.curves.tree_budget` (``n_max: auto``'s rule at B:
    the largest calibrated verification within ``factor`` x one ar step at B)."""
    return Pricer(curves).budget(past, batch, factor, ceiling)


def _b1_params(session, run, curves) -> dict[tuple[PointKey, str], B1Params]:
    """{(dataset, L_max, T, label): the B = 1 parameters of that greedy cell} (:func:`b1_parameters`, its family and
    its rows' traces, :func:`price_proposers` applied): what the batched cells of the same decoder are predicted
    from."""
    by_label: dict[tuple[PointKey, str], B1Params] = {}  # (point, label) -> B = 1 parameters
    frames: dict[tuple[PointKey, str], pd.DataFrame] = {}
    for cell, samples in loading.cells_with_samples(session, run.id):
        if (cell.batch_size or 1) != 1 or cell.sampling:
            continue
        frame_rows = b1_frame(samples)
        if frame_rows.empty:
            continue
        got = b1_parameters(frame_rows, family_of(cell.family))
        if got is not None:
            key = (CellKey.of_row(cell).point, cell.label)
            by_label[key], frames[key] = got, frame_rows
    ar_outside = {point: v.outside for (point, _), v in by_label.items() if v.family == "ar"}
    traced = {
        key: replace(v, traces=row_traces(frames[key], curves, key[0].l_max, ar_outside.get(key[0])))
        for key, v in by_label.items()
    }
    return price_proposers(traced)


def _measured_crossover(part: pd.DataFrame) -> str:
    """The measured crossover of one decoder's rows sorted by batch size: the first B whose speedup is below 1,
    with its CI, or "none up to B=..."."""
    below = part[part["measured_speedup"] < 1]
    if below.empty:
        return f"none up to B={int(part['batch_size'].max())}"
    at = below.iloc[0]
    ci = (
        f"95% CI [{at['ci_low']:.2f}, {at['ci_high']:.2f}]"
        if not math.isnan(at["ci_low"])
        else f"CI: {at['ci_method'] or N_TOO_SMALL}"
    )
    return f"B*={int(at['batch_size'])} ({at['measured_speedup']:.2f}×, {ci})"


def batch_table(session, run, curves) -> tuple[pd.DataFrame, list[str]]:
    """Per greedy cell of a run with batch sizes: measured speedup at its B with the paired CI, predicted speedup
    (:func:`predicted_batch_speedup` from the same decoder's B = 1 cell), and per decoder the measured and predicted
    crossover B* and the predicted best K / N_max per B (notes). Empty when the run has no batched curve or no B > 1.
    """
    from dtbench.reports.views.compare import speedup_table
    from dtbench.reports.views.summary import samples_frame

    sizes = curves.batch_sizes()
    frame = samples_frame(session, run.id)
    if not sizes or frame.empty or not (frame["batch_size"] > 1).any():
        return pd.DataFrame(), []
    speed = speedup_table(frame)
    speed = speed[speed["verdict"] != "failed"]
    by_label = _b1_params(session, run, curves)
    rows: list[dict] = []
    notes: list[str] = []

    def predict(params: B1Params | None, b: int, l_max: int, T: int) -> float:
        if params is None or not priced(params):
            return math.nan
        if params.traces:
            return replay_speedup(curves, params.traces, b, l_max, T, params.family)
        return predicted_batch_speedup(curves, params, b, l_max + T // 2, T, l_max)

    errors = []
    for _, r in speed.iterrows():
        key = (CellKey.of_row(r).point, r["label"])
        params = by_label.get(key)
        b = int(r["batch_size"])
        pred = predict(params, b, int(r["l_max"]), int(r["gen_length"]))
        if not math.isnan(pred) and not math.isnan(r["speedup"]):
            errors.append(abs(pred - r["speedup"]) / r["speedup"])
        rows.append(
            {
                "dataset": r["dataset"],
                "l_max": int(r["l_max"]),
                "gen_length": int(r["gen_length"]),
                "label": r["label"],
                "batch_size": b,
                "n": int(r["n"]),
                "measured_speedup": r["speedup"],
                "ci_low": r["ci_low"],
                "ci_high": r["ci_high"],
                "ci_method": r["ci_method"],
                "predicted_speedup": pred,
            }
        )
    table = pd.DataFrame(rows)
    if table.empty:
        return table, notes
    for (ds, l_max, T, label), part in table.groupby(["dataset", "l_max", "gen_length", "label"], sort=False):
        measured = _measured_crossover(part.sort_values("batch_size"))
        params = by_label.get((PointKey(str(ds), int(l_max), int(T)), label))
        past = l_max + T // 2
        if params is None:
            predicted = "no B = 1 cell to predict from"
        elif not priced(params):
            predicted = "none (" + NOT_PRICED + ")"
        else:
            grid = [1, *sizes]
            pred_at = {b: predict(params, b, l_max, T) for b in grid}
            first = next((b for b in grid if pred_at[b] < 1), None)
            predicted = f"B*={first} ({pred_at[first]:.2f}×)" if first is not None else f"none up to B={grid[-1]}"
            pricer = Pricer(curves)
            if params.family == "chain" and params.p:
                ks = {b: pricer.best_k(params.p, past, b, params.draft_tokens_s) for b in grid}
                predicted += "; best K per B: " + ", ".join(f"B={b}: K={k[0]}" for b, k in ks.items() if k)
            if params.family == "tree":
                predicted += "; N_max per B (verify <= 2x ar step): " + ", ".join(
                    f"B={b}: {pricer.budget(past, b)}" for b in grid
                )
        notes.append(f"{label} ({ds}, L_max={l_max}, T={T}): measured {measured}; predicted {predicted}")
    if errors:
        notes.append(
            f"mean absolute error of predicted vs measured speedup: {100 * sum(errors) / len(errors):.1f}% "
            f"over {len(errors)} cells"
        )
    return table, notes


def batch_figure_of(session, run):
    """The speedup-vs-batch-size figure of a run (:func:`~dtbench.reports.rendering.plotting.speedup_vs_batch`): measured with
    CIs, and predicted when the run has a calibration with batched curves; None when no cell is at B > 1, else the
    Figure or a one-line reason it was skipped."""
    from dtbench.harness.calibration.curves import load_curves
    from dtbench.reports.rendering.plotting import speedup_vs_batch
    from dtbench.reports.views.compare import speedup_table
    from dtbench.reports.views.summary import samples_frame

    frame = samples_frame(session, run.id)
    if frame.empty or not (frame["batch_size"] > 1).any():
        return None
    measured = speedup_table(frame)
    measured = _servers_against_their_reference(session, run, measured, frame)
    curves = load_curves(session, run)
    predicted = batch_table(session, run, curves)[0] if curves is not None else None
    return speedup_vs_batch(measured, predicted)


def _servers_against_their_reference(session, run, measured, frame):
    """``measured`` with server cells (issue 30: measured through requests, :func:`dtbench.reports.views.engine.served`;
    ``frame``: the run's samples frame) paired with their own plain server at the same concurrency (the load table's
    speedups, :func:`dtbench.reports.views.engine.engine_frame`) instead of with ar; plain servers left out."""
    import pandas as pd

    from dtbench.reports.stats import served
    from dtbench.reports.views.engine import engine_frame

    if measured.empty:
        return measured
    servers_labels = set(frame.loc[[served(m) for m in frame["measurer"]], "label"])
    is_server = measured["label"].isin(servers_labels)
    if not is_server.any():
        return measured
    eng = engine_frame(session, run.id)
    servers = eng[eng["label"].isin(servers_labels) & eng["reference"].notna()].copy()
    servers["label"] = servers["label"] + " (vs " + servers["reference"] + ")"
    keep = measured[~is_server]
    cols = ["dataset", "l_max", "gen_length", "batch_size", "label", "speedup", "ci_low", "ci_high"]
    return pd.concat([keep, servers[cols]], ignore_index=True)


def batch_figures(sessions, run_ids: list[int | None]) -> tuple[dict, list[str]]:
    """{stem: Figure} of :func:`batch_figure_of` for the given runs (stem ``speedup_vs_batch``, ``_run<id>`` added
    when several runs have one), and the notes of the skipped ones."""
    from dtbench.reports.rendering.plotting import BATCH_FIG_STEM
    from dtbench.reports.views.summary import get_run

    figs, notes = {}, []
    with sessions() as session:
        made = []
        for rid in run_ids or [None]:
            run = get_run(session, rid)
            fig = batch_figure_of(session, run)
            if isinstance(fig, str):
                notes.append(f"run {run.id}: {fig}")
            elif fig is not None:
                made.append((run.id, fig))
    for rid, fig in made:
        figs[BATCH_FIG_STEM if len(made) == 1 else f"{BATCH_FIG_STEM}_run{rid}"] = fig
    return figs, notes
