"""``dtbench report --profile``: the acceptance profiles (:mod:`dtbench.reports.views.profile`) of a run's cells read from
the database, checked against the samples' own counters, as tables and as specdec_bench-schema JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtbench.harness.errors import DtbenchError
from dtbench.harness.measurement.metrics import PATH_LENGTH
from dtbench.reports.stats import LOSSY, MIN_PROMPTS
from dtbench.reports.views.profile import (
    BOOTSTRAP_RESAMPLES,
    SCHEMA_VERSION,
    SPECDEC_BENCH_SOURCE,
    Profile,
    Request,
    build_profile,
    specdec_json,
)

# --- the report ----------------------------------------------------------------------------------------------


def run_profiles(session, run_id: int, confidence: float = 0.95) -> tuple[list[Profile], list[str]]:
    """Every cell's profile in a run (cells in id order) and the labels of cells without drafting steps, over the
    samples the cell table uses: after warmup, remainder groups (fewer than B prompts) left out.

    Raises:
        DtbenchError: the run has no samples after warmup.
    """
    from dtbench.reports import loading

    # one request per prompt: its repeats (suite key repeats) decode the same tokens with the same seed, so a repeat
    # would count the same acceptance twice and narrow the intervals
    rows = loading.cell_rows(session, run_id, by_prompt=True, first_repeat=True)
    cells: dict[int, tuple[Any, list[Request]]] = {}
    from dtbench.reports.stats import is_remainder

    for cell, sample in rows:  # after warmup, remainder groups left out as in the cell table (issue 42 item 7)
        if sample.warmup or is_remainder(sample.batch_rows, cell.batch_size, sample.warmup):
            continue
        stats = sample.step_stats or {}
        request = Request(
            [int(a) for a in stats.get("accepted") or []],
            [int(d) for d in stats.get("depth") or []],
            sample.accepted,
            getattr(sample, str(PATH_LENGTH.column)),
        )
        cells.setdefault(cell.id, (cell, []))[1].append(request)
    if not cells:
        raise DtbenchError(f"run {run_id} has no samples after warmup to profile")
    profiles, none = [], []
    for cell, requests in cells.values():
        ident = {
            "label": cell.label,
            "decoder": cell.decoder,
            "family": cell.family,
            "dataset": cell.dataset,
            "l_max": cell.l_max,
            "gen_length": cell.gen_length,
            "batch_size": cell.batch_size or 1,
            "sampling": cell.sampling,
            "target_model": cell.target_model,
            "draft_model": cell.draft_model,
            # a sampled cell of a decoder lossy with its params (medusa's typical acceptance): labelled in the JSON
            "lossy_by_design": bool(cell.sampling) and not cell.lossless_expected,
        }
        profile = build_profile(requests, ident, confidence)
        if profile is None:
            none.append(cell.label)
        else:
            profiles.append(profile)
    return profiles, none


def _pct(x: float | None) -> str:
    from dtbench.harness.measurement.metrics import MISSING

    return MISSING if x is None else f"{x * 100:.1f}%"


def _ci(lo: float | None, hi: float | None) -> str:
    from dtbench.harness.measurement.metrics import MISSING

    return MISSING if lo is None or hi is None else f"[{lo * 100:.1f}, {hi * 100:.1f}]"


def profile_reports(profiles: list[Profile], run_id: int) -> list:
    """The profile as reports (:class:`dtbench.reports.rendering.output.Report`): per cell, its positions table (data: one
    row per position with the cell's means and histogram count at length position + 1)."""
    import pandas as pd

    from dtbench.reports.rendering.output import Report

    out = []
    for i, p in enumerate(profiles):
        c = p.cell
        rows = []
        for pos in p.positions:
            rows.append(
                {
                    "label": c["label"],
                    "dataset": c["dataset"],
                    "l_max": c["l_max"],
                    "gen_length": c["gen_length"],
                    "batch_size": c["batch_size"],
                    "position": pos["position"],
                    "at_risk": pos["at_risk"],
                    "conditional": pos["conditional"],
                    "conditional_lo": pos["conditional_lo"],
                    "conditional_hi": pos["conditional_hi"],
                    "reached": pos["reached"],
                    "cumulative": pos["cumulative"],
                    "cumulative_lo": pos["cumulative_lo"],
                    "cumulative_hi": pos["cumulative_hi"],
                    "steps_with_length": p.histogram.get(pos["position"] + 1, 0),
                    **{f"mean_length_{k}": v for k, v in p.means.items()},
                    "requests": p.requests,
                    "drafting_steps": p.steps,
                }
            )
        data = pd.DataFrame(rows)
        level = f"{p.confidence * 100:g}%"
        display = pd.DataFrame(
            {
                "pos": [str(r["position"]) for r in rows],
                "at risk": [str(r["at_risk"]) for r in rows],
                "conditional": [_pct(r["conditional"]) for r in rows],
                f"{level} CI": [_ci(r["conditional_lo"], r["conditional_hi"]) for r in rows],
                "cumulative": [_pct(r["cumulative"]) for r in rows],
                f"{level} CI ": [_ci(r["cumulative_lo"], r["cumulative_hi"]) for r in rows],
                "steps accepting pos": [str(r["steps_with_length"]) for r in rows],
            }
        )
        m = p.means
        sampling = c.get("sampling")
        title = (
            f"acceptance profile · run {run_id} · {c['label']} ({c['decoder']}, {c.get('family') or 'external'}) · "
            f"{c['dataset']} · L_max={c['l_max']} · T={c['gen_length']} · B={c['batch_size']}"
            + (f" · sampling {json.dumps(sampling, sort_keys=True)}" if sampling else "")
            + (f" · {LOSSY}" if c.get("lossy_by_design") else "")
        )
        caption = (
            f"{p.requests} requests after warmup, {p.steps} drafting steps; position = depth along the accepted "
            "path; conditional = P(draft j accepted | 1..j-1 accepted, j drafted), over the steps at risk; "
            "cumulative = P(accepted path reached j) over all drafting steps; "
            f"{level} percentile bootstrap CIs over requests ({BOOTSTRAP_RESAMPLES} resamples"
            + ("" if p.requests >= MIN_PROMPTS else f"; none: n too small, < {MIN_PROMPTS} requests")
            + "); steps accepting pos = accepted-length histogram (exactly pos drafts accepted)"
        )
        notes = [
            f"mean acceptance length per step: {m['per_step_incl_bonus']:.3f} incl. bonus token, "
            f"{m['per_step_excl_bonus']:.3f} excl. bonus",
            f"mean acceptance length per request: {m['per_request_incl_bonus']:.3f} incl. bonus token, "
            f"{m['per_request_excl_bonus']:.3f} excl. bonus",
            "accepted-length histogram (steps by length incl. bonus): "
            + ", ".join(f"{k}: {n}" for k, n in p.histogram.items()),
        ]
        notes += [
            f"check {ch['name']}: {'passed' if ch['passed'] else 'FAILED'} (|{ch['profile']} - {ch['counters']}| = "
            f"{ch['abs_delta']}, tolerance {ch['tolerance']})"
            for ch in p.checks
        ]
        out.append(Report(f"profile_{i}", title, caption, display, data, notes=notes))
    return out


def profile_report(sessions, run_id: int | None, fmt: str, json_path: str | None, confidence: float) -> None:
    """``dtbench report --profile``: print every cell's profile in ``fmt`` and, only when ``json_path`` is given
    (``--profile-json FILE``), write the specdec_bench JSON (one object: ``run``, ``source``, ``profiles``) there.

    Nothing is written unless asked (issue 42 item 11): a default file name in the current folder would overwrite
    another database's run of the same id, and ``--format json`` already prints the profile on stdout.

    Raises:
        DtbenchError: an unknown run, a run without drafting cells, an unwritable path, or a failed consistency
            check (after printing and writing the profile, so the disagreement stays inspectable).
    """
    import click

    from dtbench.harness.safetext import printable
    from dtbench.reports.rendering.output import Document, emit
    from dtbench.reports.views.summary import get_run

    with sessions() as session:
        run = get_run(session, run_id)
        rid = run.id
        profiles, none = run_profiles(session, rid, confidence)
    if not profiles:
        raise DtbenchError(f"run {rid} has no cell that drafted (only {', '.join(none)}): no acceptance profile")
    doc = Document(profile_reports(profiles, rid), meta={"run": rid, "confidence": confidence}, rows="positions")
    emit(fmt, doc)
    if none:
        click.echo(printable(f"note: no drafting steps, no profile: {', '.join(none)}"), err=True)
    if json_path is not None:
        path = Path(json_path)
        payload = {"run": rid, "source": SPECDEC_BENCH_SOURCE, "profiles": [specdec_json(p) for p in profiles]}
        try:
            path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise DtbenchError(f"cannot write the profile JSON to {path}: {exc.strerror or exc}") from None
        click.echo(
            printable(f"wrote {path} ({len(profiles)} profiles, specdec_bench schema {SCHEMA_VERSION})"), err=True
        )
    failed = [(p.cell["label"], ch) for p in profiles for ch in p.checks if not ch["passed"]]
    if failed:
        label, ch = failed[0]
        raise DtbenchError(
            f"acceptance profile of {label} disagrees with its samples' counters: {ch['name']} "
            f"{ch['profile']} vs {ch['counters']} (|delta| {ch['abs_delta']} > {ch['tolerance']})"
            + (f"; {len(failed) - 1} more failed checks" if len(failed) > 1 else "")
        )
