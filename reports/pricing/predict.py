"""Will it pay on that device? (issue 48): a stored run's acceptance traces priced on another device's curves.

``dtbench report --predict-on CURVES [--run ID]``: every cell of the run (batch size 1, the curves' execution) is
replayed sample by sample: each forward its steps ran (``step_stats["target_fed"]``/``["draft_fed"]``: tokens fed,
cache positions before it, mask flags) is priced on the imported curves (:func:`~dtbench.reports.pricing.pricing.
Pricer.sample`, the cost model's pricing), and each iteration pays the loop overhead per iteration measured on that
device for that decoder (``overhead_s`` of the curves file; none: forwards only, and the report says so). So

    predicted time of a sample on the device = sum of its forwards' prices + iterations x overhead(decoder)

and the predicted speedup of a cell = the predicted time of the ``ar`` cell of the same dataset, L_max and T
(decoding the same way) / the cell's, beside the speedup measured here. The acceptance (how many tokens each
iteration committed, how many nodes it drafted) is this machine's measurement; the price of a forward is the
device's. The model shapes must match (:func:`~dtbench.harness.calibration.curves_file.shape_mismatch`); the dtype may differ
(the curves price their own, which the title names).

``dtbench report --export-curves FILE [--run ID]`` writes a calibrated run's curves and the loop overhead per
iteration its own eager B = 1 cells measured (per decoder: the median over samples of (measured time - time inside
forwards) / iterations) as such a file.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pandas as pd

from dtbench.harness.calibration import curves_file
from dtbench.harness.errors import DtbenchError
from dtbench.harness.suites.grouping import CellKey
from dtbench.reports import loading
from dtbench.reports.pricing.costmodel import NO_CALIBRATION, uses_draft_model
from dtbench.reports.pricing.pricing import Pricer
from dtbench.reports.rendering.output import Document, Note, Report, emit
from dtbench.reports.stats import GROUP, baseline_values, family_of, served, show

FIG_STEM = "predicted_speedup"


def _cells(session, run) -> list[tuple[Any, list[Any]]]:
    """(cell, its samples after warmup) for every cell of ``run`` with such samples."""
    return list(loading.measured_cells(session, run.id))


def predict_table(session, run, pc: curves_file.PortableCurves) -> tuple[pd.DataFrame, list[str]]:
    """One row per priced cell: predicted seconds, throughput and speedup on the curves' device beside the measured
    ones here; and the labels of cells not priced (served through requests, B > 1, another execution, an external
    loop without forward records), each with why.

    Raises:
        DtbenchError: the curves cannot price the run's models: a shape mismatch, or no rows of a role the run's
            cells need (the draft's, for cells running the draft model: issue 59 item 4), in one line.
    """
    env = run.environment or {}
    roles = {"target": env.get("target"), "draft": env.get("draft")}
    cells = _cells(session, run)
    drafting = [c.label for c, _ in cells if uses_draft_model(c) and not served(c)]
    if not drafting:
        roles["draft"] = None
    problem = curves_file.shape_mismatch(pc.models, roles)
    if problem is None:
        missing = [role for role in ("target", "draft") if roles[role] and role not in pc.curves.roles()]
        if missing:
            problem = f"the curves hold no {missing[0]} rows" + (
                f"; the run's cells {', '.join(drafting[:3])} run the draft model" if missing[0] == "draft" else ""
            )
    if problem:
        raise DtbenchError(f"cannot predict run {run.id} on {pc.device_name}: {problem}")
    out, skipped = [], []
    for cell, samples in cells:
        if served(cell):  # its time is the server's: no forward of it ran here to price (issue 59 item 4)
            skipped.append(f"{cell.label} (served: measured through requests to a server, no forwards to price)")
            continue
        if (cell.batch_size or 1) > 1:
            skipped.append(f"{cell.label} (B = {cell.batch_size}: the curves are batch-1 curves)")
            continue
        if (cell.execution or "eager") != pc.execution:
            skipped.append(f"{cell.label} ({cell.execution} execution; the curves are {pc.execution})")
            continue
        pricer = Pricer(pc.curves, pc.overhead)
        overhead = pricer.loop_overhead(cell.decoder)
        predicted = [
            pricer.sample(s.step_stats or {}, uses_draft_model(cell), s.iterations, cell.decoder).predicted_s
            for s in samples
        ]
        if not all(p > 0 for p in predicted):
            skipped.append(f"{cell.label} (no forward records to price)")
            continue
        out.append(
            {
                **CellKey.of_row(cell).columns(),
                "label": cell.label,
                "decoder": cell.decoder,
                "family": family_of(cell.family),
                "sampling": cell.sampling,
                "n": len(samples),
                "overhead_s_per_iteration": overhead,
                "predicted_s": statistics.fmean(predicted),
                "measured_s": statistics.fmean(s.total_s for s in samples),
                "predicted_throughput": statistics.fmean(s.new_tokens / p for s, p in zip(samples, predicted)),
                "measured_throughput": statistics.fmean(s.new_tokens / s.total_s for s in samples),
                "tokens_per_iteration": statistics.fmean(s.new_tokens / s.iterations for s in samples),
            }
        )
    table = pd.DataFrame(out)
    if not table.empty:
        table["predicted_speedup"] = baseline_values(table, "predicted_s") / table["predicted_s"]
        table["measured_speedup"] = table["measured_throughput"] / baseline_values(table, "measured_throughput")
    return table, skipped


def predict_report(sessions, run_id: int | None, fmt: str, curves: str | curves_file.PortableCurves) -> None:
    """``dtbench report --predict-on CURVES [--run ID]``: the table of :func:`predict_table`. ``curves``: the file's
    path, or the file read (:func:`~dtbench.harness.calibration.curves_file.read`, as ``report`` does before any other work).

    Raises:
        DtbenchError: an unreadable curves file, a shape mismatch, an unknown run, nothing to price (one line).
    """
    from dtbench.reports.views.summary import get_run

    pc = curves if isinstance(curves, curves_file.PortableCurves) else curves_file.read(curves)
    curves_path = pc.path
    with sessions() as session:
        run = get_run(session, run_id)
        table, skipped = predict_table(session, run, pc)
        rid, here = run.id, (run.environment or {}).get("device_name", "?")
    if table.empty:
        raise DtbenchError(f"run {rid} has no batch-1 {pc.execution} cells with forward records to price")
    dtypes = "/".join(str(m.get("dtype")) for m in pc.models.values() if m)
    title = f"run {rid} predicted on {pc.device_name} ({pc.execution}, {dtypes}; curves: {pc.source or curves_path})"
    caption = (
        "predicted = each sample's forwards (as counted here) priced on the device's curves + iterations x the "
        "device's loop overhead per iteration; speedups vs ar of the same dataset/L_max/T; acceptance measured "
        f"here ({here}), forward costs measured there"
    )
    notes = [Note(f"not priced: {s}") for s in skipped]
    if not pc.overhead_s:
        notes.append(Note("the curves carry no loop overhead: forwards only (an upper bound on throughput)"))
    cols = [*GROUP, "label", "decoder", "n", "tokens_per_iteration", "overhead_s_per_iteration", "predicted_s"]
    cols += ["predicted_throughput", "predicted_speedup", "measured_s", "measured_throughput", "measured_speedup"]
    display = pd.DataFrame(
        [
            {
                "Dataset": r["dataset"],
                "L_max": str(r["l_max"]),
                "T": str(r["gen_length"]),
                "Decoder": r["label"],
                "n": str(r["n"]),
                "Tokens/iter": show(r["tokens_per_iteration"], ".2f"),
                "Overhead/iter (ms)": show(r["overhead_s_per_iteration"] * 1e3, ".2f"),
                f"Predicted t/s ({pc.device_name})": show(r["predicted_throughput"], ".1f"),
                "Speedup pred.": show(r["predicted_speedup"], ".2f", "×"),
                "Measured t/s (here)": show(r["measured_throughput"], ".1f"),
                "Speedup here": show(r["measured_speedup"], ".2f", "×"),
            }
            for _, r in table.iterrows()
        ]
    )
    meta = {"run": rid, "curves": {"device_name": pc.device_name, "execution": pc.execution, "source": pc.source}}
    emit(
        fmt,
        Document(
            [Report("predict_on", title, caption, display, table[cols], notes=notes)],
            meta=meta,
            rows="cells",
            precision=15,
        ),
    )


def write_figure(
    sessions, run_id: int | None, curves: str | curves_file.PortableCurves, out_dir: str | Path
) -> list[Path]:
    """One figure: predicted speedup per decoder on the curves' device beside the speedup measured here, one pair of
    bars per cell (``--predict-on CURVES --figures DIR``); the PNG and SVG paths written. ``curves``: as
    :func:`predict_report`'s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dtbench.reports.views.summary import get_run

    pc = curves if isinstance(curves, curves_file.PortableCurves) else curves_file.read(curves)
    with sessions() as session:
        run = get_run(session, run_id)
        table, _ = predict_table(session, run, pc)
        here = (run.environment or {}).get("device_name", "?")
    if table.empty:
        return []
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    labels = [f"{r['label']}\n{r['dataset']} T={r['gen_length']}" for _, r in table.iterrows()]
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(labels)), 3.6))
    ax.bar([i - 0.2 for i in x], table["measured_speedup"], 0.4, label=f"measured here ({here})"[:60])
    ax.bar([i + 0.2 for i in x], table["predicted_speedup"], 0.4, label=f"predicted on {pc.device_name}"[:60])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("speedup over ar")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [folder / f"{FIG_STEM}.png", folder / f"{FIG_STEM}.svg"]
    for p in paths:
        fig.savefig(p)
    plt.close(fig)
    return paths


def loop_overhead(session, run) -> dict[str, float]:
    """Loop overhead per iteration (seconds) measured by ``run``'s eager batch-1 cells, per decoder: the median over
    samples of (measured time - time inside the timed forwards) / iterations, and ``"*"``, the median over all
    cells' values. Samples without timed forwards are left out."""
    per: dict[str, list[float]] = {}
    for cell, samples in _cells(session, run):
        if (cell.batch_size or 1) > 1 or (cell.execution or "eager") != "eager":
            continue
        for s in samples:
            fwd = (s.step_stats or {}).get("forward_s")
            if not fwd or not s.iterations:
                continue
            inside = (fwd.get("target") or 0.0) + (fwd.get("draft") or 0.0)
            per.setdefault(cell.decoder, []).append(max(0.0, s.total_s - inside) / s.iterations)
    out = {d: statistics.median(v) for d, v in per.items()}
    if out:
        out["*"] = statistics.median(out.values())
    return out


def export_curves(sessions, run_id: int | None, path: str) -> Path:
    """``dtbench report --export-curves FILE [--run ID]``: the run's calibration and its loop overhead per iteration
    as a curves file (:mod:`dtbench.harness.calibration.curves_file`); the path written.

    Raises:
        DtbenchError: an unknown run, a run without calibration, an unwritable file (one line).
    """
    from dtbench.harness.calibration.curves import load_curves
    from dtbench.reports.views.summary import get_run

    with sessions() as session:
        run = get_run(session, run_id)
        curves = load_curves(session, run)
        if curves is None:
            raise DtbenchError(NO_CALIBRATION.format(run=run.id))
        env = dict(run.environment or {})
        doc = curves_file.document(
            curves.rows,
            device=str(env.get("device") or "?"),
            device_name=str(env.get("device_name") or "?"),
            models={"target": env.get("target"), "draft": env.get("draft")},
            overhead_s=loop_overhead(session, run),
            versions={k: str(env[k]) for k in ("torch", "transformers", "dtbench") if env.get(k)},
            source=f"run {run.id} (calibration {str(curves.batch)[:8]})",
        )
    return curves_file.write(path, doc)
