"""``dtbench report``: the command's options and help, declared once here (:mod:`dtbench.reports.command` is its
logic and takes them as keywords, as parsed); registered in ``cli/main.py``."""

from __future__ import annotations

import click

from dtbench.cli.db import DB_HELP
from dtbench.harness.suites.bounds import Checked, OpenProbability
from dtbench.reports.rendering.output import RENDERERS


class FormatChoice(click.Choice):
    """``--format``: the registered renderers (:data:`dtbench.reports.rendering.output.RENDERERS`), read when the option is
    parsed or its help shown, so a format registered with ``@renderer`` is a choice without touching the CLI."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        from dtbench.reports.rendering.output import load_format_plugins

        for problem in load_format_plugins():  # third-party formats (entry points `dtbench.formats`), each warned once
            click.echo(f"warning: {problem}", err=True)
        return tuple(RENDERERS)

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ assigns it; the registry is the one source
        pass

    def convert(self, value, param, ctx):
        """A built-in format (the default ``table``, ``json``, ...) loads that renderer only: no plugin is imported
        for a report that asked for none (a plugin importing the plugin API imports torch: seconds a report;
        issue 57). Any other name, a listing and the help load every registered format first."""
        from dtbench.reports.rendering.output import load_builtin_format

        if isinstance(value, str) and load_builtin_format(value):
            return value
        return super().convert(value, param, ctx)


class ScheduleChoice(click.Choice):
    """``--schedule``: the registered engines that state a speculation schedule
    (:func:`dtbench.decoders.engines.schedule_engines`), read when the option is parsed or its help shown."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        from dtbench.decoders.engines import schedule_engines

        return schedule_engines()

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ assigns it; the registry is the one source
        pass


@click.command(context_settings={"max_content_width": 110})
@click.argument("runs", nargs=-1, metavar="[BEFORE AFTER]")
@click.option("--db", "db_url", help=DB_HELP)
@click.option(
    "--run",
    "run_ids",
    type=int,
    multiple=True,
    help="run id (default: the latest run); repeat it to combine runs for --tables, --figures and --html",
)
@click.option(
    "--format",
    "fmt",
    type=FormatChoice(),
    default="table",
    show_default=True,
    help="table: the terminal; markdown, csv, json, html: text to stdout (html: one self-contained page); "
    "every report prints in every format",
)
@click.option(
    "--compare",
    is_flag=True,
    help="alone: speedup vs AR with a paired t CI on per-prompt ratios ('n too small' below 5 prompts after "
    "warmup); with BEFORE AFTER run ids: a run-to-run comparison",
)
@click.option(
    "--alpha",
    type=Checked(OpenProbability, "ALPHA"),
    default=0.05,
    show_default=True,
    help="significance level: Mann-Whitney U for run-to-run marks and gates; CI level 1-alpha for speedups",
)
@click.option("--only-changed", is_flag=True, help="run-to-run: hide cells marked 'not significant' or 'still failing'")
@click.option(
    "--fail-if",
    "fail_if",
    multiple=True,
    metavar="METRIC:THRESHOLD",
    help="run-to-run gate, repeatable: exit 1 if a comparable cell's METRIC changed significantly beyond "
    "THRESHOLD in the bad direction (throughput:-5%, tpot_ms:+10%, peak_mib:+2%); a newly failing "
    "cell trips it too",
)
@click.option("--tables", is_flag=True, help="the paper's Tables 1-5 (main, latency, efficiency, ablation, memory)")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    help="write the paper tables to DIR as Markdown and CSV instead of stdout (implies --tables)",
)
@click.option(
    "--figures",
    "fig_dir",
    type=click.Path(file_okay=False),
    help="write the paper's Figures 3-8 to DIR as PNG and SVG (figures without data are skipped with a note)",
)
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False),
    help="write one self-contained HTML report (tables, speedup CIs, inline figures) to FILE",
)
@click.option(
    "--cost-model",
    is_flag=True,
    help="per cell: predicted time (the calibrated cost of every forward its samples ran) vs measured, "
    "efficiency = predicted / measured, predicted best K for chain decoders; needs a calibration "
    "(dtbench calibrate SUITE, or calibrate: true in the suite)",
)
@click.option(
    "--by",
    "by",
    type=click.Choice(["group", "category"]),
    help="question datasets (spec-bench): break every cell down by task group or raw category",
)
@click.option(
    "--spec-bench",
    "spec_bench",
    is_flag=True,
    help="Spec-Bench's leaderboard layout: speedup per task group, #MAT, overall; with vLLM's acceptance "
    "rate, mean acceptance length and per-position acceptance for every method",
)
@click.option(
    "--engine",
    "engine",
    is_flag=True,
    help="the load table: every cell per load level (batch size B, or a server's requests in flight) with "
    "its speedup over its reference at that load (a server over its plain server, dtbench's decoders "
    "over ar) and a CI, p50/p90/p99 TTFT/ITL/TPOT/E2E, acceptance length per step and per request by "
    "source, tokens per read, lossless and its rule",
)
@click.option(
    "--schedule",
    "schedule",
    type=ScheduleChoice(),
    help="the speculation schedule the cost model predicts from a calibrated run with batch sizes: per chain "
    "decoder the best K per batch-size range (0 where speculation stops paying), in the engine's configuration terms "
    "(vLLM num_speculative_tokens + disable_by_batch_size, TensorRT-LLM draft_len_schedule, SGLang steps per bucket)",
)
@click.option(
    "--goodput",
    "goodput",
    metavar="SLOS",
    help="goodput against latency targets in ms, vLLM's names: e.g. ttft:200,tpot:50,e2el:5000; per cell the "
    "share of requests (and of output tokens) after warmup meeting every target, with a Wilson CI, and good "
    "requests per second",
)
@click.option(
    "--execution",
    "execution",
    is_flag=True,
    help="compiled beside eager (suite key execution): per decoder that ran both ways, each throughput, "
    "compiled/eager paired per prompt with a CI, the compile time, each roofline fraction and both lossless verdicts",
)
@click.option(
    "--profile",
    "profile",
    is_flag=True,
    help="acceptance profile of every drafting cell: per-position conditional and cumulative acceptance with "
    "bootstrap CIs, the accepted-length histogram, mean acceptance length per step and per request (with and "
    "without the bonus token); writes the profile JSON in NVIDIA specdec_bench's schema only when "
    "--profile-json names a file; exits 2 when the profile disagrees with the samples' counters",
)
@click.option(
    "--profile-json",
    "profile_json",
    type=click.Path(dir_okay=False),
    help="--profile: write the specdec_bench profile JSON to this file (nothing is written without it)",
)
@click.option(
    "--predict-on",
    "predict_on",
    type=click.Path(dir_okay=False),
    metavar="CURVES",
    help="price the run's acceptance traces on another device: each sample's forwards on the curves file's "
    "calibrated costs plus that device's loop overhead per iteration; predicted throughput and speedup per cell "
    "beside the measured ones (--figures DIR draws both); model shapes must match",
)
@click.option(
    "--export-curves",
    "export_curves",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="write the run's calibration and its measured loop overhead per iteration as a portable curves file "
    "(JSON, for --predict-on elsewhere)",
)
@click.option(
    "--include-partial",
    is_flag=True,
    help="--tables/--out/--figures/--html: show the numbers of partial cells (failed after some prompts), "
    "marked partial; by default they are left out with a note",
)
def report(**options) -> None:
    """Report a run from the results database (tables and data to stdout, notes to stderr).

    \b
    dtbench report [--run ID]                   every cell: throughput (mean ± std after warmup), speedup vs AR,
                                                TTFT, TPOT, acceptance, L, path length, #Iter, peak memory, lossless
    dtbench report --compare [--run ID]         each decoder vs the AR cell of the same dataset, L_max and T:
                                                speedup (ratio of mean throughputs) with a 1-alpha CI from a paired
                                                t-interval on per-prompt ratios; 'n too small' below 5 prompts
    dtbench report --compare BEFORE AFTER       cells matched by dataset, L_max, T and label: before, after, ratio
                                                and a mark (better / worse / not significant by Mann-Whitney U on
                                                per-prompt throughputs; not comparable; newly failing; new; missing)
      [--only-changed] [--fail-if METRIC:THRESHOLD ...]   gate: exit code 1 when tripped
    dtbench report --tables [--out DIR]         the paper's Tables 1-5
    dtbench report --figures DIR                the paper's Figures 3-8 (PNG + SVG)
    dtbench report --html FILE                  tables, CIs and figures in one HTML file
    dtbench report --by group|category          question datasets: every cell per task group / raw category
    dtbench report --spec-bench                 Spec-Bench's leaderboard: speedup per group, #MAT, overall, and
                                                vLLM's acceptance rate, mean acceptance length, per-position curve
    dtbench report --engine [--run ID]          load table: speedup vs the reference at each load (batch size or
                                                concurrency) with a CI, latency percentiles, acceptance by source
    dtbench report --profile [--run ID]         acceptance profile per cell (position = depth along the accepted
                                                path), CIs, histogram, per-step and per-request mean lengths, and
                                                the specdec_bench profile JSON; a failed consistency check exits 2
    dtbench report --cost-model [--run ID]      predicted (calibrated forwards) vs measured time, efficiency,
                                                predicted best K of chain decoders (--figures DIR adds the
                                                verify-cost curve when the run has a calibration)
    dtbench report --export-curves FILE         the run's calibration + loop overhead as a portable curves file
    dtbench report --predict-on CURVES          the run's cells priced on another device's curves: predicted
      [--run ID] [--figures DIR]                throughput and speedup there beside the measured ones here

    \b
    BEFORE and AFTER are run ids or 'latest'. --tables, --figures and --html accept several --run to combine
    runs of different suites (one suite, e.g. suites/paper.yaml, holds the whole grid); a cell held by two runs is taken from
    the one with more cells at its dataset/L_max/T (ties: the later --run). Gate metrics: {gate_metrics};
    THRESHOLD with % is relative, without it absolute in the metric's unit; its sign is the bad direction (no sign: the
    metric's own, e.g. down for throughput, up for tpot_ms). Exit codes: 0 ok, 1 gate tripped, 2 bad input.
    """
    from dtbench.reports.command import report_command

    report_command(**options)


def _gate_metrics() -> str:
    from dtbench.harness.measurement.metrics import GATEABLE

    return ", ".join(GATEABLE)


report.help = (report.help or "").replace("{gate_metrics}", _gate_metrics())
