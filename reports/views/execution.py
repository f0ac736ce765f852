"""``dtbench report --execution``: compiled beside eager, per decoder (issue 37).

One table per (dataset, L_max, T, B): a row per decoder that ran both ways (a compiled cell and its eager twin, the
same label without `` [compiled]``). Per row: each execution's throughput (tokens/s, every prompt after warmup),
compiled / eager as the geometric mean of the per-prompt ratios (same prompt, both after warmup) with a paired
t-interval on their logs (:func:`~dtbench.reports.views.compare.paired_ratio_ci`), the compiled cell's compile time
(seconds, spent once per worker before its warmup, never inside a timed region), each execution's roofline fraction
(:mod:`dtbench.harness.calibration.roofline`: memory-bandwidth-limit seconds over measured seconds) and both lossless verdicts.
A decoder that ran one way only has no row; a note names it.
"""

from __future__ import annotations

import math

import pandas as pd

from dtbench.harness.measurement.metrics import GROUP
from dtbench.harness.suites.decoderspec import COMPILED_SUFFIX
from dtbench.harness.suites.grouping import CellKey
from dtbench.reports.stats import show

CAPTION = (
    "compiled/eager: geometric mean of per-prompt throughput ratios (same prompt, after warmup), CI a paired "
    "t-interval on log ratios; compile: seconds of the compiled cell's compile step (once per worker, before its "
    "warmup); roofline: memory-bandwidth-limit seconds of the forwards / measured seconds"
)


def unpaired(summary: pd.DataFrame, rows: pd.DataFrame) -> dict[CellKey, list[str]]:
    """Per point (dataset, L_max, T, B) of the summary, the labels that ran there in one execution only (no row of
    :func:`execution_frame` pairs them at that point), sorted; points without one left out. A decoder is noted at the
    points it ran at, never under a T it did not run at (issue 50 item 5f)."""
    out = {}
    row_keys = [CellKey.of_row(r) for _, r in rows.iterrows()]
    for _, group in summary.groupby(GROUP, sort=False):
        key = CellKey.of_row(group.iloc[0])
        here = rows[[k == key for k in row_keys]] if len(rows) else rows
        paired = set(here["label"]) | {f"{label}{COMPILED_SUFFIX}" for label in here["label"]} if len(here) else set()
        labels = sorted(set(group["label"]) - paired)
        if labels:
            out[key] = labels
    return out


def execution_frame(frame: pd.DataFrame, summary: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """The report's rows: one per compiled cell with an eager twin in the same group.

    Args:
        frame: :func:`~dtbench.reports.views.summary.samples_frame` of one run.
        summary: :func:`~dtbench.reports.views.summary.summarize` of the same frame.

    Returns:
        Columns dataset, l_max, gen_length, batch_size, label (the eager label), n (paired prompts),
        eager_throughput, compiled_throughput (tokens/s), ratio, ci_low, ci_high, ci_method, compile_s,
        eager_roofline, compiled_roofline (fractions), eager_lossless, compiled_lossless.
    """
    from dtbench.reports.views.compare import paired_ratio_ci, per_prompt

    prompts = per_prompt(frame)
    rows = []
    for key, group in summary.groupby(GROUP, sort=False):
        by_label = {r["label"]: r for _, r in group.iterrows()}
        for label, compiled in by_label.items():
            if compiled.get("execution") != "compiled" or not label.endswith(COMPILED_SUFFIX):
                continue
            eager = by_label.get(label[: -len(COMPILED_SUFFIX)])
            if eager is None or eager.get("execution") == "compiled":
                continue
            at = prompts[(prompts["cell_id"] == compiled["cell_id"]) | (prompts["cell_id"] == eager["cell_id"])]
            tput = at.pivot_table(index="prompt_index", columns="cell_id", values="throughput", aggfunc="first")
            ratios = []
            if compiled["cell_id"] in tput and eager["cell_id"] in tput:
                ratios = (tput[compiled["cell_id"]] / tput[eager["cell_id"]]).dropna().tolist()
            point, low, high, method = paired_ratio_ci(ratios, confidence)
            rows.append(
                {
                    **dict(zip(GROUP, key)),
                    "label": eager["label"],
                    "n": len(ratios),
                    "eager_throughput": eager["throughput_mean"],
                    "compiled_throughput": compiled["throughput_mean"],
                    "ratio": point,
                    "ci_low": low,
                    "ci_high": high,
                    "ci_method": method,
                    "compile_s": compiled.get("compile_s"),
                    "eager_roofline": eager.get("roofline"),
                    "compiled_roofline": compiled.get("roofline"),
                    "eager_lossless": eager["lossless"],
                    "compiled_lossless": compiled["lossless"],
                }
            )
    return pd.DataFrame(rows)


def display(rows: pd.DataFrame) -> pd.DataFrame:
    """The table's display strings."""
    out = []
    for _, r in rows.iterrows():
        ci = f"[{r['ci_low']:.2f}, {r['ci_high']:.2f}]" if not math.isnan(r["ci_low"]) else str(r["ci_method"])
        out.append(
            {
                "Decoder": r["label"],
                "n": str(int(r["n"])),
                "Eager (t/s)": show(r["eager_throughput"], ".1f"),
                "Compiled (t/s)": show(r["compiled_throughput"], ".1f"),
                "Compiled/eager": show(r["ratio"], ".2f") + ("×" if not math.isnan(r["ratio"]) else ""),
                "CI": ci,
                "Compile (s)": show(r["compile_s"], ".1f"),
                "Roofline eager": show(r["eager_roofline"], ".1%"),
                "Roofline compiled": show(r["compiled_roofline"], ".1%"),
                "Lossless": f"{r['eager_lossless']} / {r['compiled_lossless']}",
            }
        )
    return pd.DataFrame(out)


def execution_report(sessions, run_id: int | None, fmt: str, confidence: float = 0.95) -> None:
    """Print compiled beside eager for every decoder of a run that ran both ways, in ``fmt``.

    Raises:
        DtbenchError: unknown run, or a run with no compiled cell that has an eager twin.
    """
    from dtbench.harness.errors import DtbenchError
    from dtbench.reports.rendering.output import Document, Report, emit
    from dtbench.reports.views.summary import get_run, samples_frame, summarize

    with sessions() as session:
        run = get_run(session, run_id)
        frame = samples_frame(session, run.id)
    summary = summarize(frame)
    rows = execution_frame(frame, summary, confidence) if not summary.empty else pd.DataFrame()
    if rows.empty:
        raise DtbenchError(
            f"run {run.id} has no compiled cell with an eager twin (run a suite with `execution: [eager, compiled]`)"
        )
    alone = unpaired(summary, rows)
    parts = [(CellKey.of_row(part.iloc[0]), part) for _, part in rows.groupby(GROUP, sort=False)]
    shown = {key for key, _ in parts}
    elsewhere = [  # points where nothing ran both ways: noted under the first table, each naming its point
        f"one execution only (no pair) at {key.title()}: {', '.join(labels)}"
        for key, labels in alone.items()
        if key not in shown
    ]
    reports = []
    for i, (key, part) in enumerate(parts):
        title = f"Execution · run {run.id} · {key.title()}"
        notes = [f"one execution only (no pair): {', '.join(alone[key])}"] if key in alone else []
        reports.append(
            Report(f"execution_{i}", title, CAPTION, display(part), part, notes=notes + (elsewhere if i == 0 else []))
        )
    emit(
        fmt,
        Document(
            reports,
            meta={"run": run.id, "confidence": confidence},
            rows="rows",
            data=rows,
            title=f"Execution · run {run.id}",
        ),
    )
