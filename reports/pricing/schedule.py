"""``dtbench report --schedule vllm|sglang|trtllm``: the speculation schedule the cost model predicts, in an engine's
configuration terms (issue 39 item 6).

Engines choose how much to speculate per batch size by hand or by a measured sweep (vLLM's
``speculative_config.disable_by_batch_size``, TensorRT-LLM's ``speculative_config.draft_len_schedule``, as merged in
NVIDIA/TensorRT-LLM PR #10860: ``{4: 4, 8: 2, 32: 1}`` = K 4 up to B 4, 2 up to 8, 1 up to 32, none above). dtbench's
cost model predicts it: for every greedy chain cell of a calibrated run at B = 1 (its per-position acceptance and
draft seconds per token, :func:`~dtbench.reports.pricing.costmodel_batch.b1_parameters`) and every calibrated batch size B, the
chain length K up to the deepest drafted position that maximises the predicted speedup
(:meth:`~dtbench.reports.pricing.pricing.Pricer.best_k`, the one S(K)); 0 where even the
best K is predicted slower than ``ar`` (speculation stops paying). Consecutive batch sizes with the same K form one
range. Where the run measured several K of one method at a B (a K sweep with ``batch_sizes``), the measured best K
is shown beside the prediction.

The engines' terms are their adapters' (:meth:`dtbench.decoders.engines.Engine.schedule`; the engines that state
one: :func:`~dtbench.decoders.engines.schedule_engines`):

- ``trtllm``: ``draft_len_schedule`` {largest B of each range: K}, the ranges after the last K > 0 left out (0 above).
- ``vllm``: vLLM takes one ``num_speculative_tokens``: the K of the first range, and ``disable_by_batch_size``: the
  first batch size predicted not to pay (None when every calibrated B pays).
- ``sglang``: SGLang takes one ``--speculative-num-steps`` per server; the per-bucket values are given for a launcher
  that picks the server by load, with ``--speculative-num-draft-tokens`` = steps + 1 (chain drafting, top-k 1).

Engine knowledge is code, not data: this report reads the adapters (the second documented exception to "reports read
the database only", beside the tuning line's decoder defaults; tests/test_import_graph.py).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import pandas as pd

from dtbench.decoders.engines import engine_for, schedule_engines
from dtbench.harness.errors import DtbenchError
from dtbench.harness.suites.grouping import CellKey, PointKey
from dtbench.reports import loading

if TYPE_CHECKING:
    from dtbench.reports.pricing.costmodel_batch import B1Params


def schedule_rows(session, run, curves) -> pd.DataFrame:
    """Per chain decoder of a run (greedy, B = 1 cell with samples after warmup) and calibrated batch size B: the
    predicted best K and speedup, K 0 where speculation is predicted not to pay, and the measured best K at B where
    the run measured several K of that method (same decoder, the label's K swept).

    Returns:
        Columns dataset, l_max, gen_length, label, decoder, batch_size, best_k (0 where the best K is predicted not to
        pay), predicted_speedup, top_k (the K of the highest predicted speedup, paying or not), measured_best_k,
        measured_top_k (the same two of the measured sweep; None without one), measured_speedup.
    """
    from dtbench.reports.pricing.costmodel_batch import b1_frame, b1_parameters, price_proposers
    from dtbench.reports.pricing.pricing import Pricer
    from dtbench.reports.stats import family_of
    from dtbench.reports.views.compare import speedup_table
    from dtbench.reports.views.summary import samples_frame

    sizes = sorted({1, *curves.batch_sizes()})
    cells = loading.run_cells(session, run.id)
    measured: dict[tuple[CellKey, str], dict[int, float]] = {}  # (cell, decoder) -> {K: speedup}
    frame = samples_frame(session, run.id)
    speed = speedup_table(frame) if not frame.empty else pd.DataFrame()
    by_label = {(CellKey.of_row(c), c.label): c for c in cells}
    for _, r in speed.iterrows():
        c = by_label.get((CellKey.of_row(r), r["label"]))
        k = (c.params or {}).get("k") if c is not None else None
        if c is None or family_of(c.family) != "chain" or not isinstance(k, int) or math.isnan(r["speedup"]):
            continue
        measured.setdefault((CellKey.of_row(c), c.decoder), {})[k] = r["speedup"]
    rows = []
    params_of: dict[tuple[PointKey, str], B1Params] = {}  # (point, label) -> B = 1 parameters
    cell_of: dict[tuple[PointKey, str], Any] = {}
    for c in cells:
        if (c.batch_size or 1) != 1 or c.sampling or family_of(c.family) not in ("ar", "chain") or c.status == "failed":
            continue
        samples = b1_frame(c.samples)
        got = b1_parameters(samples, family_of(c.family)) if not samples.empty else None
        if got is not None:
            key = (CellKey.of_row(c).point, c.label)
            params_of[key], cell_of[key] = got, c
    params_of = price_proposers(params_of)  # a proposer's own CPU time is draft cost at every B (issue 39 item 5)
    pricer = Pricer(curves)
    for key, params in params_of.items():
        c = cell_of[key]
        if params.family != "chain" or not params.p:
            continue
        past = c.l_max + c.gen_length // 2
        for b in sizes:
            best = pricer.best_k(params.p, past, b, params.draft_tokens_s)
            if best is None:
                continue
            k, s = best
            seen = measured.get((CellKey.of_row(c).point.at(b), c.decoder), {})
            top = max(seen, key=lambda x: seen[x]) if len(seen) > 1 else None
            rows.append(
                {
                    "dataset": c.dataset,
                    "l_max": c.l_max,
                    "gen_length": c.gen_length,
                    "label": c.label,
                    "decoder": c.decoder,
                    "batch_size": b,
                    "best_k": k if s >= 1 else 0,
                    "predicted_speedup": s,
                    "top_k": k,
                    "measured_best_k": (top if seen[top] >= 1 else 0) if top is not None else None,
                    "measured_top_k": top,
                    "measured_speedup": seen[top] if top is not None else None,
                }
            )
    return pd.DataFrame(rows)


def ranges(rows: pd.DataFrame) -> list[tuple[int, int, int]]:
    """(first B, last B, K) runs of one decoder's rows (sorted by B), consecutive equal K merged."""
    out: list[tuple[int, int, int]] = []
    for _, r in rows.sort_values("batch_size").iterrows():
        b, k = int(r["batch_size"]), int(r["best_k"])
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], b, k)
        else:
            out.append((b, b, k))
    return out


def engine_config(engine: str, spans: list[tuple[int, int, int]]) -> dict:
    """The schedule in ``engine``'s configuration terms (module docstring): its adapter's
    :meth:`~dtbench.decoders.engines.Engine.schedule` of ``spans`` ((first B, last B, K) ranges, :func:`ranges`).

    Raises:
        DtbenchError: an unknown engine, or one that states no schedule.
    """
    config = engine_for(engine).schedule(spans)
    if config is None:
        raise DtbenchError(f"--schedule: engine {engine!r} states no speculation schedule")
    return config


def schedule_report(sessions, run_id: int | None, fmt: str, engine: str) -> None:
    """Print the predicted schedule per chain decoder of a calibrated run, with the engine's configuration.

    Raises:
        DtbenchError: unknown engine or run, a run without calibration, or no chain cell to predict from.
    """
    from dtbench.harness.calibration.curves import load_curves
    from dtbench.reports.pricing.costmodel import NO_CALIBRATION
    from dtbench.reports.rendering.output import Document, Note, Report, emit
    from dtbench.reports.views.summary import get_run

    if engine not in (engines := schedule_engines()):
        raise DtbenchError(f"--schedule: unknown engine {engine!r} (choose from {', '.join(engines)})")
    with sessions() as session:
        run = get_run(session, run_id)
        curves = load_curves(session, run)
        if curves is None:
            raise DtbenchError(NO_CALIBRATION.format(run=run.id))
        rows = schedule_rows(session, run, curves)
    if rows.empty:
        raise DtbenchError(
            f"run {run.id} has no greedy chain decoder (linear, ngram, suffix, ...) at B = 1 with samples after warmup "
            f"to predict a schedule from"
        )
    batched = bool(curves.batch_sizes())
    caption = (
        "best K per batch size B predicted by the cost model from the B = 1 cell's per-position acceptance and the "
        "calibrated (B, new tokens) curves; K 0: speculation predicted not to pay at that B; measured best K: where "
        "the run measured several K of the method at B; top K: the K of the highest speedup, paying or not (where "
        "no K pays, both best K are 0 and the top K still says whether the model ranks the K as measured)"
        + ("" if batched else "; this calibration has no batched curves (B = 1 only): add batch_sizes to the suite")
    )
    reports, configs = [], {}
    for i, ((dataset, l_max, gen_length, label), part) in enumerate(
        rows.groupby(["dataset", "l_max", "gen_length", "label"], sort=False)
    ):
        spans = ranges(part)
        config = engine_config(engine, spans)
        configs["/".join(map(str, (dataset, l_max, gen_length, label)))] = config
        display = pd.DataFrame(
            [
                {
                    "B": str(int(r["batch_size"])),
                    "Best K (pred.)": str(int(r["best_k"])),
                    "Speedup (pred.)": f"{r['predicted_speedup']:.2f}×",
                    "Best K (meas.)": "—" if r["measured_best_k"] is None else str(int(r["measured_best_k"])),
                    "Top K pred./meas.": f"{int(r['top_k'])}/"
                    + ("—" if r["measured_top_k"] is None else str(int(r["measured_top_k"]))),
                    "Speedup (meas.)": "—" if r["measured_speedup"] is None else f"{r['measured_speedup']:.2f}×",
                }
                for _, r in part.sort_values("batch_size").iterrows()
            ]
        )
        reports.append(
            Report(
                f"schedule_{i}",
                f"Schedule for {engine} · run {run.id} · {label} · {dataset} · L_max={l_max} · T={gen_length}",
                caption,
                display,
                part,
                notes=[Note(f"{engine}: {json.dumps(config)}")],
            )
        )
    emit(
        fmt,
        Document(reports, meta={"run": run.id, "engine": engine, "configs": configs}, rows="rows", data=rows),
    )
