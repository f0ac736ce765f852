"""``dtbench report --engine``: servers and dtbench's own decoders on one load axis (issue 30).

One table per (dataset, L_max, T): a row per cell and load level (the ``batch_size`` column: the batch size B of
dtbench's decoders, the requests in flight of a ``server`` cell). Per row:

- speedup over its reference at the same load, paired per prompt group (a group's throughput = its tokens / its wall
  time, :func:`~dtbench.reports.stats.collapse_batches`) with a confidence interval
  (:func:`~dtbench.reports.views.compare.paired_ratio_ci`): a server against its plain server (``cells.reference_label``),
  dtbench's decoders against ``ar`` at the same B;
- p50/p90/p99 of TTFT, ITL, TPOT and end-to-end latency over the cell's requests after warmup (server cells: the
  client's per-request times; dtbench's decoders: per row, ITL = the gaps between committed steps);
- acceptance length, labelled by how it is averaged: *per step* (tokens over verification steps, pooled over the
  cell's requests: vLLM's ``1 + accepted / drafts``) and *per request* (the mean of each request's own), each with its
  source (llama.cpp ``timings.draft_n_accepted``, SGLang ``spec_verify_ct``, vLLM ``/metrics`` counters, or dtbench's
  own Steps), beside the client-side tokens per network read;
- lossless against the reference and the rule that applied (tie-aware with top log-probabilities, or exact).
"""

from __future__ import annotations

import math

import pandas as pd

from dtbench.harness.measurement.metrics import BASELINE, GROUP, MISSING
from dtbench.harness.store.db import Sample
from dtbench.harness.suites.grouping import CellKey
from dtbench.harness.values import percentiles
from dtbench.reports import loading
from dtbench.reports.stats import is_missing, per_prompt_rows, remainder_mask, served, show
from dtbench.reports.views.requests import failure_counts, served_stats, unit_loads

CAPTION = (
    "load: batch size B for dtbench's decoders, requests in flight for a server; speedup: over the reference "
    "at the same load (a server over its plain server, dtbench's decoders over ar), paired per prompt group, "
    "CI a paired t-interval on log ratios; latencies p50/p90/p99 in ms after warmup; acceptance length per "
    "step = tokens / verification steps pooled over the cell, per request = the mean of each request's own; kind: "
    "B (static batch) = lock-step batches of B prompts, concurrency (steady) = C requests kept in flight over the "
    "cell's measured prompts (a server's speedup pairs blocks of C prompts, each block's tokens over its first send "
    "to last token); cell t/s = the cell's tokens over its wall time, steady t/s = the tokens that arrived from the "
    "moment C requests were first in flight (with arrivals: the first completion) to the first completion after the "
    "last send, over that window; in flight = time-weighted mean of requests in flight; ramp/steady/drain = the "
    "seconds before, in and after that window; failed = a server cell's requests after warmup that failed (an "
    "HTTP error, an error event, a timeout, a dropped connection) of those sent: they have no latencies and miss "
    "every goodput target"
)


# The rule of dtbench's own decoders' lossless verdicts (a server's is the one its samples recorded).
OWN_RULE = "tie_aware or exact: the suite's lossless_check (dtbench's check)"


def _pct(values: list[float]) -> tuple[float, float, float]:
    """(p50, p90, p99) of ``values`` (:func:`~dtbench.harness.values.percentiles`), NaN when empty."""
    p = {k: math.nan if v is None else v for k, v in percentiles(values).items()}
    return p["p50"], p["p90"], p["p99"]


def engine_frame(session, run_id: int, confidence: float = 0.95) -> pd.DataFrame:
    """The report's rows (one per cell), numbers in seconds, tokens and ratios (see the module docstring)."""
    from dtbench.reports.views.compare import paired_ratio_ci

    cells = loading.run_cells(session, run_id)
    samples = [s for _, s in loading.cell_rows(session, run_id)]
    by_cell: dict[int, list[Sample]] = {}
    for s in samples:
        by_cell.setdefault(s.cell_id, []).append(s)
    flat = pd.DataFrame(
        [
            {
                "cell_id": s.cell_id,
                "prompt_index": s.prompt_index,
                "warmup": s.warmup,
                "new_tokens": s.new_tokens,
                "total_s": s.total_s,
                "throughput": s.throughput,
                "lossless": s.lossless,
                "batch_group": s.batch_group,
                "batch_rows": s.batch_rows,
                "batch_total_s": s.batch_total_s,
                "repeat": s.repeat or 0,
            }
            for s in samples
        ]
    )
    if flat.empty:
        return pd.DataFrame()
    flat["batch_size"] = flat["cell_id"].map({c.id: c.batch_size or 1 for c in cells})
    flat = flat[~remainder_mask(flat)]
    groups = per_prompt_rows(flat)  # a prompt group (B > 1) and a prompt's repeats: one row each
    groups = groups[~groups["warmup"].astype(bool)]
    thr = {cid: g.set_index("prompt_index")["throughput"] for cid, g in groups.groupby("cell_id")}
    key_of = {c.id: CellKey.of_row(c) for c in cells}
    by_label = {(key_of[c.id], c.label): c for c in cells}
    rows = []
    for c in cells:
        key = key_of[c.id]
        mine = [s for s in by_cell.get(c.id, []) if not s.warmup]
        server = [((s.step_stats or {}).get("server") or {}) for s in mine]
        is_server = any(server)
        through_requests = served(c.measurer)
        ref_label = c.reference_label if through_requests else (None if c.decoder == BASELINE else BASELINE)
        ref = by_label.get((key, ref_label)) if ref_label else None
        row = dict(
            key.columns(),
            label=c.label,
            decoder=c.decoder,
            family=c.family,
            status=c.status,
            reference=ref_label,
            n=0,
            throughput=math.nan,
            speedup=math.nan,
            ci_low=math.nan,
            ci_high=math.nan,
            ci_method="",
        )
        t = thr.get(c.id)
        if t is not None and len(t):
            row["throughput"] = float(t.mean())
        if ref is not None and t is not None and ref.id in thr:
            r = thr[ref.id]
            common = t.index.intersection(r.index)
            if len(common):
                row["speedup"] = float(t.loc[common].mean() / r.loc[common].mean())
                point, low, high, method = paired_ratio_ci((t.loc[common] / r.loc[common]).to_numpy(), confidence)
                row.update(n=len(common), paired_speedup=point, ci_low=low, ci_high=high, ci_method=method)
        ttft = [s.ttft_s for s in mine if s.ttft_s is not None]
        tpot = [s.tpot_s for s in mine if s.tpot_s is not None]
        e2e = [s.total_s for s in mine]
        if is_server:
            itl = [x for st in server for x in (st.get("itl_s") or [])]
        else:
            itl = [b - a for s in mine for a, b in zip(s.step_times_s or [], (s.step_times_s or [])[1:])]
        for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
            p50, p90, p99 = _pct(values)
            row.update({f"{name}_p50_s": p50, f"{name}_p90_s": p90, f"{name}_p99_s": p99})
        row.update(_acceptance(mine, server, is_server))
        row.update(load_kind(c.batch_size or 1, server, is_server))
        row.update(failure_counts(server, is_server))
        verdicts = [s.lossless for s in by_cell.get(c.id, []) if s.lossless is not None]
        row["lossless"] = MISSING if not verdicts else ("yes" if all(verdicts) else "no")
        row["ties"] = sum(s.lossless_ties or 0 for s in by_cell.get(c.id, []))
        every = [((s.step_stats or {}).get("server") or {}) for s in by_cell.get(c.id, [])]  # warmup included
        rules = sorted({str(st["lossless_rule"]) for st in every if st.get("lossless_rule")})
        own = "" if through_requests else OWN_RULE
        row["lossless_rule"] = "; ".join(rules) if rules else (own if verdicts else "")
        rows.append(row)
    return pd.DataFrame(rows)


STATIC = "B (static batch)"
STEADY = "concurrency (steady)"
GROUPS = "concurrency (groups of C)"


def steady_walls(session, run_id: int) -> dict[int, float]:
    """Per steady server cell of a run (issue 39 item 1), its measured wall time in seconds: the sum of its units'
    first send to last token (its blocks of C overlap, so the sum of their walls is no wall time)."""
    walls = {cid: sum(u["wall_s"] for u in unit_loads(server)) for cid, server in served_stats(session, run_id).items()}
    return {cid: wall for cid, wall in walls.items() if wall > 0}


def failed_requests(session, run_id: int) -> dict[int, int]:
    """Per server cell of a run, its requests after warmup that failed (:func:`failure_counts`; issue 59 item 7)."""
    return {cid: int(failure_counts(server, True)["failed"]) for cid, server in served_stats(session, run_id).items()}


def load_kind(batch_size: int, server: list[dict], is_server: bool) -> dict:
    """How a cell's load was applied (issue 39 item 1), and its steady part where it has one.

    ``load_kind``: dtbench's own decoders decode lock-step static batches of B (:data:`STATIC`); a server cell
    measured since issue 39 keeps C requests in flight over its measured prompts (:data:`STEADY`); one measured before
    sent groups of C and waited for each (:data:`GROUPS`). For a steady cell (``step_stats.server.cell_load``,
    :func:`dtbench.harness.serving.load_profile`): ``cell_throughput`` its tokens over its wall time (tokens/s),
    ``steady_throughput`` the tokens that arrived in its steady window over that window, ``mean_in_flight`` the
    time-weighted mean of requests in flight over the cell, and ``ramp_s``/``steady_s``/``drain_s`` (s), summed over
    its repeats' units (one unit per repeat; NaN where absent)."""
    out = {
        "load_kind": STATIC if not is_server else GROUPS,
        "cell_throughput": math.nan,
        "steady_throughput": math.nan,
        "mean_in_flight": math.nan,
        "ramp_s": math.nan,
        "steady_s": math.nan,
        "drain_s": math.nan,
    }
    loads = unit_loads(server)
    if not is_server or not loads:
        return out
    wall = sum(u["wall_s"] for u in loads)
    steady = sum(u["steady_s"] for u in loads)
    tokens = sum((u.get("throughput") or 0.0) * u["wall_s"] for u in loads)
    steady_tokens = sum((u.get("steady_throughput") or 0.0) * u["steady_s"] for u in loads)
    out.update(
        load_kind=STEADY,
        cell_throughput=tokens / wall if wall > 0 else math.nan,
        steady_throughput=steady_tokens / steady if steady > 0 else math.nan,
        mean_in_flight=sum(u["mean_in_flight"] * u["wall_s"] for u in loads) / wall if wall > 0 else math.nan,
        ramp_s=sum(u["ramp_s"] for u in loads),
        steady_s=steady,
        drain_s=sum(u["drain_s"] for u in loads),
    )
    return out


def _acceptance(mine: list, server: list[dict], is_server: bool) -> dict:
    """Acceptance length per step and per request, their source, and the client-side tokens per read."""
    out = {
        "accept_len_per_step": math.nan,
        "accept_len_per_request": math.nan,
        "accept_source": "",
        "tokens_per_read": math.nan,
    }
    if not mine:
        return out
    if not is_server:  # dtbench's own Steps: per step = T / iterations pooled; per request = mean of each request's
        tokens = sum(s.new_tokens for s in mine)
        steps = sum(s.iterations for s in mine)
        if any(s.drafted for s in mine):
            out.update(
                accept_len_per_step=tokens / steps if steps else math.nan,
                accept_len_per_request=sum(s.new_tokens / s.iterations for s in mine) / len(mine),
                accept_source="dtbench Steps (tokens / iterations)",
            )
        return out
    reads = [n for st in server for n in (st.get("tokens_per_read") or [])]
    out["tokens_per_read"] = sum(reads) / len(reads) if reads else math.nan
    acc = [st.get("acceptance") or {} for st in server]
    steps = [a for a in acc if a.get("steps")]
    if steps:
        tokens = sum(s.new_tokens for s, a in zip(mine, acc) if a.get("steps"))
        out.update(
            accept_len_per_step=tokens / sum(a["steps"] for a in steps),
            accept_len_per_request=sum(a["acceptance_length"] for a in steps) / len(steps),
            accept_source=steps[0]["source"] + (f" ({steps[0]['steps_rule']})" if steps[0].get("steps_rule") else ""),
        )
        return out
    seen, drafts, accepted = set(), 0.0, 0.0  # vLLM: /metrics deltas per prompt group (each counted once)
    for s, st in zip(mine, server):
        g = st.get("group_metrics") or {}
        key = (s.batch_group if s.batch_group is not None else s.prompt_index, s.repeat or 0)
        if g.get("drafts") and key not in seen:
            seen.add(key)
            drafts += g["drafts"]
            accepted += g.get("accepted", 0.0)
    if drafts:
        out.update(
            accept_len_per_step=1 + accepted / drafts,
            accept_source="vLLM /metrics spec_decode counters (1 + accepted / drafts; per request: not reported)",
        )
    return out


def _ms(v) -> str:
    return MISSING if is_missing(v) else f"{v * 1e3:.1f}"


def _failed(r) -> str:
    """``failed/sent (rate)`` of a server cell's requests after warmup; MISSING for dtbench's own decoders."""
    if is_missing(r.get("requests")):
        return MISSING
    return f"{int(r['failed'])}/{int(r['requests'])} ({show(r['failure_rate'], '.0%')})"


def display(frame: pd.DataFrame) -> pd.DataFrame:
    """The table's display strings."""
    out = []
    for _, r in frame.iterrows():
        ci = f"[{r['ci_low']:.2f}, {r['ci_high']:.2f}]" if not math.isnan(r["ci_low"]) else (r["ci_method"] or MISSING)
        out.append(
            {
                "Load": str(int(r["batch_size"])),
                "Decoder": r["label"],
                "Ref": r["reference"] if isinstance(r["reference"], str) else MISSING,
                "n": str(int(r["n"])),
                "Kind": r["load_kind"],
                "t/s": show(r["throughput"], ".1f"),
                "Cell t/s": show(r["cell_throughput"], ".1f"),
                "Steady t/s": show(r["steady_throughput"], ".1f"),
                "In flight": show(r["mean_in_flight"], ".1f"),
                "Ramp/steady/drain s": MISSING
                if math.isnan(r["steady_s"])
                else f"{r['ramp_s']:.2f}/{r['steady_s']:.2f}/{r['drain_s']:.2f}",
                "Speedup": show(r["speedup"], ".2f"),
                "CI": ci,
                "Failed": _failed(r),
                "TTFT p50/p99": f"{_ms(r['ttft_p50_s'])}/{_ms(r['ttft_p99_s'])}",
                "ITL p50/p99": f"{_ms(r['itl_p50_s'])}/{_ms(r['itl_p99_s'])}",
                "TPOT p50/p90/p99": f"{_ms(r['tpot_p50_s'])}/{_ms(r['tpot_p90_s'])}/{_ms(r['tpot_p99_s'])}",
                "E2E p50/p99": f"{_ms(r['e2e_p50_s'])}/{_ms(r['e2e_p99_s'])}",
                "Acc/step": show(r["accept_len_per_step"], ".2f"),
                "Acc/req": show(r["accept_len_per_request"], ".2f"),
                "Tok/read": show(r["tokens_per_read"], ".2f"),
                "Lossless": f"{r['lossless']}" + (f" ({int(r['ties'])} ties)" if r["ties"] else ""),
            }
        )
    return pd.DataFrame(out)


def engine_report(sessions, run_id: int | None, fmt: str, confidence: float = 0.95) -> None:
    """Print the run's load table (one per dataset/L_max/T) in ``fmt``, with the sources and rules as notes.

    Raises:
        DtbenchError: unknown run, or a run without samples.
    """
    from dtbench.harness.errors import DtbenchError
    from dtbench.reports.rendering.output import Document, Report, emit
    from dtbench.reports.views.summary import get_run

    with sessions() as session:
        run = get_run(session, run_id)
        frame = engine_frame(session, run.id, confidence)
    if frame.empty:
        raise DtbenchError(f"run {run.id} has no samples")
    reports = []
    for i, (_, part) in enumerate(frame.groupby(GROUP[:3], sort=False)):
        part = part.sort_values(["batch_size"], kind="stable")
        notes = sorted(
            {f"acceptance of {r['label']}: {r['accept_source']}" for _, r in part.iterrows() if r["accept_source"]}
        )
        notes += sorted(
            {
                f"lossless rule of {r['label']}: {r['lossless_rule']}"
                for _, r in part.iterrows()
                if r["lossless_rule"] and r["lossless_rule"] != OWN_RULE  # the rule its server's samples recorded
            }
        )
        reports.append(
            Report(
                f"engine_{i}",
                f"Load · run {run.id} · {CellKey.of_row(part.iloc[0]).point.title()}",
                CAPTION,
                display(part),
                part,
                notes=notes,
            )
        )
    emit(
        fmt,
        Document(
            reports,
            meta={"run": run.id, "confidence": confidence},
            rows="rows",
            data=frame,
            title=f"Load · run {run.id}",
        ),
    )
