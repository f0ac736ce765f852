"""The cost model (issue 12): what a sample's forwards should have cost, against what it took.

Inputs, all from the database: the run's calibration (:class:`dtbench.harness.calibration.curves.Curves`, the forward-latency
curves of ``dtbench calibrate`` / ``calibrate: true``) and each sample's per-step forward records
(``step_stats["target_fed"]`` / ``["draft_fed"]``: every forward the runner's hooks counted, as
``[tokens fed n, KV positions before it, flags]``).

- predicted time of a sample = the calibrated cost of every forward its steps actually ran, summed (target and
  draft apart); ``efficiency = predicted / measured`` time (1.0: nothing but the forwards; below 1: time spent
  outside them — host syncs, mask building, cache copies, Python — or forwards slower than calibrated).
  Samples stored before the per-forward records existed are priced from the per-step forward and token counts,
  each step's tokens spread evenly over its forwards, on the shortest calibrated cache (marked ``approx``).
- where the rest goes: each sample also stores the seconds spent inside the target's and draft's forward passes,
  timed by the runner's hooks (``step_stats["forward_s"]``). Then ``efficiency = forward_share x forward_speed``:
  ``forward_share`` = in-forward / measured time (1 - the decoder's own overhead: Python, host syncs, masks, cache
  copies, sampling), ``forward_speed`` = predicted / in-forward time (below 1: the forwards themselves ran slower in
  the loop than calibrated — another call path, cache state, machine noise between calibration and run).
- chain-family decoders (``Decoder.family == "chain"``, stored on the cell): from the accepted lengths a_i of the iterations that drafted
  K_i tokens, the per-position acceptance p_j = #{a_i >= j} / #{a_i >= j-1 and K_i >= j} (a position counts only
  in iterations that drafted it), the expected tokens per iteration E(k) = 1 + sum_{j<=k} prod_{i<=j} p_i for
  every k up to the drafted K, and the steady-state speedup of chain length k over AR,
  S(k) = c_T(1) * E(k) / (k c_D(1) + c_T(k+1)), with c_T(n) the causal target forward over n tokens, c_D(1) one
  draft step (last-position logits), both on the cache at mid-generation (L_max + T/2). The predicted best K is
  argmax_k S(k); it is a forward-cost-only prediction (no overhead), so compare it with the measured speedups
  of cells that ran each K (``suites/linear-k.yaml``). The cell's own K is the most it drafted in one iteration.
- tree-family decoders: the predicted best node budget N_max = the largest calibrated tree whose verification (root +
  n nodes, one target forward with the tree mask) costs at most 2x one AR token on the cache at mid-generation
  (:func:`dtbench.harness.calibration.curves.tree_budget`, the budget ``n_max: auto`` would choose; candidates: the calibrated
  sizes; a forward-cost-only prediction, to compare with measured sweeps over ``n_max``).
- every number here is priced by the one pricing model, :class:`dtbench.reports.pricing.pricing.Pricer` (issue 58 item 1):
  S(k) only for k up to the deepest drafted position (p is not extended beyond what was measured).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from dtbench.harness.calibration.curves import DEFAULT_FACTOR
from dtbench.harness.errors import DtbenchError
from dtbench.harness.suites.grouping import CellKey
from dtbench.reports import loading
from dtbench.reports.pricing import explain
from dtbench.reports.pricing.costmodel_batch import BATCH_CAPTION, PRED_FORWARDS, PRED_STEADY, batch_table
from dtbench.reports.pricing.pricing import Pricer, position_acceptance
from dtbench.reports.rendering.output import Document, Note, Report, emit
from dtbench.reports.rendering.render import NOT_LOSSLESS_MARK
from dtbench.reports.stats import (
    MISSING,
    baseline_values,
    cell_throughput,
    family_of,
    is_missing,
    show,
)

NO_CALIBRATION = (
    "run {run} has no calibration: run `dtbench calibrate SUITE` on the same machine (or add "
    "`calibrate: true` to the suite and run it again)"
)
FIG_STEM = "cost_verify_curve"


# --- the per-cell table --------------------------------------------------------------------------------------------


def uses_draft_model(cell) -> bool:
    """Whether a cell ran the suite's draft model: the runner records ``cells.draft_model`` only for decoders that
    need one (a learned head's forwards are not the draft model's), so the database alone says it."""
    return cell.draft_model is not None


def _best_configs(family: str, cell, samples: list, curves) -> dict[str, Any]:
    """The predicted best configuration of a cell (the cost table's ``predicted_best_*`` columns it has): K of a
    chain decoder from its per-position acceptance, total_token of a tree decoder recording its node budget, else
    N_max of a tree decoder (:meth:`~dtbench.reports.pricing.pricing.Pricer.budget`, the rule of ``n_max: auto``)."""
    pricer = Pricer(curves)
    out: dict[str, Any] = {}
    if family == "chain":
        accepted = [a for s in samples for a in (s.step_stats or {}).get("accepted", [])]
        depth = [d for s in samples for d in (s.step_stats or {}).get("depth", [])]
        p = position_acceptance(accepted, depth)
        if p:
            speed = pricer.chain_speedups(p, cell.l_max + cell.gen_length // 2)
            best = max(speed, key=lambda k: speed[k])
            out.update(
                predicted_best_k=best,
                predicted_best_speedup=speed[best],
                predicted_k_speedup=speed.get(len(p)),  # len(p): the most it drafted, its own K
                acceptance_by_position=[round(x, 4) for x in p],
            )
    states = [(s.step_stats or {}).get("state") for s in samples]
    if any(st and "drafting_iterations" in st for st in states):  # a tree decoder recording its node budget
        iters = sum(int((st or {}).get("drafting_iterations") or 0) for st in states)
        head = sum(((s.step_stats or {}).get("forward_s") or {}).get("draft") or 0.0 for s in samples)
        speed = pricer.budget_speedups(states, head / iters if iters else 0.0, cell.l_max + cell.gen_length // 2)
        if speed:
            best = max(speed, key=lambda k: speed[k])
            out.update(predicted_best_total_token=best, predicted_best_total_token_speedup=speed[best])
    if "predicted_best_total_token" not in out and family == "tree" and "target" in curves.roles():
        out["predicted_best_n_max"] = pricer.budget(cell.l_max + cell.gen_length // 2, 1, DEFAULT_FACTOR)
    return out


def cost_table(session, run, curves) -> pd.DataFrame:
    """One row per cell with samples after warmup: predicted vs measured time and throughput, efficiency, the
    predicted share of target and draft forwards, for chain-family cells the predicted best K and for tree-family
    cells the predicted best N_max (module docstring)."""
    out = []
    pricer = Pricer(curves)
    for cell, samples in loading.measured_cells(session, run.id, by_prompt=True):
        if (cell.batch_size or 1) > 1:  # B > 1 is not priced here: these curves are batch-1 curves
            continue
        if (cell.execution or "eager") == "compiled":  # calibration measures eager forwards: not this cell's price
            continue
        priced = [pricer.sample(s.step_stats or {}, uses_draft_model(cell)) for s in samples]
        measured = sum(s.total_s for s in samples) / len(samples)
        predicted = sum(p.predicted_s for p in priced) / len(priced)
        timed = [(s.step_stats or {}).get("forward_s") for s in samples]
        in_forward = (
            sum((t.get("target") or 0.0) + (t.get("draft") or 0.0) for t in timed if t) / len(timed)
            if all(timed)
            else math.nan
        )
        row = {
            "cell_id": cell.id,
            **CellKey.of_row(cell).columns(),
            "label": cell.label,
            "decoder": cell.decoder,
            "family": family_of(cell.family),
            "sampling": cell.sampling,
            "n": len(samples),
            "measured_s": measured,
            "predicted_s": predicted,
            "target_s": sum(p.target_s for p in priced) / len(priced),
            "draft_s": sum(p.draft_s for p in priced) / len(priced),
            "efficiency": predicted / measured if measured > 0 else math.nan,
            "in_forward_s": in_forward,
            "forward_share": in_forward / measured if measured > 0 else math.nan,
            "forward_speed": predicted / in_forward if in_forward > 0 else math.nan,
            "measured_throughput": cell_throughput(samples),
            "predicted_throughput": sum(
                s.new_tokens / p.predicted_s for s, p in zip(samples, priced) if p.predicted_s > 0
            )
            / len(samples),
            "approx": any(p.approx for p in priced),
            # declared lossless, and a sample failed the lossless check: its speedup marked, no best config named
            "not_lossless": bool(cell.lossless_expected) and any(s.lossless is False for s in samples),
            "predicted_best_k": None,
            "predicted_best_speedup": None,
            "predicted_k_speedup": None,
            "acceptance_by_position": None,
            "predicted_best_n_max": None,
            "predicted_best_total_token": None,
            "predicted_best_total_token_speedup": None,
        }
        row.update(_best_configs(row["family"], cell, samples, curves))
        out.append(row)
    table = pd.DataFrame(out)
    if table.empty:
        return table
    for col in (
        "predicted_best_k",
        "predicted_best_n_max",
        "predicted_best_total_token",
    ):  # whole numbers, missing where they do not apply
        table[col] = table[col].astype("Int64")
    # against the AR cell of the same group that decodes the same way (the one pairing of every report)
    table["measured_speedup"] = table["measured_throughput"] / baseline_values(table, "measured_throughput")
    table["predicted_speedup"] = baseline_values(table, "predicted_s") / table["predicted_s"].where(
        table["predicted_s"] > 0
    )
    return table


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def forward_regimes(curves, environment: dict) -> dict[str, str]:
    """Per model role (target, draft) the regime of its calibrated causal forwards (issue 37,
    :func:`dtbench.harness.calibration.roofline.forward_regime`): launch-bound, bandwidth-bound or compute-bound, from the cost
    at n = 1 and at the largest calibrated n on the shortest calibrated cache, against the weights' bytes (the run's
    parameter count x its dtype's size) over the run's measured memory bandwidth; {} where not calibrated."""
    from dtbench.harness.calibration.roofline import forward_regime

    bandwidth = environment.get("memory_bandwidth_bytes_per_s")
    out = {}
    for role in ("target", "draft"):
        ns = sorted(int(n) for n in curves.points(role, "causal")[0]) if curves.has(role, "causal") else []
        if 1 not in ns or len(ns) < 2:
            continue
        info = environment.get(role) or {}
        element = DTYPE_BYTES.get(str(info.get("dtype")))
        sizes = {"weights": int(info["params"]) * element} if info.get("params") and element else None
        pricer = Pricer(curves)
        regime = forward_regime({n: pricer.forward_cost(role, n, None) for n in (1, ns[-1])}, sizes, bandwidth)
        if regime is not None:
            out[role] = regime
    return out


REGIME_MEANING = {
    "launch-bound": "one forward costs several times reading its weights once and stays flat in the tokens fed: "
    "kernel launches and Python dominate, so extra verified tokens look free; compiled execution shows the other view",
    "bandwidth-bound": "near the time to read its weights once, flat in the tokens fed: extra verified tokens are "
    "nearly free for the right reason",
    "compute-bound": "cost grows with the tokens fed: every extra verified token costs",
    "flat": "flat in the tokens fed (no bandwidth measured to tell launch- from bandwidth-bound)",
}


COST_COLUMNS = (  # the cost table's data columns (CSV, JSON), in order
    "dataset",
    "l_max",
    "gen_length",
    "label",
    "decoder",
    "family",
    "sampling",
    "n",
    "predicted_s",
    "measured_s",
    "efficiency",
    "in_forward_s",
    "forward_share",
    "forward_speed",
    "target_s",
    "draft_s",
    "predicted_throughput",
    "measured_throughput",
    "predicted_speedup",
    "measured_speedup",
    "predicted_best_k",
    "predicted_best_speedup",
    "predicted_k_speedup",
    "acceptance_by_position",
    "predicted_best_total_token",
    "predicted_best_total_token_speedup",
    "predicted_best_n_max",
    "approx",
)


def _cost_display(table: pd.DataFrame) -> pd.DataFrame:
    """The cost table as shown: one row per cell, numbers formatted, the best configuration as text."""
    return pd.DataFrame(
        [
            {
                "Dataset": r["dataset"],
                "L_max": str(r["l_max"]),
                "T": str(r["gen_length"]),
                "Decoder": r["label"],
                "n": str(r["n"]),
                "Measured (s)": show(r["measured_s"], ".3f"),
                "Predicted (s)": show(r["predicted_s"], ".3f") + (" ~" if r["approx"] else ""),
                "target/draft (s)": f"{r['target_s']:.3f}/{r['draft_s']:.3f}",
                "Efficiency": show(r["efficiency"], ".2f"),
                "In fwd": show(r["forward_share"], ".0%"),
                "Fwd speed": show(r["forward_speed"], ".2f"),
                "Measured t/s": show(r["measured_throughput"], ".1f"),
                "Predicted t/s": show(r["predicted_throughput"], ".1f"),
                "Speedup meas.": show(r["measured_speedup"], ".2f", "×")
                + (NOT_LOSSLESS_MARK if r["not_lossless"] else ""),
                PRED_FORWARDS: show(r["predicted_speedup"], ".2f", "×"),
                "Best config (pred.)": MISSING + NOT_LOSSLESS_MARK if r["not_lossless"] else best_config(r),
            }
            for _, r in table.iterrows()
        ]
    )


def _batch_report(rid: int, batched: pd.DataFrame, batch_notes: list[str]) -> Report:
    """The batch table's report: measured speedup vs batch size with its CI beside the steady-state prediction."""
    shown = pd.DataFrame(
        [
            {
                "Dataset": r["dataset"],
                "L_max": str(r["l_max"]),
                "T": str(r["gen_length"]),
                "Decoder": r["label"],
                "B": str(r["batch_size"]),
                "n": str(r["n"]),
                "Speedup meas.": show(r["measured_speedup"], ".2f", "×"),
                "95% CI": (
                    f"[{r['ci_low']:.2f}, {r['ci_high']:.2f}]"
                    if not is_missing(r["ci_low"])
                    else (r["ci_method"] or MISSING)
                ),
                PRED_STEADY: show(r["predicted_speedup"], ".2f", "×"),
            }
            for _, r in batched.iterrows()
        ]
    )
    return Report(
        "batch_cost_model",
        f"run {rid}: speedup vs batch size, measured and predicted",
        BATCH_CAPTION,
        shown,
        batched,
        notes=[Note(n) for n in batch_notes],
    )


def cost_report(sessions, run_id: int | None, fmt: str) -> None:
    """``dtbench report --cost-model [--run ID]``.

    Raises:
        DtbenchError: an unknown run, a run without calibration (one line suggesting ``dtbench calibrate``), or a
            run without samples after warmup.
    """
    from dtbench.harness.calibration.curves import load_curves
    from dtbench.reports.views.summary import get_run

    with sessions() as session:
        run = get_run(session, run_id)
        curves = load_curves(session, run)
        if curves is None:
            raise DtbenchError(NO_CALIBRATION.format(run=run.id))
        assert curves.batch is not None  # a stored calibration's curves carry its batch id
        table = explained(session, run, cost_table(session, run, curves))
        batched, batch_notes = batch_table(session, run, curves)
        rid = run.id
        environment = dict(run.environment or {})
        compiled_cells = sorted({c.label for c in run.cells if (c.execution or "eager") == "compiled"})
    if table.empty and batched.empty:
        raise DtbenchError(f"run {rid} has no samples after warmup to price")
    source = (
        f"calibration {curves.batch[:8]} of run {rid}"
        if curves.run_id is not None
        else f"standalone calibration {curves.batch[:8]} (same models, dtype and device)"
    )
    title = f"run {rid}: cost model ({source})"
    caption = (
        "predicted = calibrated cost of every forward the samples ran (target + draft); efficiency = predicted "
        "/ measured time = in forwards (timed forwards / measured: the rest is the decoder's own overhead) x "
        "forward speed (predicted / timed forwards); speedups vs AR of the same dataset/L_max/T decoding the "
        f"same way; {PRED_FORWARDS} = AR's predicted time / the cell's, each priced from every forward its samples "
        "ran (prefill and the short last iterations included; calibrated draft costs): not the steady-state "
        "prediction of the batch table; best config (forward costs only): K of chain decoders from the per-position acceptance, "
        "N_max of tree decoders (largest tree verified within 2x one AR token), total_token of a tree decoder that "
        "records the node budget each accepted token needed (eagle: calibrated verify cost + the head's "
        "measured time)"
    )
    if "time_target_share" in table:  # the run's cells explain themselves (issue 58 item 2)
        caption += (
            "; notes: each speculative cell's explanation from its own forward seconds (as the default report's), "
            "then the calibrated prediction, which takes over"
        )
    if curves.run_id is None:  # measured on the embedded CPU pair: the same forward cost 10-25% apart between processes
        caption += (
            "; a standalone calibration was measured in another process, whose forward costs can differ from "
            "the run's (calibrate: true measures in the run's own process)"
        )
    cols = list(COST_COLUMNS) + (list(explain.COLUMNS) if "time_target_share" in table else [])

    display = _cost_display(table)
    regimes = forward_regimes(curves, environment)
    regime_notes = [Note(f"{role} forwards: {regime} ({REGIME_MEANING[regime]})") for role, regime in regimes.items()]
    if not table.empty and regimes:  # per decoder: the regimes of the models its forwards run on
        table = table.assign(
            forward_regime=[
                "; ".join(
                    f"{role} {regimes[role]}"
                    for role in ("target", "draft")
                    if role in regimes and (role == "target" or r["draft_s"] > 0)
                )
                or None
                for _, r in table.iterrows()
            ]
        )
        cols.append("forward_regime")
    if compiled_cells:
        regime_notes.append(
            Note(
                f"not priced (compiled execution; the calibration measures eager forwards): {', '.join(compiled_cells)}"
            )
        )
    regime_notes += [Note(line) for line in explain_notes(table)]
    # the one output layer (reports/rendering/output.py): the same renderers as every other report; CSV holds the
    # per-position acceptance as ';'-joined shares and the sampling settings as JSON text
    reports = [] if table.empty else [Report("cost_model", title, caption, display, table[cols], notes=regime_notes)]
    if not batched.empty:
        reports.append(_batch_report(rid, batched, batch_notes))
    meta = {"run": rid, "calibration": {"batch": curves.batch, "run_id": curves.run_id}}
    if not batched.empty and not table.empty:  # JSON: the batch rows and notes beside the cells (CSV: the cells)
        meta["batch_sizes"] = {
            "rows": json.loads(batched.to_json(orient="records", double_precision=15)),
            "notes": list(batch_notes),
        }
    emit(
        fmt, Document(reports, meta=meta, rows="cells", precision=15, data=table[cols] if not table.empty else batched)
    )


def explained(session, run, table: pd.DataFrame) -> pd.DataFrame:
    """``table`` (:func:`cost_table`) with :data:`dtbench.reports.pricing.explain.COLUMNS` added per cell (issue 58 item 2):
    the numbers of the default report, taken from the run's explained summary
    (:func:`~dtbench.reports.views.summary.run_summary`) by cell id, so both reports show one computation. ``table`` as it
    was where the run explains no cell (stored before the prefill split)."""
    from dtbench.reports.views.summary import run_summary

    if table.empty:
        return table
    summary = run_summary(session, run)
    if "time_target_share" not in summary:
        return table
    return table.merge(summary[["cell_id", *explain.COLUMNS]], on="cell_id", how="left")


def explain_notes(table: pd.DataFrame) -> list[str]:
    """Per explained cell of an :func:`explained` cost table, the default report's one-line note
    (:func:`dtbench.reports.pricing.explain.note`, beside this table's measured speedup) followed by the calibrated
    prediction, which takes over: ``...; measured 1.31x; calibrated: predicted 1.52x, efficiency 0.86 (takes
    over)`` (issue 58 item 2: "with a calibration, the calibrated numbers take over")."""
    out = []
    for _, row in table.iterrows():
        for line in explain.note(row.rename({"measured_speedup": "speedup"})):
            predicted, efficiency = row["predicted_speedup"], row["efficiency"]
            calibrated = [f"predicted {predicted:.2f}x"] if not is_missing(predicted) else []
            calibrated += [f"efficiency {efficiency:.2f}"] if not is_missing(efficiency) else []
            out.append(line + (f"; calibrated: {', '.join(calibrated)} (takes over)" if calibrated else ""))
    return out


def best_config(row) -> str:
    """The predicted best configuration of a cost-table row as shown: ``K=3 (1.42×)`` (chain), ``total_token=40
    (1.80×)`` (a tree recording its node budgets), ``N_max=24`` (tree), or a dash."""
    k, n, tt = row.get("predicted_best_k"), row.get("predicted_best_n_max"), row.get("predicted_best_total_token")
    if not is_missing(k):
        return f"K={int(k)} ({row['predicted_best_speedup']:.2f}×)"
    if not is_missing(tt):
        return f"total_token={int(tt)} ({row['predicted_best_total_token_speedup']:.2f}×)"
    return MISSING if is_missing(n) else f"N_max={int(n)}"


# --- the figure ---------------------------------------------------------------------------------------------------


def verify_figure(curves, sizes: dict[str, float]):
    """Verify cost vs n: the target's tree-masked and causal curves (and the draft's) on the shortest calibrated
    cache, with each tree/chain cell's mean verification size (root + drafted nodes) marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
    ax = fig.subplots()
    styles = {("target", "tree"): "-o", ("target", "causal"): "-s", ("draft", "tree"): "--o", ("draft", "last"): "--s"}
    for (role, kind), style in styles.items():
        if curves.has(role, kind):
            ns, secs = curves.points(role, kind)
            ax.plot(ns, secs * 1e3, style, ms=3, lw=1.2, label=f"{role} {kind}")
    for i, (label, size) in enumerate(sorted(sizes.items(), key=lambda kv: kv[1])):
        ax.axvline(size, color=f"C{(i + 4) % 10}", ls=":", lw=1)
        ax.annotate(
            label, (size, 0.98), xycoords=("data", "axes fraction"), rotation=90, fontsize=7, va="top", ha="right"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per forward n (log scale)")
    ax.set_ylabel("forward latency (ms)")
    ax.set_title("Calibrated forward cost vs n; dotted: mean verification size of each decoder", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def write_figure(sessions, run_ids: list[int | None], out_dir: str | Path) -> list[Path]:
    """Write ``cost_verify_curve.png/.svg`` for the first given run that has a calibration; [] when none has."""
    from dtbench.harness.calibration.curves import load_curves
    from dtbench.reports.rendering.plotting import save_figures
    from dtbench.reports.views.summary import get_run

    with sessions() as session:
        for rid in run_ids or [None]:
            run = get_run(session, rid)
            curves = load_curves(session, run)
            if curves is None:
                continue
            sizes: dict[str, list[int]] = {}
            for cell, s in loading.cell_rows(session, run.id):
                ts = (s.step_stats or {}).get("drafted") or []  # old rows' "tree_size" is the same list
                if any(ts[1:]):  # cells that drafted: their verification sizes
                    sizes.setdefault(cell.label, []).extend(x + 1 for x in ts[1:])
            marks = {k: sum(v) / len(v) for k, v in sizes.items() if v}
            return save_figures({FIG_STEM: verify_figure(curves, marks)}, out_dir)
    return []
