"""``dtbench report --goodput ttft:MS,tpot:MS,e2el:MS``: the share of requests that meet every latency target
(issue 39 item 3).

Goodput is the number serving people choose configurations by (vLLM's ``benchmark_serving --goodput``, DistServe,
Zhong et al. 2024): a request counts only if it met every service-level objective given — time to first token
(``ttft``), time per output token (``tpot``) and end-to-end latency (``e2el``), the names and units (milliseconds) of
vLLM's option. Per cell, over its requests after warmup (a server cell's requests; an in-process cell's prompts, or at
B > 1 each row of each batch, with its own TTFT, TPOT and latency as the runner timed them; repeats each count):

- ``goodput``: the share of requests meeting every target, with a Wilson score interval (``scipy.stats.binomtest``;
  exact enough at the 5-50 requests a cell has, unlike the normal approximation near 0 or 1). A server cell's
  requests that failed (issue 59 item 7: an HTTP error, a timeout, a dropped connection; they have no row) are
  requests that met no target: counted in ``n`` and ``failed``, never in ``good``, as vLLM counts them;
- ``token_goodput``: the share of output tokens that belong to such requests;
- ``goodput_rps``: good requests per second of the cell's wall time (at B = 1 the sum of its samples' times; at
  B > 1, the sum of its prompt groups' wall times; a steady server cell, issue 39 item 1, its measured prompts' first
  send to last token), vLLM's "request goodput".
"""

from __future__ import annotations

import math

import pandas as pd

from dtbench.harness.errors import DtbenchError
from dtbench.harness.measurement.metrics import GROUP, MISSING
from dtbench.harness.suites.grouping import CellKey
from dtbench.reports.stats import show

SLO_NAMES = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "total_s"}  # vLLM's names -> the samples' columns (s)


def parse_slos(text: str) -> dict[str, float]:
    """``ttft:200,tpot:50`` -> {"ttft": 0.2, "tpot": 0.05} (seconds).

    Raises:
        DtbenchError: an unknown name, a value that is not a positive number of milliseconds, a name given twice, or
            nothing given.
    """
    out: dict[str, float] = {}
    for part in [p.strip() for p in str(text).split(",") if p.strip()]:
        name, sep, value = part.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_NAMES:
            raise DtbenchError(
                f"--goodput: {part!r} is not NAME:MS with NAME one of {', '.join(SLO_NAMES)} (e.g. ttft:200,tpot:50)"
            )
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not (ms > 0 and math.isfinite(ms)):
            raise DtbenchError(f"--goodput: {name} must be a positive number of milliseconds, not {value.strip()!r}")
        if name in out:
            raise DtbenchError(f"--goodput: {name} is given twice")
        out[name] = ms / 1e3
    if not out:
        raise DtbenchError("--goodput needs at least one target, e.g. ttft:200,tpot:50,e2el:5000")
    return out


def wilson(good: int, n: int, confidence: float) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``good / n`` (NaNs for n = 0)."""
    if n == 0:
        return math.nan, math.nan
    from scipy.stats import binomtest

    ci = binomtest(good, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def meets(samples: pd.DataFrame, slos: dict[str, float]) -> pd.Series:
    """Per sample (request): whether it met every target. A target a request has no value for (TPOT of a one-token
    answer) is met only if the request has no such latency at all (nothing to judge), never by a missing number
    that exists elsewhere."""
    ok = pd.Series(True, index=samples.index)
    for name, limit in slos.items():
        values = pd.to_numeric(samples[SLO_NAMES[name]], errors="coerce")
        ok &= values.isna() | (values <= limit)
    return ok


def goodput_frame(
    frame: pd.DataFrame,
    slos: dict[str, float],
    confidence: float = 0.95,
    walls: dict[int, float] | None = None,
    failed: dict[int, int] | None = None,
) -> pd.DataFrame:
    """One row per cell with samples after warmup: n requests, failed, good, goodput and its CI, token_goodput,
    goodput_rps.

    Args:
        frame: :func:`~dtbench.reports.views.summary.samples_frame` of one run.
        slos: :func:`parse_slos`'s targets (seconds).
        walls: per cell id, its wall time (s) where it is not a sum of its samples' or groups' times: a steady
            server cell's (:func:`~dtbench.reports.views.engine.steady_walls`).
        failed: per cell id, its requests after warmup that failed (:func:`~dtbench.reports.views.engine.failed_requests`):
            misses of every target, counted in ``n`` (issue 59 item 7).
    """
    s = frame[frame["has_sample"] & ~frame["warmup"].fillna(True).astype(bool)]
    rows = []
    for cell_id, cell in s.groupby("cell_id", sort=False):
        first = cell.iloc[0]
        ok = meets(cell, slos)
        lost = int((failed or {}).get(cell_id, 0))
        n, good = len(cell) + lost, int(ok.sum())
        low, high = wilson(good, n, confidence)
        tokens = pd.to_numeric(cell["new_tokens"], errors="coerce").fillna(0)
        if walls and cell_id in walls:  # a steady server cell: its units' wall times (its blocks overlap)
            wall = walls[cell_id]
        elif "batch_total_s" in cell and cell["batch_total_s"].notna().any():  # groups (B > 1, a server's load)
            keys = [*(["repeat"] if "repeat" in cell else []), "batch_group"]
            wall = float(cell.dropna(subset=["batch_total_s"]).groupby(keys)["batch_total_s"].first().sum())
            wall += float(cell.loc[cell["batch_total_s"].isna(), "total_s"].sum())
        else:
            wall = float(pd.to_numeric(cell["total_s"], errors="coerce").sum())
        rows.append(
            {
                "cell_id": cell_id,
                **{g: first[g] for g in GROUP},
                "label": first["label"],
                "decoder": first["decoder"],
                "n": n,
                "failed": lost,
                "good": good,
                "goodput": good / n if n else math.nan,
                "ci_low": low,
                "ci_high": high,
                "token_goodput": float(tokens[ok].sum() / tokens.sum()) if tokens.sum() else math.nan,
                "goodput_rps": good / wall if wall > 0 else math.nan,
                **{f"slo_{name}_ms": limit * 1e3 for name, limit in slos.items()},
            }
        )
    return pd.DataFrame(rows)


def display(rows: pd.DataFrame, confidence: float) -> pd.DataFrame:
    """Display strings of :func:`goodput_frame` rows."""
    ci = f"{confidence:.0%} CI"
    return pd.DataFrame(
        [
            {
                "Decoder": r["label"],
                "Load": str(int(r["batch_size"])),
                "n": str(int(r["n"])),
                "Failed": str(int(r["failed"])),
                "Good": str(int(r["good"])),
                "Goodput": show(r["goodput"], ".0%"),
                ci: MISSING if math.isnan(r["ci_low"]) else f"[{r['ci_low']:.0%}, {r['ci_high']:.0%}]",
                "Tokens": show(r["token_goodput"], ".0%"),
                "Good req/s": MISSING if math.isnan(r["goodput_rps"]) else f"{r['goodput_rps']:.3f}",
            }
            for _, r in rows.iterrows()
        ]
    )


def goodput_report(sessions, run_id: int | None, fmt: str, slos: dict[str, float], confidence: float = 0.95) -> None:
    """Print the goodput of every cell of a run in ``fmt``: one table per (dataset, L_max, T), loads as rows.

    Raises:
        DtbenchError: unknown run, or no samples after warmup.
    """
    from dtbench.reports.rendering.output import Document, Report, emit
    from dtbench.reports.views.engine import failed_requests, steady_walls
    from dtbench.reports.views.summary import get_run, samples_frame

    with sessions() as session:
        run = get_run(session, run_id)
        frame = samples_frame(session, run.id)
        walls = steady_walls(session, run.id)
        failed = failed_requests(session, run.id)
    rows = goodput_frame(frame, slos, confidence, walls, failed)
    if rows.empty:
        raise DtbenchError(f"run {run.id} has no samples after warmup")
    targets = ", ".join(f"{name} <= {limit * 1e3:g} ms" for name, limit in slos.items())
    caption = (
        f"goodput: the share of requests after warmup meeting every target ({targets}), CI a Wilson score "
        "interval; tokens: the share of output tokens in such requests; good req/s: good requests per second of the "
        "cell's wall time; failed: a server cell's requests that failed, counted as misses. In-process cells: each "
        "prompt (each row of a batch) is a request"
    )
    reports = []
    for i, (_, part) in enumerate(rows.groupby(GROUP[:3], sort=False)):
        part = part.sort_values("batch_size", kind="stable")
        reports.append(
            Report(
                f"goodput_{i}",
                f"Goodput · run {run.id} · {CellKey.of_row(part.iloc[0]).point.title()}",
                caption,
                display(part, confidence),
                part,
            )
        )
    emit(
        fmt,
        Document(
            reports,
            meta={"run": run.id, "confidence": confidence, "slo_ms": {k: v * 1e3 for k, v in slos.items()}},
            rows="cells",
            data=rows,
            title=f"Goodput · run {run.id}",
        ),
    )
