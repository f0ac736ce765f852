"""The ``dtbench`` command line: run suites, report results, validate suites, list decoders.

Progress and logs go to stderr, tables and data to stdout (``dtbench report --format csv > out.csv`` works).
Every user error is one line on stderr and exit code 2; an interrupted run exits with 130.
"""

from __future__ import annotations

import os
import sys
import traceback

import click
from rich.console import Console
from rich.table import Table

from dtbench.harness.errors import DtbenchError

DB_HELP = "SQLAlchemy URL or SQLite file of the results database [env DTBENCH_DB; default sqlite:///results.db]"


class _Group(click.Group):
    """Turns DtbenchError into a one-line error and exit 2; unexpected errors likewise unless DTBENCH_DEBUG is set."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DtbenchError as exc:
            from dtbench.harness.runner import RunInterrupted

            click.echo(f"error: {exc}" if not isinstance(exc, RunInterrupted) else f"{exc}", err=True)
            ctx.exit(130 if isinstance(exc, RunInterrupted) else 2)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except Exception as exc:  # never a traceback for users; DTBENCH_DEBUG=1 shows it
            if os.environ.get("DTBENCH_DEBUG"):
                traceback.print_exc()
            click.echo(f"internal error: {type(exc).__name__}: {exc} (set DTBENCH_DEBUG=1 for the traceback)", err=True)
            ctx.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dtbench")
def cli() -> None:
    """dtbench: a declarative benchmark harness for speculative decoding.

    A YAML suite declares models, datasets, prompt caps, generation lengths and decoders; `dtbench run`
    measures every decoder on every prompt (throughput, TTFT, TPOT, acceptance, peak memory, losslessness vs
    greedy AR) into a SQL database, and `dtbench report` renders tables from it.

    \b
    Quick start:
      dtbench run suites/quickstart.yaml --data-dir ../shared/data
      dtbench report
    """


@cli.command()
@click.argument("suite_path", type=click.Path(dir_okay=False))
@click.option("--db", "db_url", help=DB_HELP)
@click.option("--data-dir", type=click.Path(file_okay=False), envvar="DTBENCH_DATA_DIR",
              help="local dataset folder (holding wikitext-2-raw/, pg19-test/) instead of the hub [env DTBENCH_DATA_DIR]")
@click.option("--resume", "resume", type=int, default=None, is_flag=False, flag_value=-1,
              help="continue an interrupted run of this suite (the latest one, or the run id given), skipping stored samples")
@click.option("--no-progress", is_flag=True, help="no progress bar")
@click.option("--no-report", is_flag=True, help="do not print the report at the end")
def run(suite_path, db_url, data_dir, resume, no_progress, no_report) -> None:
    """Run SUITE_PATH and store every sample; print the report when done.

    Each sample is committed as soon as it is measured: Ctrl-C keeps everything measured so far
    (the run is marked interrupted; continue it with --resume).
    """
    from sqlalchemy import select

    from dtbench.harness import db
    from dtbench.harness.runner import run_suite
    from dtbench.harness.suite import load_suite, suite_hash

    suite, text = load_suite(suite_path)
    sessions = db.connect(db_url)
    if resume == -1:
        with sessions() as s:
            resume = s.scalar(
                select(db.Run.id).where(db.Run.suite_hash == suite_hash(text), db.Run.status != "completed")
                .order_by(db.Run.id.desc()).limit(1)
            )
        if resume is None:
            raise DtbenchError(f"no unfinished run of {suite_path} to resume")
    console = Console(stderr=True)
    run_id = run_suite(suite, text, sessions, suite_path=suite_path, data_dir=data_dir, resume=resume,
                       console=console, progress=not no_progress)
    console.print(f"run {run_id} stored in {db.resolve_url(db_url)}")
    if not no_report:
        _report(sessions, run_id, "table")


@cli.command()
@click.option("--db", "db_url", help=DB_HELP)
@click.option("--run", "run_id", type=int, help="run id (default: the latest run)")
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "csv", "json"]), default="table",
              show_default=True, help="table for the terminal; markdown, csv, json to stdout")
def report(db_url, run_id, fmt) -> None:
    """Per dataset, prompt cap and T: every decoder's throughput (mean ± std after warmup), speedup vs AR,
    TTFT, TPOT, acceptance rate, tokens per iteration, path length, #iterations, peak memory and losslessness."""
    from dtbench.harness import db

    _report(db.connect(db_url, create=False), run_id, fmt)


def _report(sessions, run_id, fmt) -> None:
    from dtbench.reports import render
    from dtbench.reports.summary import get_run, samples_frame, summarize

    with sessions() as session:
        run = get_run(session, run_id)
        meta = {"id": run.id, "suite": run.suite_name, "status": run.status, "started_at": str(run.started_at),
                "finished_at": str(run.finished_at), "environment": run.environment}
        summary = summarize(samples_frame(session, run.id))
    if summary.empty:
        raise DtbenchError(f"run {meta['id']} has no cells")
    if fmt == "table":
        # A pipe or file gets the full width rather than rich's 80-column fallback.
        out = Console() if sys.stdout.isatty() else Console(width=200)
        env = meta["environment"]
        out.print(f"[bold]run {meta['id']}[/bold] · suite {meta['suite']} · {meta['status']} · {env.get('device_name')} · "
                  f"torch {env.get('torch')} · transformers {env.get('transformers')}")
        render.print_tables(summary, out)
    elif fmt == "markdown":
        click.echo(render.markdown(summary))
    elif fmt == "csv":
        click.echo(render.csv(summary), nl=False)
    else:
        click.echo(render.to_json(summary, meta))


@cli.command()
@click.argument("suite_path", type=click.Path(dir_okay=False))
def validate(suite_path) -> None:
    """Check SUITE_PATH without running it: YAML, keys, decoder names and params, datasets."""
    from dtbench.harness.runner import plan_suite
    from dtbench.harness.suite import load_suite

    suite, _ = load_suite(suite_path)
    plan = plan_suite(suite)
    groups = sum(len(ds.caps) for ds in suite.datasets) * len(suite.generation_lengths)
    cells = sum(len(plan.decoders_for(ds.name)) * len(ds.caps) for ds in suite.datasets) * len(suite.generation_lengths)
    samples = sum(len(plan.decoders_for(ds.name)) * len(ds.caps) * ds.prompts for ds in suite.datasets) * len(suite.generation_lengths)
    click.echo(f"{suite_path}: ok — suite '{suite.name}', {groups} dataset/cap/T groups, {cells} cells, {samples} samples")


@cli.command("decoders")
def list_decoders() -> None:
    """List registered decoders: name, distribution, lossless flag, draft model need and params."""
    from dtbench.harness import registry

    table = Table(title="registered decoders (entry-point group dtbench.decoders)")
    for col in ("name", "distribution", "lossless", "draft", "params"):
        table.add_column(col)
    problems = []
    for name, entry in sorted(registry.discover().items()):
        try:
            cls = entry.load()
        except DtbenchError as exc:
            problems.append(str(exc))
            table.add_row(name, f"{entry.distribution} {entry.version}", "?", "?", "[red]failed to load[/red]")
            continue
        params = ", ".join(
            f"{k}={f.default!r}" if not f.is_required() else f"{k} (required)" for k, f in cls.Params.model_fields.items()
        )
        table.add_row(name, f"{entry.distribution} {entry.version}", "yes" if cls.lossless else "no",
                      "yes" if cls.needs_draft else "no", params or "—")
    Console().print(table)
    for p in problems:
        click.echo(f"warning: {p}", err=True)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="dtbench")


if __name__ == "__main__":
    sys.exit(main())
