"""The ``dtbench`` command line: run suites, report results, validate suites, list decoders.

Progress and logs go to stderr, tables and data to stdout (``dtbench report --format csv > out.csv`` works).
Every user error is one line on stderr and exit code 2; an interrupted run exits with 130. Exit codes of
``dtbench run``: see :data:`RUN_EXIT_CODES`.
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback

import click
from rich.console import Console
from rich.table import Table

from dtbench.cli.db import DB_HELP, db_group
from dtbench.cli.plugins import ExecutorChoice, plugins_command
from dtbench.cli.report import report
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.measurement.metrics import MISSING
from dtbench.harness.safetext import printable
from dtbench.harness.suites.bounds import Checked, Seconds
from dtbench.reports.rendering import output

# Exit codes of `dtbench run` (docs/measurement.md "Exit codes"); a report still prints before a non-zero exit.
EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT = 0, 1, 2
EXIT_DIVERGED, EXIT_CELL_FAILED, EXIT_DIVERGED_AND_FAILED = 3, 4, 5
EXIT_INTERRUPTED = 130
RUN_EXIT_CODES = f"""\b
Exit codes:
  {EXIT_OK}    every cell ran and every lossless decoder passed the lossless check (numeric ties pass tie_aware)
  {EXIT_INTERNAL}    internal error, or the runner itself failed (the run is stored as failed; --resume continues)
  {EXIT_BAD_INPUT}    bad input (suite, data, models, database), or a machine not quiet in time
       (--require-quiet); nothing was run
  {EXIT_DIVERGED}    a lossless decoder failed the check on some prompt (warmup included): under tie_aware an
       emitted token the target does not choose (an error, never a numeric tie), under exact any divergence
  {EXIT_CELL_FAILED}    a cell failed (a decoder raised, exited or timed out)
  {EXIT_DIVERGED_AND_FAILED}    both {EXIT_DIVERGED} and {EXIT_CELL_FAILED}
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C, SIGTERM); --resume continues
"""


class _Group(click.Group):
    """Turns DtbenchError into a one-line error and exit 2; unexpected errors likewise unless DTBENCH_DEBUG is set."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DtbenchError as exc:
            from dtbench.harness.execution.runner import RunFailed, RunInterrupted

            message = printable(clip(exc, 1000))  # a user's string in the message never restyles a terminal
            if isinstance(exc, RunInterrupted):
                click.echo(message, err=True)
                ctx.exit(EXIT_INTERRUPTED)
            click.echo(f"error: {message}", err=True)
            ctx.exit(EXIT_INTERNAL if isinstance(exc, RunFailed) else EXIT_BAD_INPUT)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except Exception as exc:  # never a traceback for users; DTBENCH_DEBUG=1 shows it
            if os.environ.get("DTBENCH_DEBUG"):
                traceback.print_exc()
            click.echo(
                f"internal error: {type(exc).__name__}: {printable(clip(exc, 500))} (set DTBENCH_DEBUG=1 for the traceback)",
                err=True,
            )
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
    from dtbench.registry import import_timeout_s

    import_timeout_s()  # a bad DTBENCH_PLUGIN_IMPORT_TIMEOUT: one line and exit 2 before anything loads (issue 67)


@cli.command()
@click.argument("suite_path", type=click.Path(dir_okay=False))
@click.option("--db", "db_url", help=DB_HELP)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    envvar="DTBENCH_DATA_DIR",
    help="local dataset folder (holding wikitext-2-raw/, pg19-test/) instead of the hub [env DTBENCH_DATA_DIR]",
)
@click.option(
    "--resume",
    "resume_latest",
    is_flag=True,
    help="continue the latest unfinished run of this suite, skipping samples already stored",
)
@click.option(
    "--resume-run",
    "resume",
    type=int,
    default=None,
    metavar="ID",
    help="continue unfinished run ID of this suite (as --resume, naming the run)",
)
@click.option(
    "--force",
    is_flag=True,
    help="resume even if the run's owner still looks alive (same host: its pid runs; another host: a "
    "heartbeat in the last 5 minutes)",
)
@click.option(
    "--skip-failed",
    is_flag=True,
    help="with --resume/--resume-run: leave the run's failed cells failed (one that crashed the run, too) instead "
    "of retrying them",
)
@click.option("--no-progress", is_flag=True, help="no progress bar")
@click.option("--no-report", is_flag=True, help="do not print the report at the end")
@click.option(
    "--executor",
    type=ExecutorChoice(),
    default="local",
    show_default=True,
    help="local: this process measures every prompt group; ray: Ray actors do (one per GPU, or --workers "
    "on CPUs), this process commits their samples (pip install 'dtbench[ray]')",
)
@click.option(
    "--address",
    default=None,
    metavar="ADDR",
    help="--executor ray: the Ray cluster to join (auto, HOST:PORT, ray://HOST:PORT) [env RAY_ADDRESS; "
    "default: start a local Ray instance for this run]",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="--executor ray: number of workers [default: one per GPU; on CPUs, the cluster's CPUs divided by "
    "--threads-per-worker]",
)
@click.option(
    "--threads-per-worker",
    type=click.IntRange(min=1),
    default=None,
    metavar="M",
    help="torch threads of each worker (ray: also the CPUs it reserves; default 1); with --executor local, "
    "this process's torch threads [default: torch's]",
)
@click.option(
    "--connect-timeout",
    type=Checked(Seconds, "SECONDS"),
    default=30.0,
    show_default=True,
    help="--executor ray: seconds to wait for the cluster at --address (or $RAY_ADDRESS) to answer",
)
@click.option(
    "--require-quiet",
    "require_quiet",
    is_flag=False,
    flag_value="auto",
    default=None,
    metavar="[=LOAD]",
    help="before anything loads, wait for the machine's 1-minute load average to drop below LOAD (default: half "
    "the CPUs), at most --quiet-timeout seconds; refuse (exit 2, nothing run) if it does not",
)
@click.option(
    "--quiet-timeout",
    type=Checked(Seconds, "SECONDS"),
    default=120.0,
    show_default=True,
    help="--require-quiet: seconds to wait for a quiet machine",
)
def run(
    suite_path,
    db_url,
    data_dir,
    resume_latest,
    resume,
    force,
    skip_failed,
    no_progress,
    no_report,
    executor,
    address,
    workers,
    threads_per_worker,
    connect_timeout,
    require_quiet,
    quiet_timeout,
) -> None:
    """Run SUITE_PATH and store every sample; print the report when done.

    Each sample is committed as soon as it is measured: Ctrl-C keeps everything measured so far
    (the run is marked interrupted; continue it with --resume, with either executor). A decoder that raises, exits
    or runs past the suite's per-sample `timeout_s` fails its cell and the run goes on.
    """
    from sqlalchemy import select

    from dtbench.harness.execution.runner import make_executor, run_suite
    from dtbench.harness.measurement import load
    from dtbench.harness.store import db, engines
    from dtbench.harness.suites.suitefile import load_suite, suite_hash

    if skip_failed and not (resume_latest or resume is not None):
        raise DtbenchError("--skip-failed needs --resume or --resume-run (a new run has no failed cells)")
    quiet_below = None if require_quiet is None else load.quiet_threshold(require_quiet)
    chosen = make_executor(
        executor,
        address=address,
        workers=workers,
        threads_per_worker=threads_per_worker,
        connect_timeout_s=connect_timeout,
    )
    suite, text = load_suite(suite_path)
    sessions = db.connect(db_url)
    if resume_latest and resume is None:
        with sessions() as s:
            resume = s.scalar(
                select(db.Run.id)
                .where(db.Run.suite_hash == suite_hash(text), db.Run.status != "completed")
                .order_by(db.Run.id.desc())
                .limit(1)
            )
        if resume is None:
            raise DtbenchError(f"no unfinished run of {suite_path} to resume")
    console = Console(stderr=True)
    if not no_report:  # the report's table renderer loads now, not after the run is stored completed (issue 59 item
        # 3); only it: a format plugin is never imported beside a measurement (issue 67 item 5)
        output.load_builtin_format("table")
    run_id = run_suite(
        suite,
        text,
        sessions,
        suite_path=suite_path,
        data_dir=data_dir,
        resume=resume,
        force=force,
        console=console,
        progress=not no_progress,
        executor=chosen,
        quiet_below=quiet_below,
        quiet_limit_s=float(quiet_timeout),
        skip_failed=skip_failed,
    )
    console.print(f"run {run_id} stored in {engines.display_url(engines.resolve_url(db_url))}", highlight=False)
    if not no_report:
        from dtbench.reports.command import cell_report

        cell_report(sessions, run_id, "table")
    code = run_exit_code(sessions, run_id)
    if code:
        console.print(
            f"exit code {code}: "
            + {
                EXIT_DIVERGED: "a lossless decoder diverged (an error, not a numeric tie)",
                EXIT_CELL_FAILED: "a cell failed",
                EXIT_DIVERGED_AND_FAILED: "a lossless decoder diverged and a cell failed",
            }[code],
            highlight=False,
        )
        for line in failed_cells(sessions, run_id):
            console.print(f"  {printable(line)}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(code)


run.help = inspect.cleandoc(run.help or "") + "\n\n" + RUN_EXIT_CODES


def failed_cells(sessions, run_id: int, limit: int = 10) -> list[str]:
    """One line per failed cell of the run (``label B=.. T=.. dataset: error``, the error's first line clipped), at
    most ``limit`` and a count of the rest: what the exit code's "a cell failed" means, on stderr beside it."""
    from sqlalchemy import select

    from dtbench.harness.store import db

    with sessions() as s:
        cells = s.scalars(
            select(db.Cell).where(db.Cell.run_id == run_id, db.Cell.status == "failed").order_by(db.Cell.id)
        ).all()
        lines = [
            f"{c.label} B={c.batch_size} T={c.gen_length} {c.dataset}: {clip(((c.error or '').strip().splitlines() or ['no error recorded'])[0], 400)}"
            for c in cells[:limit]
        ]
    if len(cells) > limit:
        lines.append(f"... and {len(cells) - limit} more failed cells (dtbench report --db ... shows them)")
    return lines


def run_exit_code(sessions, run_id: int) -> int:
    """EXIT_DIVERGED if a lossless cell has a sample whose verdict failed (``samples.lossless`` false under the suite's
    ``lossless_check``: an error for tie_aware, any divergence for exact; warmup included), EXIT_CELL_FAILED if a
    cell failed, EXIT_DIVERGED_AND_FAILED for both, else EXIT_OK."""
    from sqlalchemy import exists, select

    from dtbench.harness.store import db

    with sessions() as s:
        failed = s.scalar(select(exists().where(db.Cell.run_id == run_id, db.Cell.status == "failed")))
        diverged = s.scalar(
            select(
                exists().where(
                    db.Sample.cell_id == db.Cell.id,
                    db.Cell.run_id == run_id,
                    db.Cell.lossless_expected.is_(True),
                    db.Sample.lossless.is_(False),
                )
            )
        )
    if failed and diverged:
        return EXIT_DIVERGED_AND_FAILED
    return EXIT_CELL_FAILED if failed else EXIT_DIVERGED if diverged else EXIT_OK


@cli.command()
@click.argument("suite_path", type=click.Path(dir_okay=False))
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    envvar="DTBENCH_DATA_DIR",
    help="the local dataset folder `dtbench run` would read (question datasets are read from it to check "
    "their categories and turns) [env DTBENCH_DATA_DIR]",
)
def validate(suite_path, data_dir) -> None:
    """Check SUITE_PATH without running it: YAML, keys, decoder names and params, datasets."""
    from dtbench.harness import registry
    from dtbench.harness.suites.plan import plan_suite
    from dtbench.harness.suites.preflight import preflight
    from dtbench.harness.suites.suitefile import load_suite

    suite, _ = load_suite(suite_path)
    plan = plan_suite(suite)
    plan.data_dir = data_dir
    console = Console(stderr=True)
    for line in registry.scan().warnings("decoder"):
        console.print(f"warning: {printable(line)}", style="yellow", markup=False, highlight=False)
    preflight(suite, plan, console)
    if suite.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # a warning, not an error: the suite may be meant for a Ray cluster's GPUs
            console.print(
                "warning: the suite asks for device: cuda and this machine has no CUDA device: `dtbench run` "
                "refuses it here (it can run with --executor ray on a cluster with GPUs)",
                style="yellow",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
    _warn_small_samples(suite, console)
    points = sum(1 for ds, l_max, T, B in plan.points() if plan.decoders_at(ds.key, l_max, T, B))
    click.echo(
        f"{printable(suite_path)}: ok — suite '{suite.name}', {points} dataset/L_max/T groups, {len(plan.cells())} cells, "
        f"{plan.n_samples} samples"
    )


def _warn_small_samples(suite, console) -> None:
    """One warning line per dataset entry measuring fewer prompts per cell after warmup than a speedup interval or a
    comparison needs (issue 67: every interval of such a run reads "n too small"); the suite stays valid (exit 0)."""
    from dtbench.reports.stats import MIN_PROMPTS

    for ds in suite.datasets:
        measured = ds.prompts - ds.warmup
        if measured < MIN_PROMPTS:
            each = " per category" if ds.categories else ""
            console.print(
                f"warning: dataset {printable(ds.key)}: {ds.prompts} prompts with {ds.warmup} warmup leave {measured} "
                f"measured per cell{each}; a speedup interval or a comparison needs at least {MIN_PROMPTS} (they "
                f"will read 'n too small'): raise prompts to {ds.warmup + MIN_PROMPTS} or more",
                style="yellow",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )


@cli.command("decoders")
def list_decoders() -> None:
    """List registered decoders: name, distribution, lossless flag, draft model need and params."""
    from dtbench.harness import registry
    from dtbench.reports.rendering.output import plain

    table = Table(title="registered decoders (entry-point group dtbench.decoders)")
    for col in ("name", "distribution", "lossless", "draft", "params"):
        table.add_column(col)
    problems = []
    found = registry.scan()
    for entry in found.refused + [e for es in found.ambiguous.values() for e in es]:
        why = "refused: built-in name" if entry in found.refused else "ambiguous: name claimed twice"
        table.add_row(
            plain(entry.name), plain(f"{entry.distribution} {entry.version}"), MISSING, MISSING, f"[red]{why}[/red]"
        )
    problems.extend(found.warnings("decoder"))
    for name, entry in sorted(registry.discover().items()):
        try:
            cls = registry.DECODERS.load(entry)
        except DtbenchError as exc:
            problems.append(str(exc))
            table.add_row(
                plain(name), plain(f"{entry.distribution} {entry.version}"), "?", "?", "[red]failed to load[/red]"
            )
            continue
        params = ", ".join(
            f"{k}={f.get_default(call_default_factory=True)!r}" if not f.is_required() else f"{k} (required)"
            for k, f in cls.Params.model_fields.items()
        )  # a default_factory's value, never pydantic's PydanticUndefined (issue 67)
        # a plugin's names and defaults are text from elsewhere: escaped, never parsed as rich markup
        table.add_row(
            plain(name),
            plain(f"{entry.distribution} {entry.version}"),
            "yes" if cls.lossless else "no",
            "yes" if cls.needs_draft else "no",
            plain(params or MISSING),
        )
    output.stdout().print(table)  # the reports' console: a pipe gets the full width
    for p in problems:
        click.echo(f"warning: {printable(p)}", err=True)


cli.add_command(report)  # dtbench report (cli/report.py; its logic: reports/command.py)
cli.add_command(db_group)  # dtbench db upgrade|current (cli/db.py)
cli.add_command(plugins_command)  # dtbench plugins (cli/plugins.py)
from dtbench.cli.calibrate import calibrate_command  # noqa: E402

cli.add_command(calibrate_command)
from dtbench.cli.doctor import doctor_command  # noqa: E402

cli.add_command(doctor_command)  # dtbench doctor (make gpu-check)
from dtbench.cli.check import check_command  # noqa: E402

cli.add_command(check_command)  # dtbench check (cli/check.py; the kit: dtbench/testing/__init__.py)
from dtbench.cli.scaffold import new_decoder_command  # noqa: E402

cli.add_command(new_decoder_command)  # dtbench new-decoder (cli/scaffold.py)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="dtbench")


if __name__ == "__main__":
    main()
