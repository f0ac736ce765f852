"""Reports by task for question datasets (issue 21): ``dtbench report --by group|category`` and ``--spec-bench``.

``--by group`` / ``--by category`` breaks every cell down by the samples' task (``samples.task_group`` /
``samples.category``): the default per-cell report, one table per (dataset · task, L_max, T), speedups against the AR
cell on the same task's samples.

``--spec-bench`` prints Spec-Bench's leaderboard layout (hemingkx/Spec-Bench ``evaluation/speed.py``): one row per
method; per task group the speedup = mean over questions of (the question's new tokens summed over its turns / its
wall time summed over its turns), divided by the same mean of the reference (``ar``); Overall the same over every
question; #MAT ("mean accepted tokens") = the mean over every verification step of the tokens it committed, the bonus
token included (``accept_lengths`` in Spec-Bench's answer files; the prefill's first token is not a step; 1.00 for
AR). Differences from speed.py, on purpose: tokens are the generated ids (speed.py re-tokenizes the baseline's text)
and warmup questions (the first W per group) are left out.

Alongside, vLLM's speculative-decoding metrics for every method (``vllm/v1/spec_decode/metrics.py``), over the
verification steps that drafted: acceptance rate = accepted draft tokens / drafted tokens (for a tree, drafted counts
its nodes), mean acceptance length = 1 + accepted / drafting steps (the bonus token included), and the per-position
acceptance curve: position i's rate = drafting steps that accepted more than i tokens / drafting steps (a chain's
i-th draft, a tree's depth-i node on the accepted path).
"""

from __future__ import annotations

import math

import pandas as pd

from dtbench.harness.data.questions import GROUPS
from dtbench.harness.errors import DtbenchError
from dtbench.harness.measurement.metrics import BASELINE, GROUP, MISSING, acceptance_length
from dtbench.harness.suites.grouping import CellKey
from dtbench.reports import loading
from dtbench.reports.rendering.render import NOT_LOSSLESS_MARK
from dtbench.reports.stats import show

BY_COLUMNS = {"group": "task_group", "category": "category"}
GROUP_TITLES = {
    "mt_bench": "MT-bench",
    "translation": "Translation",
    "summarization": "Summarization",
    "qa": "QA",
    "math_reasoning": "Math",
    "rag": "RAG",
}
POSITIONS = 8  # per-position acceptance columns shown (the JSON/CSV carry every position)


def by_task(frame: pd.DataFrame, by: str) -> pd.DataFrame:
    """The per-cell summary (:func:`dtbench.reports.views.summary.summarize`) of each task's samples apart.

    Args:
        frame: :func:`~dtbench.reports.views.summary.samples_frame` of one run.
        by: ``group`` (Spec-Bench's task groups, or the raw categories a suite selected) or ``category``.

    Returns:
        The summary rows of every (task, cell), the dataset column reading ``"<dataset> · <task>"``.

    Raises:
        DtbenchError: the run has no samples with a task (not a question dataset).
    """
    from dtbench.reports.views.summary import summarize

    column = BY_COLUMNS[by]
    tasked = frame[frame["has_sample"] & frame[column].notna()]
    if tasked.empty:
        raise DtbenchError(
            f"--by {by}: the run has no samples with a task (it is for question datasets such as spec-bench)"
        )
    parts = []
    for value, sub in tasked.groupby(column, sort=False):
        part = summarize(sub)
        part["dataset"] = part["dataset"].astype(str) + f" · {value}"
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def task_samples(session, run_id: int) -> pd.DataFrame:
    """One row per greedy sample of a question dataset in the run: the cell's point and label, the task, counts,
    wall time and per-step counters (``step_tokens``, ``drafted``, ``accepted`` lists)."""
    rows = loading.cell_rows(session, run_id, by_prompt=True, tasked=True)
    records = []
    for cell, sample in rows:
        if cell.sampling:  # a sampled cell: its speedup pairs with sampled AR, not Spec-Bench's greedy protocol
            continue
        stats = sample.step_stats or {}
        records.append(
            {
                **{k: getattr(cell, k) for k in ("dataset", "l_max", "gen_length", "label", "decoder", "status")},
                **{
                    k: getattr(sample, k)
                    for k in (
                        "prompt_index",
                        "warmup",
                        "new_tokens",
                        "total_s",
                        "task_group",
                        "category",
                        "turn",
                        "question_id",
                    )
                },
                "batch_size": cell.batch_size or 1,  # question datasets run at B = 1 only (the plan's rule)
                "not_lossless": bool(cell.lossless_expected) and sample.lossless is False,
                "step_tokens": list(sample.step_tokens or []),
                "drafted": list(stats.get("drafted") or []),
                "accepted": list(stats.get("accepted") or []),
            }
        )
    return pd.DataFrame.from_records(records)


def _question_speeds(samples: pd.DataFrame) -> pd.Series:
    """speed.py's per-question speed: new tokens summed over the question's turns / wall time summed over them."""
    per_q = samples.groupby(["task_group", "question_id"], sort=False)[["new_tokens", "total_s"]].sum()
    return per_q["new_tokens"] / per_q["total_s"]


def vllm_metrics(samples: pd.DataFrame) -> dict:
    """vLLM's metrics over the samples' drafting steps: acceptance rate, mean acceptance length, per-position rates.

    Returns:
        ``{"acceptance_rate", "mean_acceptance_length", "per_position": [rate at position 0, 1, ...],
        "drafting_steps"}``; NaN rates and an empty curve when nothing was drafted (AR).
    """
    drafts = drafted = accepted = 0
    per_pos: list[int] = []
    for d_list, a_list in zip(samples["drafted"], samples["accepted"]):
        for d, a in zip(d_list, a_list):
            if d <= 0:
                continue
            drafts, drafted, accepted = drafts + 1, drafted + d, accepted + a
            per_pos.extend([0] * max(0, a - len(per_pos)))
            for i in range(a):
                per_pos[i] += 1
    if not drafts:
        return {
            "acceptance_rate": math.nan,
            "mean_acceptance_length": math.nan,
            "per_position": [],
            "drafting_steps": 0,
        }
    return {
        "acceptance_rate": accepted / drafted,
        "mean_acceptance_length": 1 + accepted / drafts,
        "per_position": [n / drafts for n in per_pos],
        "drafting_steps": drafts,
    }


def mean_accepted_tokens(samples: pd.DataFrame) -> float:
    """#MAT: the mean of the tokens committed per verification step (bonus included), the prefill's step left out,
    pooled over the samples' ``step_tokens``: the one :func:`~dtbench.harness.measurement.metrics.acceptance_length`."""
    committed = [tokens for tokens in samples["step_tokens"] if tokens]
    n = len(committed)  # each sample's first step is its prefill's (one token, whatever it stored)
    return acceptance_length(sum(sum(t[1:]) for t in committed) + n, sum(len(t) for t in committed), n)


def leaderboard(samples: pd.DataFrame) -> pd.DataFrame:
    """Spec-Bench's leaderboard rows, one per (dataset, L_max, T, method), from :func:`task_samples`.

    Columns: dataset, l_max, gen_length, label, one speedup column per task group present (Spec-Bench's order, then
    any raw category), ``mat`` (#MAT), ``overall``, ``questions`` (after warmup), ``partial`` (the cell failed after
    some samples), ``not_lossless`` (declared lossless, and a sample failed the lossless check), and vLLM's ``acceptance_rate``, ``mean_acceptance_length``, ``per_position`` (a list).

    Raises:
        DtbenchError: no greedy question-dataset samples, or no reference (ar) samples to divide by.
    """
    if samples.empty:
        raise DtbenchError("--spec-bench: the run has no greedy samples of a question dataset (such as spec-bench)")
    if "batch_size" not in samples:  # frames made before batch sizes existed: B = 1
        samples = samples.assign(batch_size=1)
    basis = samples[~samples["warmup"].astype(bool)]
    if basis.empty:
        raise DtbenchError("--spec-bench: every question-dataset sample of the run is warmup")
    present = list(dict.fromkeys(basis["task_group"]))
    groups = [g for g in GROUPS if g in present] + [g for g in present if g not in GROUPS]
    rows = []
    # cells declared lossless with a sample (warmup included) that failed the lossless check: marked where shown
    lossy = (
        set()
        if "not_lossless" not in samples
        else {
            tuple(k)
            for k in samples.loc[samples["not_lossless"].astype(bool), [*GROUP, "label"]].itertuples(index=False)
        }
    )
    for point, at in basis.groupby(GROUP, sort=False):
        ref = at[at["decoder"] == BASELINE]
        if ref.empty:
            raise DtbenchError(f"--spec-bench: no {BASELINE} samples at {point[0]} L_max={point[1]} T={point[2]}")
        ref_speed = _question_speeds(ref)
        for label, mine in at.groupby("label", sort=False):
            speeds = _question_speeds(mine)
            row = {
                "dataset": point[0],
                "l_max": point[1],
                "gen_length": point[2],
                "label": label,
                "questions": len(speeds),
                "partial": bool((mine["status"] == "failed").any()),
                "not_lossless": (*point, label) in lossy,
            }
            for g in groups:
                mean, base = (
                    speeds.xs(g, level=0).mean() if g in speeds.index.get_level_values(0) else math.nan,
                    ref_speed.xs(g, level=0).mean() if g in ref_speed.index.get_level_values(0) else math.nan,
                )
                row[g] = mean / base
            row["mat"] = mean_accepted_tokens(mine)
            row["overall"] = speeds.mean() / ref_speed.mean()
            row.update(vllm_metrics(mine))
            rows.append(row)
    return pd.DataFrame(rows)


def display(board: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard as strings: speedups ``1.23x``, #MAT ``2.41``, rates in %, the first POSITIONS positions."""
    fixed = {
        "dataset",
        "l_max",
        "gen_length",
        "label",
        "questions",
        "partial",
        "not_lossless",
        "mat",
        "overall",
        "acceptance_rate",
        "mean_acceptance_length",
        "per_position",
        "drafting_steps",
    }
    groups = [c for c in board.columns if c not in fixed]
    lossy = board["not_lossless"] if "not_lossless" in board else [False] * len(board)
    out = pd.DataFrame(
        {
            "Method": [
                f"{r.label}{' (partial)' if r.partial else ''}{NOT_LOSSLESS_MARK if bad else ''}"
                for r, bad in zip(board.itertuples(), lossy)
            ]
        }
    )
    for g in groups:
        out[GROUP_TITLES.get(g, g)] = [show(v, ".2f", "x") for v in board[g]]
    out["#MAT"] = [show(v, ".2f") for v in board["mat"]]
    out["Overall"] = [show(v, ".2f", "x") for v in board["overall"]]
    out["Accept. rate (vLLM)"] = [show(v * 100, ".1f", "%") for v in board["acceptance_rate"]]
    out["Mean acc. len (vLLM)"] = [show(v, ".2f") for v in board["mean_acceptance_length"]]
    width = min(POSITIONS, max((len(p) for p in board["per_position"]), default=0))
    for i in range(width):
        out[f"pos {i}"] = [show(p[i] * 100, ".0f", "%") if i < len(p) else MISSING for p in board["per_position"]]
    return out


CAPTION = (
    "Spec-Bench layout (evaluation/speed.py): per group, speedup = mean over questions of tokens/s (turns "
    "summed) / the same for ar; #MAT = tokens committed per verification step incl. the bonus; questions after "
    "warmup. vLLM (spec_decode/metrics.py): acceptance rate = accepted / drafted, mean acceptance length = 1 + "
    "accepted / drafting steps, pos i = share of drafting steps accepting more than i tokens."
)


def spec_bench_report(sessions, run_id: int | None, fmt: str) -> None:
    """Print the run's Spec-Bench leaderboard (one table per dataset/L_max/T) in ``fmt``.

    Raises:
        DtbenchError: unknown run, or no question-dataset samples (see :func:`leaderboard`).
    """
    from dtbench.reports.rendering.output import Document, Report, emit
    from dtbench.reports.views.summary import get_run

    with sessions() as session:
        run = get_run(session, run_id)
        board = leaderboard(task_samples(session, run.id))
    points = list(board.groupby(GROUP[:3], sort=False))  # question datasets: B = 1 only, no batch_size column

    def title(part) -> str:
        return f"Spec-Bench · run {run.id} · {CellKey.of_row(part.iloc[0]).point.title()}"

    reports = [
        Report(f"specbench_{i}", title(part), CAPTION, display(part), part) for i, (_, part) in enumerate(points)
    ]
    # one table of rows in the leaderboard's order (CSV: per_position as ';'-joined shares); JSON {"run", "rows"}
    emit(
        fmt,
        Document(
            reports, meta={"run": run.id}, rows="rows", data=board, precision=15, title=f"Spec-Bench · run {run.id}"
        ),
    )
