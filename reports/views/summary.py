"""Per-cell summaries computed from the results database only (pandas).

Paper protocol (section 4.1): the first W prompts of each cell are warmup; means and standard deviations are
over the rest. Speedup = mean throughput / mean AR throughput of the same dataset, L_max and T.

Two cell states a reader must not mistake for a normal result:

- *partial*: the cell failed (``cells.status == "failed"``) after some prompts were measured; its numbers come
  from those prompts only. Reports mark it everywhere and the paper tables and figures leave its numbers out unless
  asked (:func:`without_partial`).
- *all warmup*: every measured prompt was a warmup prompt; there is no number to report (never the warmup's).

Whether a cell is lossless is a property of every sample measured, warmup included: a divergence is a
divergence whenever it happened.
"""

from __future__ import annotations

import re
import sys

import pandas as pd
from sqlalchemy import select
from sqlalchemy.orm import Session

from dtbench.harness.errors import DtbenchError
from dtbench.harness.measurement import load
from dtbench.harness.measurement.load import COLUMNS as LOAD_COLUMNS
from dtbench.harness.measurement.metrics import METRICS, acceptance_length, peak_memory_bytes
from dtbench.harness.measurement.sample import SCALAR_COLUMNS
from dtbench.harness.store.db import Run, Sample
from dtbench.harness.suites.bounds import valid_id
from dtbench.harness.suites.grouping import CellKey
from dtbench.reports import loading
from dtbench.reports.pricing import explain
from dtbench.reports.stats import (
    GROUP,
    KEY,
    baseline_values,
    cell_lossless,
    cell_throughput,
    execution_of,
    family_of,
    per_prompt_rows,
    remainder_mask,
    repeated,
)

_SAMPLE_COLS = list(
    SCALAR_COLUMNS
)  # every sample column but the bulky per-iteration lists (harness/measurement/sample.py)
_CELL_COLS = [
    "dataset",
    "l_max",
    "gen_length",
    "batch_size",
    "execution",
    "compile_s",
    "decoder",
    "family",
    "measurer",
    "label",
    "decoder_version",
    "params",
    "sweep_group",
    "sampling",
    "lossless_expected",
    "lossless_check",
    "reference_label",
    "status",
    "error",
    "target_model",
    "draft_model",
    *LOAD_COLUMNS,  # the machine's load during the cell (issue 41; None before migration 0014)
]


def get_run(session: Session, run_id: int | None) -> Run:
    """The run with ``run_id``, or the newest run.

    Raises:
        DtbenchError: if there is no such run.
    """
    if run_id is None:
        run = session.scalars(select(Run).order_by(Run.id.desc()).limit(1)).first()
        if run is None:
            raise DtbenchError("the database holds no runs yet (dtbench run SUITE first)")
        return run
    run = session.get(Run, run_id) if valid_id(run_id) else None  # 10^30 is no such run, not an overflow
    if run is None:
        raise DtbenchError(f"no run {run_id} in the database")
    return run


def samples_frame(session: Session, run_id: int) -> pd.DataFrame:
    """One row per sample of a run, with its cell's columns (``cell_id``, dataset, label, params, ...)."""
    records = []
    for cell, sample in loading.cell_rows(session, run_id, outer=True):
        rec = {"cell_id": cell.id, **{c: getattr(cell, c) for c in _CELL_COLS}}
        rec["batch_size"] = rec["batch_size"] or 1  # cells written before batch sizes: B = 1
        rec["execution"] = rec["execution"] or "eager"  # cells written before compiled execution (0013): eager
        rec.update({c: (getattr(sample, c) if sample is not None else None) for c in _SAMPLE_COLS})
        rec["has_sample"] = sample is not None
        rec["rule_applied"] = _rule_applied(sample)
        records.append(rec)
    return pd.DataFrame.from_records(
        records, columns=["cell_id", *_CELL_COLS, *_SAMPLE_COLS, "has_sample", "rule_applied"]
    )


def _rule_applied(sample: Sample | None) -> str | None:
    """The lossless rule a server sample's check applied (``step_stats.server.lossless_rule``: ``exact`` where the
    reference server gave no top candidates, whatever the suite asked), or None."""
    server = ((sample.step_stats if sample is not None else None) or {}).get("server")
    rule = server.get("lossless_rule") if isinstance(server, dict) else None
    return str(rule) if rule else None


peak_memory = peak_memory_bytes  # the peak memory a reader compares (bytes); defined with the metrics


# Per-cell numbers of a summary (everything a partial cell must not contribute to the paper's tables and figures).
METRIC_COLUMNS = [*METRICS[0].columns, "speedup", *(c for m in METRICS[1:] for c in m.columns)]


def _aggregates(basis: pd.DataFrame) -> dict[str, float]:
    """Every metric's per-cell aggregate over the samples after warmup (NaN when there are none); throughput's mean
    is :func:`~dtbench.reports.stats.cell_throughput`."""
    out = {}
    for m in METRICS:
        values = m.values(basis).dropna() if len(basis) else pd.Series(dtype=float)
        mean = values.mean() if len(values) else float("nan")
        if m.name == "throughput":
            mean = cell_throughput(basis.to_dict("records"))
        if m.name == "acceptance_length":  # pooled over the samples, as Spec-Bench pools its steps
            counted = basis[basis["new_tokens"].notna() & basis["iterations"].notna()] if len(basis) else basis
            mean = (
                acceptance_length(counted["new_tokens"].sum(), counted["iterations"].sum(), len(counted))
                if len(counted)
                else float("nan")
            )
        if m.spread:
            out[f"{m.name}_mean"], out[f"{m.name}_std"] = mean, values.std(ddof=1) if len(values) else float("nan")
        else:
            out[m.name] = mean
    return out


def _dtype(model: str | None) -> str | None:
    """The dtype of a cell's ``target_model`` ("name (dtype)", as the runner records it), or None."""
    found = re.search(r"\(([A-Za-z0-9_]+)\)$", str(model or ""))
    return found.group(1) if found else None


def _repeats(samples: pd.DataFrame, basis: pd.DataFrame) -> dict:
    """A cell's repeat numbers (suite key ``repeats``, issue 41): repeats (the most repeats of a prompt; 1 without),
    throughput_median (tokens/s: the median over prompts of each prompt's median over its repeats) and
    throughput_cv (the median over prompts of each prompt's coefficient of variation of throughput over its
    repeats: the run-to-run noise of one prompt, not the spread between prompts; NaN without repeats)."""
    if not repeated(samples) or basis.empty:
        thr = pd.to_numeric(basis["throughput"], errors="coerce") if len(basis) else pd.Series(dtype=float)
        return {
            "repeats": 1,
            "throughput_median": float(thr.median()) if len(thr) else float("nan"),
            "throughput_cv": float("nan"),
        }
    return {
        "repeats": int(basis["repeats"].max()),
        "throughput_median": float(pd.to_numeric(basis["throughput"], errors="coerce").median()),
        "throughput_cv": float(pd.to_numeric(basis["throughput_cv"], errors="coerce").median()),
    }


def lossless_counts(measured: pd.DataFrame, first: pd.Series) -> dict:
    """The lossless check's numbers of one cell (harness/measurement/lossless.py), over every measured sample, warmup included.

    Keys: lossless_rule (``exact`` | ``tie_aware``; ``exact`` for cells stored before the rule existed), target_dtype,
    lossless_checked_n (samples checked), lossless_ties (tie positions, summed), lossless_tie_samples (samples with a
    tie), lossless_error_samples (samples with an error), lossless_first_error (the smallest first-error position)
    and lossless_error_margin (its margin, logits), lossless_max_tie_margin (logits), lossless_check_s (mean seconds
    of the check per sample). Counts are None where no sample was checked.
    """
    checked = measured[measured["lossless_checked"].notna()]
    out = {
        "lossless_rule": first["lossless_check"] or "exact",
        "target_dtype": _dtype(first["target_model"]),
        "lossless_checked_n": len(checked),
        "lossless_ties": None,
        "lossless_tie_samples": None,
        "lossless_error_samples": None,
        "lossless_first_error": None,
        "lossless_error_margin": None,
        "lossless_max_tie_margin": None,
        "lossless_check_s": None,
    }
    if len(checked) == 0:
        return out
    ties, errors = checked["lossless_ties"].fillna(0).astype(int), checked["lossless_errors"].fillna(0).astype(int)
    out.update(
        lossless_ties=int(ties.sum()),
        lossless_tie_samples=int((ties > 0).sum()),
        lossless_error_samples=int((errors > 0).sum()),
        lossless_check_s=float(pd.to_numeric(checked["lossless_check_s"], errors="coerce").mean()),
    )
    margins = pd.to_numeric(checked["lossless_tie_margin"], errors="coerce").dropna()
    if len(margins):
        out["lossless_max_tie_margin"] = float(margins.max())
    erring = checked[checked["lossless_first_error"].notna()]
    applied = erring["rule_applied"].dropna() if "rule_applied" in erring else pd.Series(dtype=object)
    if len(applied) and all(str(r).startswith("exact") for r in applied):  # the rule its errors were found by
        out["lossless_rule"] = "exact"
    if len(erring):
        at = erring.loc[pd.to_numeric(erring["lossless_first_error"]).idxmin()]
        out["lossless_first_error"] = int(at["lossless_first_error"])
        margin = at["lossless_error_margin"]
        out["lossless_error_margin"] = None if pd.isna(margin) else float(margin)
    return out


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: mean/std over non-warmup samples, speedup vs the same group's ``ar`` cell.

    Columns: dataset, l_max, gen_length, label, decoder, family (the decoder's declared family), n (prompts after
    warmup), warmup_n, speedup, every
    metric of :data:`dtbench.harness.measurement.metrics.METRICS` (``{name}_mean``/``{name}_std`` for the spread ones such as
    throughput, ttft_ms, tpot_ms; ``{name}`` for the others; all NaN when no prompt is left after warmup),
    lossless ('yes', 'no', '—' when nothing to compare) and lossless_n over every measured sample (warmup
    included), the lossless check's numbers (:func:`lossless_counts`), divergences (first divergent token of each
    diverging sample, warmup included), reference, status,
    error, partial (failed after some prompts were measured), all_warmup (samples, but all of them warmup),
    devices (the distinct ``samples.device_name`` of its samples) and mixed_devices (more than one: a heterogeneous
    cluster measured it, so its numbers average different hardware and its speedups are not comparable); repeats,
    throughput_median and throughput_cv (:func:`_repeats`; with repeats every mean is over prompts, each the median
    of its repeats); the machine's load (:data:`dtbench.harness.measurement.load.COLUMNS`, others_cpu_share and busy:
    :func:`dtbench.harness.measurement.load.busy`, load_note: its one line; None and False for cells stored before it was
    recorded).
    """
    out = []
    for cell_id, cell in frame.groupby("cell_id", sort=False):
        first = cell.iloc[0]
        measured = cell[cell["has_sample"]]
        remainder = remainder_mask(measured)
        after_warmup = measured[~measured["warmup"].astype(bool) & ~remainder]
        basis = per_prompt_rows(after_warmup)  # one row per prompt (group): its median over repeats
        compared = measured["lossless"].dropna()
        lossless = cell_lossless(
            measured["lossless"],
            sampled=bool(first["sampling"]) and bool(first["lossless_expected"]),
            lossy=bool(first["sampling"]) and not bool(first["lossless_expected"]),
        )
        out.append(
            {
                "cell_id": cell_id,
                **CellKey.of_row(first).columns(),
                "label": first["label"],
                "decoder": first["decoder"],
                "execution": execution_of(first),
                "compile_s": None if pd.isna(first.get("compile_s")) else float(first["compile_s"]),
                "family": family_of(first["family"]),
                "measurer": first["measurer"],
                "params": first["params"],
                "decoder_version": first["decoder_version"],
                "sweep_group": first["sweep_group"],
                "n": len(basis),
                "warmup_n": int(measured["warmup"].astype(bool).sum()),
                "remainder_n": int(remainder.sum()),
                **_aggregates(basis),
                "lossless": lossless,
                "lossless_n": f"{int(compared.sum())}/{len(compared)}" if len(compared) else "",
                "divergences": sorted(int(d) for d in measured["first_divergence"].dropna()),
                **lossless_counts(measured, first),
                "reference": first["reference_label"],
                "lossless_expected": bool(first["lossless_expected"]),
                "sampling": first["sampling"],
                "status": first["status"],
                "error": first["error"],
                "partial": first["status"] == "failed" and len(measured) > 0,
                "all_warmup": len(measured) > 0 and len(basis) == 0,
                "devices": sorted({str(d) for d in measured["device_name"].dropna()}),
                # samples after warmup shorter than the energy counter's update period: no energy, marked (issue 24)
                "energy_too_short": int((basis["energy_status"] == "too_short").sum())
                if "energy_status" in basis
                else 0,
                **_repeats(after_warmup, basis),
                **{c: first[c] for c in LOAD_COLUMNS},
                "others_cpu_share": load.others_share(first),
                "busy": load.busy(first),
                "load_note": load.note(first),  # the busy machine's one line (CSV and JSON carry it too)
            }
        )
    table = pd.DataFrame(out)
    if table.empty:
        return table
    # Samples of one cell measured on different device models (a heterogeneous Ray cluster): its mean mixes them.
    table["mixed_devices"] = [len(d) > 1 for d in table["devices"]]
    # Speedup against the AR cell of the same group that decodes the same way (greedy, or the same sampling).
    table["speedup"] = table["throughput_mean"] / baseline_values(table, "throughput_mean")
    return table


def lossless_failed(row) -> bool:
    """Whether a summary row is a cell declared lossless whose lossless check failed (``lossless == "no"``): its
    speedup is not a speculative decoder's (it emitted other tokens than the target would), so every report marks
    it (:data:`dtbench.reports.rendering.render.NOT_LOSSLESS_MARK`) and none ranks it or names it a best configuration."""
    return bool(row.get("lossless_expected", False)) and row.get("lossless") == "no"


def without_partial(summary: pd.DataFrame) -> pd.DataFrame:
    """A copy of a summary in which partial cells carry no numbers (METRIC_COLUMNS set to NaN), and neither do the
    speedups measured against a partial AR cell; the affected rows get ``partial_hidden = True``.

    The paper's tables and figures use it unless ``--include-partial`` asks for the partial numbers: a cell that
    failed after some prompts averages over fewer, possibly easier, prompts than its neighbours.
    """
    table = summary.copy()
    if table.empty:
        return table.assign(partial_hidden=pd.Series(dtype=bool))
    partial = table["partial"].fillna(False).astype(bool)
    # speedups against a partial baseline (the one baseline_values pairs the row with) are hidden too
    against = baseline_values(table.assign(_partial=partial.astype(float)), "_partial") == 1.0
    table.loc[partial, METRIC_COLUMNS] = float("nan")
    table.loc[against, "speedup"] = float("nan")
    table["partial_hidden"] = partial | against
    return table


def base_label(label: str) -> str:
    """A label without its trailing parenthesised parameters: ``"Linear Spec (K=8)" -> "Linear Spec"``."""
    return re.sub(r"\s*\([^()]*\)$", "", label) or label


def run_summary(session: Session, run: Run) -> pd.DataFrame:
    """:func:`summarize` of one run plus ``run_id``, ``sweep`` (the cell is a sweep point) and ``sweep_of``."""
    table = summarize(samples_frame(session, run.id))
    if table.empty:
        return table
    table = explain.explain(table, explain.load_sums(session, [int(c) for c in table["cell_id"]]))  # issue 58 item 2
    table = with_failed_requests(table, served_requests(session, run.id))
    table.insert(0, "run_id", run.id)
    table["sweep_of"] = table["sweep_group"]  # stored on the cell by the runner (migration 0003 for older runs)
    table["sweep"] = table["sweep_of"].notna()
    return table


def served_requests(session: Session, run_id: int) -> dict[int, list[dict]]:
    """Per served cell of a run, its samples' ``step_stats.server`` after warmup
    (:func:`dtbench.reports.views.requests.served_stats`): what :func:`with_failed_requests` counts."""
    from dtbench.reports.views.requests import served_stats

    return served_stats(session, run_id)


def with_failed_requests(table: pd.DataFrame, stats: dict[int, list[dict]]) -> pd.DataFrame:
    """``table`` with a served cell's requests after warmup: ``requests`` sent, ``failed_requests`` and
    ``failure_rate`` (:func:`dtbench.reports.views.requests.failure_counts`, each unit once; NaN for dtbench's own decoders),
    so the default report says how many of a served cell's requests its numbers are over (issue 67 item 4)."""
    from dtbench.reports.views.requests import failure_counts

    if table.empty:
        return table
    counts = [failure_counts(stats.get(int(cid), []), int(cid) in stats) for cid in table["cell_id"]]
    table = table.copy()
    table["requests"] = [c["requests"] for c in counts]
    table["failed_requests"] = [c["failed"] for c in counts]
    table["failure_rate"] = [c["failure_rate"] for c in counts]
    return table


def combined_summary(session: Session, run_ids: list[int | None]) -> tuple[pd.DataFrame, list[Run]]:
    """Per-cell summaries of several runs, for paper tables and figures built from more than one suite run.

    Each run is summarized on its own (speedup always against the AR cell of the same run). Where two runs hold
    the same (dataset, L_max, T, label), the run with more cells in that (dataset, L_max, T) wins, so a
    table's rows come from one run where possible (ties: the run given later); a note goes to stderr. Rows keep
    the order of their first appearance (the first run's suite order).

    Raises:
        DtbenchError: an unknown run id, or no cells at all.
    """
    runs = [get_run(session, rid) for rid in (run_ids or [None])]
    if len({r.id for r in runs}) < len(runs):
        raise DtbenchError("the same run is given twice")
    parts = [run_summary(session, run) for run in runs]
    parts = [p for p in parts if not p.empty]
    if not parts:
        raise DtbenchError(f"run {', '.join(str(r.id) for r in runs)} has no cells")
    table = pd.concat(parts, ignore_index=True)
    if len(parts) == 1:
        return table, runs
    order = {r.id: i for i, r in enumerate(runs)}
    table["_first"] = table.groupby(KEY, sort=False).ngroup()
    table["_group_cells"] = table.groupby([*GROUP, "run_id"])["label"].transform("size")
    table["_run_order"] = table["run_id"].map(order)
    ranked = table.sort_values(["_first", "_group_cells", "_run_order"], kind="stable")
    dup = ranked.duplicated(KEY, keep="last")
    if dup.any():
        kept = ranked[~dup]
        print(
            f"note: {int(dup.sum())} cells are in more than one run; each is taken from the run with more cells "
            f"at its dataset/L_max/T (runs used: {', '.join(map(str, sorted(set(kept['run_id']))))})",
            file=sys.stderr,
        )
    table = ranked[~dup].drop(columns=["_first", "_group_cells", "_run_order"]).reset_index(drop=True)
    return table, runs
