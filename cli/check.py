"""``dtbench check``: the conformance kit (:mod:`dtbench.testing`, issue 56) on registered decoders, third-party ones
from their entry points exactly as built-ins.

Prints a table of decoder x check (passed, FAILED, n/a, reported), then for each failure its one-line verdict and the
first counterexample the search found (shrunk by hypothesis). Exit 0 when nothing failed, 1 on a failure, 2 on bad
input (an unknown decoder, check or device).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click
from rich.console import Console
from rich.table import Table

from dtbench.harness.errors import DtbenchError
from dtbench.harness.safetext import printable

STYLE = {"passed": "green", "failed": "bold red", "error": "bold red", "n/a": "dim", "reported": "yellow"}
CHECK_NAMES = (
    "state",
    "greedy_equals_reference",
    "batch_rows",
    "step_accounting",
    "host_reads",
    "compiled_equals_eager",
    "sampling",
)


def _decoders(names: tuple[str, ...], all_: bool) -> list[str]:
    from dtbench.harness import registry

    if all_ and names:
        raise DtbenchError("give decoder names or --all, not both")
    if not all_ and not names:
        raise DtbenchError("name the decoders to check (dtbench check NAME ...) or pass --all")
    if all_:
        return sorted(registry.discover())
    for name in names:
        registry.get(name)  # an unknown name: the registry's one-line error, before any check runs
    return list(names)


@click.command("check")
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="every registered decoder: built-ins and every plugin's")
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="auto (the CPU, and CUDA when a GPU is visible), cpu (float64, token for token), cuda (float32 token for "
    "token and float16 tie-aware), or a comma list of cpu, cpu-bfloat16, cuda, cuda-float16",
)
@click.option(
    "--examples",
    type=click.IntRange(1, 100_000),
    help="hypothesis examples per check (default: each check's own, 3-20; $DTBENCH_HYPOTHESIS_EXAMPLES caps it)",
)
@click.option("--check", "checks", multiple=True, type=click.Choice(CHECK_NAMES), help="run only these checks")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def check_command(names, all_, device, examples, checks, fmt) -> None:
    """Check decoders against dtbench's conformance kit: greedy output equals the reference (hypothesis over prompts,
    T, params, model pairs; tie-aware at fp16/bf16), batch rows, compiled equals eager, sampling's distribution, Step
    accounting, host reads per iteration, no state leaking across prompts. Which checks apply follows from what each
    decoder declares; its params from its check_settings.

    \b
    Examples:
      dtbench check prompt_lookup            # a plugin's decoder, from its entry point
      dtbench check --all                    # every registered decoder
      dtbench check linear --check greedy_equals_reference --examples 200

    \b
    Exit codes: 0 nothing failed, 1 a check failed, 2 bad input.
    """
    from dtbench import testing
    from dtbench.harness.conformance import precisions

    decoders = _decoders(tuple(names), all_)
    precisions(device)  # bad --device: one line, before anything runs
    err = Console(stderr=True)
    reports = []
    for name in decoders:

        def progress(o, name=name):
            err.print(
                f"  {printable(name)} {o.check} [{STYLE[o.status]}]{o.status}[/] {o.seconds:.1f} s", highlight=False
            )

        reports.append(
            testing.check_decoder(name, device=device, examples=examples, checks=checks or None, progress=progress)
        )
    if fmt == "json":
        doc = [{"decoder": r.decoder, "ok": r.ok, "outcomes": [asdict(o) for o in r.outcomes]} for r in reports]
        click.echo(json.dumps(doc, indent=1, default=str))
    else:
        _print(reports)
    sys.exit(0 if all(r.ok for r in reports) else 1)


def _print(reports) -> None:
    from dtbench.reports import output

    console = output.stdout()
    columns = list(
        dict.fromkeys(
            f"{o.check}" + ("" if o.precision == "cpu" else f" {o.precision}") for r in reports for o in r.outcomes
        )
    )
    table = Table(title="dtbench check: decoder x check")
    table.add_column("decoder")
    for col in columns:
        table.add_column(col.replace("_", " "))
    for r in reports:
        cells = {o.check + ("" if o.precision == "cpu" else f" {o.precision}"): o for o in r.outcomes}
        table.add_row(printable(r.decoder), *(_cell(cells.get(c)) for c in columns))
    console.print(table)
    failed = [o for r in reports for o in r.outcomes if o.status in ("failed", "error")]
    for o in failed:
        console.print(f"[bold red]FAILED[/] {printable(o.verdict)}", highlight=False)
        if o.counterexample:
            console.print(f"  counterexample: {printable(json.dumps(o.counterexample, default=str))}", highlight=False)
    n = sum(len(r.outcomes) for r in reports)
    passed = sum(o.status in ("passed", "reported") for r in reports for o in r.outcomes)
    na = sum(o.status == "n/a" for r in reports for o in r.outcomes)
    console.print(f"{len(reports)} decoder(s), {n} checks: {passed} passed, {len(failed)} failed, {na} not applicable")


def _cell(o) -> str:
    if o is None:
        return ""
    return f"[{STYLE[o.status]}]{'FAILED' if o.status == 'failed' else o.status}[/]"
