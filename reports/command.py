"""``dtbench report``: the command's logic (its options and help are declared once, in ``cli/report.py``, and arrive here as keywords).

Modes, combinable where it makes sense: the per-cell report (default), ``--compare`` within a run (speedup CIs),
``--compare BEFORE AFTER`` between runs (marks, gate), ``--tables`` / ``--out`` (paper Tables 1-5),
``--figures`` (paper Figures 3-8), ``--html`` (everything in one file). Tables and data go to stdout; notes,
written-file lists and gate verdicts to stderr.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import click

from dtbench.harness.errors import DtbenchError
from dtbench.harness.safetext import printable
from dtbench.harness.suites.bounds import valid_id
from dtbench.reports.own import OWN_REPORTS, OwnRequest
from dtbench.reports.pricing import explain
from dtbench.reports.rendering.output import Document, Note, Report, emit, rendered


def _note(msg: str) -> None:
    click.echo(printable(msg), err=True)


def _run_token(token: str) -> int | None:
    if token == "latest":
        return None
    try:
        return int(token)
    except ValueError:
        raise DtbenchError(f"run id must be an integer or 'latest', not {token!r}") from None


@dataclass(frozen=True)
class ReportOptions:
    """``dtbench report``'s options as parsed (declared with their help in ``cli/report.py``): run ids, output
    format and the report each flag asks for; the defaults are the command line's."""

    runs: tuple[str, ...] = ()
    db_url: str | None = None
    run_ids: tuple[int, ...] = ()
    fmt: str = "table"
    compare: bool = False
    alpha: float = 0.05
    only_changed: bool = False
    fail_if: tuple[str, ...] = ()
    tables: bool = False
    out_dir: str | None = None
    fig_dir: str | None = None
    html_file: str | None = None
    include_partial: bool = False
    cost_model: bool = False
    by: str | None = None
    spec_bench: bool = False
    engine: bool = False
    profile: bool = False
    profile_json: str | None = None
    execution: bool = False
    goodput: str | None = None
    schedule: str | None = None
    predict_on: str | None = None
    export_curves: str | None = None

    @property
    def pair(self) -> bool:
        """Two run ids given: a run-to-run comparison."""
        return len(self.runs) == 2

    @property
    def files(self) -> bool:
        """Paper outputs written to files: tables to a folder, figures, the HTML report."""
        return bool(self.out_dir or self.fig_dir or self.html_file)

    @property
    def run_id(self) -> int | None:
        """The run of a one-run report: the first ``--run``, else None (the latest)."""
        return self.run_ids[0] if self.run_ids else None


def _check_modes(o: ReportOptions) -> None:
    """Refuse a combination of the comparison, paper-output and run options that makes no report.

    Raises:
        DtbenchError: the combination, or a run id no database can hold, in one line.
    """
    if o.runs and not o.compare:
        raise DtbenchError("run ids as arguments are for --compare BEFORE AFTER; use --run ID to pick a run")
    if o.runs and not o.pair:
        raise DtbenchError(f"--compare takes two run ids (BEFORE AFTER) or none, got {len(o.runs)}")
    if o.pair and (o.run_ids or o.tables or o.files):
        raise DtbenchError("--compare BEFORE AFTER cannot be combined with --run, --tables, --out, --figures or --html")
    if (o.fail_if or o.only_changed) and not o.pair:
        raise DtbenchError("--fail-if and --only-changed need a run-to-run comparison: --compare BEFORE AFTER")
    if len(o.run_ids) > 1 and (o.compare or not (o.tables or o.files)):
        raise DtbenchError("several --run combine only for --tables, --figures and --html; give one --run here")
    if o.tables and not o.out_dir and o.fmt == "csv":
        raise DtbenchError("--tables prints table, markdown, json or html; for CSV files use --out DIR")
    if o.include_partial and not (o.tables or o.files):
        raise DtbenchError(
            "--include-partial is for --tables, --out, --figures and --html (the other reports always "
            "show partial cells, marked partial)"
        )
    for rid in [*o.run_ids, *(t for t in map(_run_token, o.runs) if t is not None)]:
        if not valid_id(rid):  # an id no database can hold: no such run (SQLite would overflow on it)
            raise DtbenchError(f"no run {rid} in the database")
    if o.profile_json and not o.profile:
        raise DtbenchError("--profile-json is where --profile writes its JSON; give it with --profile")


def _check_paths(o: ReportOptions) -> None:
    """The folders ``o`` writes, tried before any work (issue 59 item 8: ``--figures /proc/x`` or a folder under a
    regular file is one line before the database is read, never an internal error after the figures are drawn).

    Raises:
        DtbenchError: a folder that cannot be created or written, in one line.
    """
    from dtbench.harness.suites.outpaths import writable_dir

    if o.fig_dir:
        writable_dir(o.fig_dir, "figures")
    if o.out_dir:
        writable_dir(o.out_dir, "tables")


def _own_report(o: ReportOptions) -> bool:
    """Produce the report of its own that ``o`` asks for (:data:`~dtbench.reports.own.OWN_REPORTS`); False when
    none is asked for.

    Raises:
        DtbenchError: one combined with another report or mode, or a bad argument (before the database opens).
    """
    from dtbench.harness.store import db

    chosen = [kind for kind in OWN_REPORTS if getattr(o, kind.option) not in (None, False)]
    if o.by and o.spec_bench:
        raise DtbenchError("--spec-bench already breaks the run down by task group; give --by or --spec-bench")
    own_files = bool(o.out_dir or o.html_file or (o.fig_dir and not o.predict_on))  # --predict-on draws its own figure
    if chosen and (len(chosen) > 1 or o.pair or o.compare or o.tables or own_files or o.by or len(o.run_ids) > 1):
        raise DtbenchError(f"{chosen[0].flag} is a report of its own; give it alone (with {chosen[0].takes})")
    if o.by and (o.pair or o.compare or o.tables or o.files or len(o.run_ids) > 1):
        raise DtbenchError("--by breaks one run's cell report down; give it alone (with --run ID and --format)")
    if not chosen:
        return False
    kind = chosen[0]
    value = getattr(o, kind.option)
    arg = kind.parse(value) if kind.parse else value  # a bad argument is one line before the database is opened
    request = OwnRequest(db.connect(o.db_url, create=False), o.run_id, o.fmt, arg)
    request.profile_json, request.confidence, request.fig_dir = o.profile_json, 1 - o.alpha, o.fig_dir
    kind.produce(request)
    return True


def report_command(**options: Any) -> None:
    """Validate the option combination, then produce each requested output.

    Args:
        options: :class:`ReportOptions`' fields by name (``run_ids`` and ``fail_if`` any sequence). ``include_partial``
            (``--include-partial``): show the numbers of partial cells (failed after some prompts) in the paper
            tables, figures and HTML, marked partial; by default they are left out with a note.

    Raises:
        DtbenchError: a bad combination of options, an unknown run, an empty run, an unwritable path.
        click.exceptions.Exit: with code 1 when a ``--fail-if`` gate trips.
        TypeError: an option that is not a field of :class:`ReportOptions`.
    """
    from dtbench.harness.store import db
    from dtbench.reports.views.compare import Gate

    sequences: dict[str, tuple] = {k: tuple(options[k]) for k in ("runs", "run_ids", "fail_if") if k in options}
    o = ReportOptions(**(options | sequences))
    _check_modes(o)
    _check_paths(o)
    gates = [Gate.parse(g) for g in o.fail_if]
    if _own_report(o):
        return
    sessions = db.connect(o.db_url, create=False)
    if o.pair:
        _compare_and_gate(sessions, o.runs, fmt=o.fmt, alpha=o.alpha, only_changed=o.only_changed, gates=gates)
        return
    if o.compare:
        speedups(sessions, o.run_id, fmt=o.fmt, alpha=o.alpha)
    if o.tables or o.files:
        paper_outputs(
            sessions,
            list(o.run_ids),
            fmt=o.fmt,
            tables=o.tables or bool(o.out_dir),
            out_dir=o.out_dir,
            fig_dir=o.fig_dir,
            html_file=o.html_file,
            alpha=o.alpha,
            include_partial=o.include_partial,
        )
    if not (o.compare or o.tables or o.files):
        cell_report(sessions, o.run_id, o.fmt, o.by)
        from dtbench.reports.pricing.tuning import (
            print_tuning_line,  # runs comparing settings of a decoder: name the best
        )

        print_tuning_line(sessions, o.run_id, _note)


def _compare_and_gate(sessions, runs, *, fmt: str, alpha: float, only_changed: bool, gates) -> None:
    """``--compare BEFORE AFTER``: the comparison (:func:`compare_pair`), then the gate's verdict on stderr.

    Raises:
        click.exceptions.Exit: with code 1 when a gate tripped.
    """
    failures = compare_pair(
        sessions, [_run_token(r) for r in runs], fmt=fmt, alpha=alpha, only_changed=only_changed, gates=gates
    )
    if failures:
        for line in failures:
            _note(f"gate tripped: {line}")
        raise click.exceptions.Exit(1)
    if gates:
        _note(f"gate passed: {', '.join(g.text for g in gates)}")


# --- every cell of a run ---------------------------------------------------------------------------------------


def cell_report(sessions, run_id: int | None, fmt: str, by: str | None = None) -> None:
    """Print every cell of a run (the default report; also what ``dtbench run`` prints at the end).

    A header line (run, suite, status, device, versions; a second line with the hardware flags where the run
    recorded ``environment["hardware"]``), then one report per (dataset, L_max, T) with notes for failed, partial
    and warmup-only cells (:func:`dtbench.reports.rendering.render.cell_document`), in any registered format; CSV and JSON
    are one row per cell, JSON with the run's whole environment, hardware flags included. ``by`` (``group``/``category``): every cell per
    task of a question dataset (:func:`dtbench.reports.views.specbench.by_task`).

    Raises:
        DtbenchError: an unknown run, or a run without cells.
    """
    from dtbench.reports.rendering import render
    from dtbench.reports.views.summary import get_run, samples_frame, served_requests, summarize, with_failed_requests

    with sessions() as session, session.no_autoflush:
        run = get_run(session, run_id)
        crashed = _settle(session, run)
        meta = {
            "id": run.id,
            "suite": run.suite_name,
            "status": "crashed" if crashed else run.status,
            "started_at": str(run.started_at),
            "finished_at": str(run.finished_at),
            "environment": run.environment or {},
        }
        frame = samples_frame(session, run.id)
        sums = explain.load_sums(session, [int(c) for c in frame["cell_id"].unique()]) if not by else {}
        served = served_requests(session, run.id) if not by else {}
    if by:
        from dtbench.reports.views.specbench import by_task

        summary = by_task(frame, by)
    else:
        summary = explain.explain(summarize(frame), sums)  # why each speculative cell is as fast as it is (issue 58)
        summary = with_failed_requests(summary, served)  # a served cell's failed requests (issue 67 item 4)
    if summary.empty:
        raise DtbenchError(f"run {meta['id']} has no cells")
    emit(fmt, render.cell_document(summary, meta))


def _settle(session, run) -> bool:
    """Show a run whose process died while it was ``running`` as ``crashed`` (issue 50:
    :func:`~dtbench.harness.store.runs.mark_crashed`, its in-flight cell failed), with a note; True when it is one.
    Reports open the database read-only, so this changes the session's objects only (the caller reads the run under
    ``no_autoflush`` and never commits); the next ``dtbench run --resume`` stores it."""
    from dtbench.harness.store.runs import mark_crashed

    note = mark_crashed(run)
    if note is None:
        return False
    _note(f"note: {note} (stored by the next `dtbench run --resume`)")
    return True


# --- within a run --------------------------------------------------------------------------------------------


def speedups(sessions, run_id: int | None, *, fmt: str, alpha: float) -> None:
    """Print every decoder's speedup vs AR with a paired t (1 - alpha) CI (``--compare`` alone); "n too small" in
    place of the CI and the verdict below :data:`~dtbench.reports.views.compare.MIN_PROMPTS` paired prompts."""
    from dtbench.reports.rendering import render
    from dtbench.reports.views.compare import SPEEDUP_CI_METHOD, speedup_table
    from dtbench.reports.views.notes import load_note
    from dtbench.reports.views.summary import get_run, samples_frame

    with sessions() as session:
        run = get_run(session, run_id)
        frame = samples_frame(session, run.id)
        rid = run.id
    if frame.empty:
        raise DtbenchError(f"run {rid} has no cells")
    table = speedup_table(frame, confidence=1 - alpha)
    if table.empty:
        raise DtbenchError(f"run {rid} has no decoder besides AR to compare")
    caption = (
        "speedup = mean throughput / mean AR throughput (same dataset, L_max, T, batch size), prompts after "
        "warmup (at B > 1: prompt groups, throughput over all rows); "
        f"per-prompt: geometric mean of the paired ratios; {SPEEDUP_CI_METHOD}"
    )
    if "repeat" in frame and (frame["repeat"].fillna(0) > 0).any():
        caption += "; with repeats each prompt's throughput is its median over them (pairs are prompts)"
    title, styles = f"run {rid}: speedup vs AR", [render.verdict_style(v) for v in table["verdict"]]
    cells = frame.drop_duplicates("cell_id")  # a busy machine under any of the cells compared (AR's included)
    busy = [Note(line, "yellow") for _, row in cells.iterrows() for line in load_note(row)]
    report = Report(
        "speedups", title, caption, render.speedup_display(table, 1 - alpha), table, notes=busy, row_styles=styles
    )
    emit(fmt, Document([report], meta={"run": rid, "confidence": 1 - alpha}, rows="cells"))


# --- between runs --------------------------------------------------------------------------------------------


def compare_pair(
    sessions, run_ids: list[int | None], *, fmt: str, alpha: float, only_changed: bool, gates
) -> list[str]:
    """Print the run-to-run comparison; return the gate failures (empty when none tripped)."""
    from dtbench.harness.measurement import load
    from dtbench.reports.rendering import render
    from dtbench.reports.views.compare import UNCHANGED_MARKS, compare_runs
    from dtbench.reports.views.summary import get_run, samples_frame

    with sessions() as session:
        before, after = (get_run(session, r) for r in run_ids)
        fb, fa = samples_frame(session, before.id), samples_frame(session, after.id)
        envb, enva = before.environment, after.environment
        ids = (before.id, after.id)
    if before.id == after.id:
        raise DtbenchError(f"--compare needs two different runs (both are run {before.id})")
    table, failures = compare_runs(fb, fa, before_env=envb, after_env=enva, alpha=alpha, gates=gates)
    counts = table["mark"].value_counts()
    _note(f"run {ids[0]} → run {ids[1]}: {len(table)} cells: " + ", ".join(f"{n} {m}" for m, n in counts.items()))
    if only_changed:
        table = table[~table["mark"].isin(UNCHANGED_MARKS)]
        if table.empty:
            _note("no changed cells")
    title = f"run {ids[0]} → run {ids[1]}"
    caption = (
        f"mean throughput after warmup (tokens/s); ratio = after / before; p: two-sided Mann-Whitney U on "
        f"per-prompt throughputs, better/worse when p < {alpha:g}"
    )
    differ = load.loads_differ(
        load.run_load(fb.drop_duplicates("cell_id").to_dict("records")),
        load.run_load(fa.drop_duplicates("cell_id").to_dict("records")),
        (f"run {ids[0]}", f"run {ids[1]}"),
    )
    report = Report(
        "compare",
        title,
        caption,
        render.compare_display(table),
        table,
        notes=[Note(differ, "yellow")] if differ else [],
        row_styles=[render.MARK_STYLES.get(m) for m in table["mark"]],
    )
    gate = {"gates": [g.text for g in gates], "failures": failures}
    emit(fmt, Document([report], meta={"before": ids[0], "after": ids[1], "alpha": alpha, "gate": gate}, rows="cells"))
    return failures


# --- paper tables, figures, HTML -----------------------------------------------------------------------------


def paper_outputs(sessions, run_ids, *, fmt, tables, out_dir, fig_dir, html_file, alpha, include_partial=False) -> None:
    """Paper tables (stdout or ``out_dir``), figures (``fig_dir``) and the HTML report (``html_file``); partial
    cells' numbers only with ``include_partial``."""
    from dtbench.reports.views.compare import speedup_table
    from dtbench.reports.views.summary import combined_summary, samples_frame

    with sessions() as session:
        summary, runs = combined_summary(session, run_ids)
        frames = {r.id: samples_frame(session, r.id) for r in runs} if html_file else {}
    every = summary  # the HTML report shows every cell, batch sizes > 1 included
    if "batch_size" in summary:  # the paper's tables and figures: its protocol, one prompt at a time (B = 1)
        summary = summary[summary["batch_size"] == 1].reset_index(drop=True)
    if "execution" in summary:  # ... and eager transformers, as the paper measured (compiled: report --execution)
        summary = summary[summary["execution"] != "compiled"].reset_index(drop=True)
    if tables:
        from dtbench.reports.views.paper import paper_tables

        made, skipped = paper_tables(summary, include_partial)
        for note in skipped:
            _note(f"note: {note}")
        if out_dir:
            write_tables(made, out_dir)
        else:  # csv of several tables is refused up front (--out writes one CSV per table)
            emit(fmt, Document(made, title="paper tables"))
    if fig_dir:
        from dtbench.reports.views.figures import write_figures

        paths, notes = write_figures(summary, fig_dir, include_partial)
        from dtbench.reports.pricing.costmodel import write_figure

        paths += write_figure(sessions, run_ids, fig_dir)  # the verify-cost curve, when a run has a calibration
        from dtbench.reports.pricing.costmodel_batch import batch_figures
        from dtbench.reports.rendering.plotting import save_figures

        batch_figs, batch_notes = batch_figures(sessions, run_ids)  # speedup vs batch size (issue 29)
        paths += save_figures(batch_figs, fig_dir)
        notes = [*notes, *batch_notes]

        for note in notes:
            _note(f"note: {note}")
        _note(f"wrote {len(paths)} figure files to {fig_dir}: " + ", ".join(sorted({p.stem for p in paths})))
    if html_file:
        from dtbench.reports.rendering.html import build_html, write_html

        cis = {rid: speedup_table(f, confidence=1 - alpha) for rid, f in frames.items() if not f.empty}
        from dtbench.reports.pricing.costmodel_batch import batch_figures

        extra, extra_notes = batch_figures(sessions, [r.id for r in runs])
        for note in extra_notes:
            _note(f"note: {note}")
        path = write_html(
            html_file,
            build_html(every, runs, cis, confidence=1 - alpha, include_partial=include_partial, extra_figures=extra),
        )
        _note(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


def write_tables(made, out_dir: str | Path) -> None:
    """Each table as ``<key>.md`` (display) and ``<key>.csv`` (numbers), plus ``tables.md`` with all of them: the
    ``markdown`` and ``csv`` renderers' text, as ``--format`` prints it."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for t in made:  # the markdown and csv renderers (built-ins, never taken over) return text
            (out / f"{t.key}.md").write_text(cast(str, rendered("markdown", [t])), encoding="utf-8")
            (out / f"{t.key}.csv").write_text(cast(str, rendered("csv", [t])), encoding="utf-8")
        (out / "tables.md").write_text(cast(str, rendered("markdown", made)), encoding="utf-8")
    except OSError as exc:
        raise DtbenchError(f"cannot write tables to {out}: {exc.strerror or exc}") from None
    _note(f"wrote {len(made)} tables to {out}: " + ", ".join(f"{t.key}.md/.csv" for t in made) + ", tables.md")
