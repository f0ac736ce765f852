"""``dtbench check``: the conformance kit (:mod:`dtbench.testing`, issues 56 and 65) on registered decoders, third-party
ones from their entry points exactly as built-ins, each decoder in a child process of its own under per-check
deadlines (:mod:`dtbench.testing.process`).

Prints a table of decoder x check (passed, FAILED, n/a, reported, xfail, XPASS, skipped), then for each failure its
one-line verdict, the first counterexample the search found (clipped; whole in ``--format json``) and the last lines
the decoder printed. Everything a decoder or plugin supplies (its name, messages, counterexamples, output) is printed
as plain text: never read as rich markup, control characters escaped. Exit 0 when nothing failed, 1 when a decoder
failed (a check, a hang, a crash, a load failure), 2 on bad input (an unknown decoder, check or device).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dtbench.cli.check_server import SHOWN, STYLE, run_server_check  # noqa: E402  (the verdicts' display)
from dtbench.harness.errors import DtbenchError
from dtbench.harness.safetext import printable

# The kit's checks in the order they run (dtbench.testing.check_names(); kept here so `dtbench --help` imports no
# torch; tests/test_check_process.py holds the two equal).
CHECK_NAMES = (
    "deterministic",
    "state",
    "greedy_equals_reference",
    "length",
    "eos",
    "inputs_unchanged",
    "batch_rows",
    "step_accounting",
    "host_reads",
    "compiled_equals_eager",
    "sampling",
)
# The server kit's checks (dtbench.harness.serving.kit.SERVER_CHECKS; tests/test_server_kit.py holds the two equal).
SERVER_CHECK_NAMES = (
    "deterministic",
    "greedy_equals_reference",
    "concurrency",
    "length",
    "stop",
    "streaming",
    "accounting",
)
COUNTEREXAMPLE_CHARS = 2000  # a counterexample's characters in the table format (the whole one: --format json)


def _decoders(names: tuple[str, ...], all_: bool) -> list[str]:
    from dtbench.harness import registry

    if all_ and names:
        raise DtbenchError("give decoder names or --all, not both")
    if not all_ and not names:
        raise DtbenchError("name the decoders to check (dtbench check NAME ...) or pass --all")
    if all_:
        return sorted(registry.discover())  # metadata only: a broken plugin fails in its own child, as its own row
    found = registry.DECODERS.scan()
    for name in names:
        if name not in found.entries:
            registry.get(name)  # unknown or ambiguous: the registry's one-line error, before any check runs
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
@click.option(
    "--check",
    "checks",
    multiple=True,
    type=click.Choice(list(dict.fromkeys(CHECK_NAMES + SERVER_CHECK_NAMES))),
    help="run only these checks (a served engine's: " + ", ".join(SERVER_CHECK_NAMES) + ")",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    help="seconds each check may run before it fails and the decoder's process is killed (default: 900 for "
    "compiled_equals_eager and sampling, 300 for every other check; sized for a 2-core CPU)",
)
@click.option(
    "--in-process",
    is_flag=True,
    help="run the checks in this process (debugging: no deadline, and a decoder that exits or crashes ends the "
    "command)",
)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--server", metavar="URL", help="a served engine's root URL (no /v1): check it instead of decoders")
@click.option("--reference", metavar="URL", help="the same engine without speculation: greedy_equals_reference")
@click.option("--suite", "suite_path", metavar="FILE", help="check the server entry LABEL of this suite (launch: "
              "starts and stops it and its reference)")  # fmt: skip
@click.option("--engine", default="llama.cpp", show_default=True, help="the served engine's adapter (--server)")
@click.option("--served-model", help="the requests' `model` field (vLLM and SGLang want the served model's name)")
@click.option("--api-key-env", metavar="NAME", help="the environment variable holding the server's API key")
@click.option("--tokenizer", "tokenizer_model", default="smollm2-135m", show_default=True,
              help="the served model's tokenizer (--server; a suite uses its target's): prompts and token text")  # fmt: skip
@click.option("--dataset", default="wikitext-2", show_default=True, help="text prompts from this dataset (--server)")
@click.option("--data-dir", help="the local data folder (default $DTBENCH_DATA_DIR; else the hub)")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="seconds for a served engine's whole search, shrinking included, shared by its checks")  # fmt: skip
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="seconds one request to a served engine may take (past it the check fails, the rest do not run)")  # fmt: skip
@click.option("--concurrency", type=click.IntRange(1, 256), default=4, show_default=True,
              help="requests sent together by the concurrency check")  # fmt: skip
@click.option("--max-tokens", type=click.IntRange(1, 4096), help="largest max_tokens T drawn (default 32; a suite: "
              "its largest generation length, at most 64)")  # fmt: skip
@click.option("--context-length", type=click.IntRange(16), help="the engine's context length (default: what it "
              "reports, llama.cpp /props or vLLM /v1/models): near-context prompts")  # fmt: skip
@click.option("--tie-margin", type=click.FloatRange(0, 10), help="a divergence within this top-2 margin (nats) is a "
              "numeric tie (default: the entry's tie_margin, 0.05)")  # fmt: skip
@click.option("--no-shrink", is_flag=True, help="report a served engine's first failing prompt, unshrunk")
def check_command(names, all_, device, examples, checks, timeout, in_process, fmt, server, reference, suite_path,
                  engine, served_model, api_key_env, tokenizer_model, dataset, data_dir, budget, request_timeout,
                  concurrency, max_tokens, context_length, tie_margin, no_shrink) -> None:  # fmt: skip
    """Check decoders against dtbench's conformance kit: deterministic output, no state across prompts, greedy output
    equal to the reference (hypothesis over prompts, T, params, model pairs; tie-aware at fp16/bf16), exactly T tokens,
    nothing after EOS, the caller's input_ids untouched, batch rows, Step accounting, host reads, compiled equals
    eager, sampling's distribution. Which checks apply follows from what each decoder declares; its params from its
    check_settings; a check it declares a known failure (xfail_checks) shows as xfail.

    Each decoder is checked in a child process of its own: a check past its deadline (--timeout) fails and the
    process is killed with its process group; a decoder that exits, crashes or fails to import is that decoder's
    failure (exit code or signal named, with its last output lines), and the other decoders go on. Its own printing
    is captured, never mixed into the table.

    \b
    Examples:
      dtbench check prompt_lookup            # a plugin's decoder, from its entry point
      dtbench check --all                    # every registered decoder
      dtbench check linear --check greedy_equals_reference --examples 200

    A served engine (--server URL, and --reference URL for the same engine without speculation; or --suite FILE
    LABEL, which launches both): deterministic, greedy output equal to the reference (tie-aware), a prompt among C
    concurrent requests equal to it alone, length, stop strings, streaming equal to not streaming, speculation
    counters consistent, over a hypothesis search of prompts (dataset text, random ids, repeated n-grams and words,
    near the context length) within --budget; a failure is shrunk and printed with both requests as curl commands.

    \b
    Examples:
      dtbench check --server http://127.0.0.1:8081 --reference http://127.0.0.1:8080
      dtbench check --suite suites/engine-cpu.yaml "llama.cpp ngram" --budget 300

    \b
    Exit codes: 0 nothing failed, 1 a decoder failed (a check, a hang, a crash, a load failure), 2 bad input.
    """
    if server or reference or suite_path:  # a served engine (cli/check_server.py)
        sys.exit(run_server_check(click.get_current_context().params))
    bad = [c for c in checks if c not in CHECK_NAMES]
    if bad:
        raise DtbenchError(f"--check {bad[0]} is a served engine's check (--server URL); a decoder has: "
                           + ", ".join(CHECK_NAMES))  # fmt: skip
    from dtbench import testing
    from dtbench.testing.common import precisions

    decoders = _decoders(tuple(names), all_)
    precisions(device)  # bad --device: one line, before anything runs
    if in_process:  # hypothesis' folder in a temporary one, never the current folder (a child does the same)
        import tempfile

        scratch = tempfile.TemporaryDirectory(prefix="dtbench-check-hypothesis-")
        os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", scratch.name)
    err = Console(stderr=True, highlight=False)
    reports = []
    for name in decoders:

        def progress(o, name=name):
            line = Text(f"  {printable(name)} {o.check} ")
            line.append(SHOWN.get(o.status, o.status), style=STYLE.get(o.status, ""))
            line.append(f" {o.seconds:.1f} s")
            err.print(line)

        report = testing.check_decoder(
            name,
            device=device,
            examples=examples,
            checks=checks or None,
            progress=progress,
            timeout=timeout,
            isolation="none" if in_process else "process",
        )
        if report.load_error:
            line = Text(f"  {printable(name)} ")
            line.append("failed to load", style="bold red")
            err.print(line)
        reports.append(report)
    if fmt == "json":
        doc = [
            {
                "decoder": r.decoder,
                "ok": r.ok,
                "load_error": r.load_error or None,
                "outcomes": [asdict(o) for o in r.outcomes],
            }
            for r in reports
        ]
        click.echo(json.dumps(doc, indent=1, default=str))
    else:
        _print(reports)
    sys.exit(0 if all(r.ok for r in reports) else 1)


def _column(o) -> str:
    return o.check + ("" if o.precision == "cpu" else f" {o.precision}")


def _print(reports) -> None:
    from dtbench.reports.rendering import output

    console = output.stdout()
    columns = list(dict.fromkeys(_column(o) for r in reports for o in r.outcomes))
    table = Table(title="dtbench check: decoder x check")
    table.add_column("decoder")
    for col in columns or ["load"]:
        table.add_column(col.replace("_", " "))
    for r in reports:
        if r.load_error:
            cells = [Text("failed to load", style="bold red")] + [Text("-") for _ in columns[1:]]
        else:
            by_column = {_column(o): o for o in r.outcomes}
            cells = [_cell(by_column.get(c)) for c in columns]
        table.add_row(Text(printable(r.decoder)), *cells)
    console.print(table)
    failed = 0
    for r in reports:
        if r.load_error:
            failed += 1
            _line(console, "FAILED", f"{r.decoder}: failed to load: {r.load_error}")
        for o in r.outcomes:
            if o.status in ("failed", "error", "xpass"):
                failed += 1
                _line(console, SHOWN[o.status], o.verdict)
                if o.counterexample:
                    text = json.dumps(o.counterexample, default=str)
                    if len(text) > COUNTEREXAMPLE_CHARS:
                        text = (
                            f"{text[:COUNTEREXAMPLE_CHARS]}... ({len(text):,} characters; the whole one: --format json)"
                        )
                    console.print(Text(f"  counterexample: {printable(text)}"), soft_wrap=True)  # copyable JSON
            if o.output and o.status in ("failed", "error", "xpass", "xfail"):
                console.print(Text(f"  its last output ({o.printed} line{'s' if o.printed != 1 else ''}):"))
                for line in o.output.splitlines():
                    console.print(Text(f"    {line}"), soft_wrap=True)
    for r in reports:
        for o in r.outcomes:
            if o.status == "xfail":
                _line(console, "xfail", o.verdict, style="yellow")
    n = sum(len(r.outcomes) for r in reports)
    count = lambda *s: sum(o.status in s for r in reports for o in r.outcomes)  # noqa: E731
    tail = ", ".join(
        f"{k} {w}"
        for k, w in (
            (count("xfail"), "known failures (xfail)"),
            (count("skipped"), "skipped"),
            (count("n/a"), "not applicable"),
        )
        if k
    )
    console.print(
        Text(
            f"{len(reports)} decoder(s), {n} checks: {count('passed', 'reported')} passed, {failed} failed"
            + (f", {tail}" if tail else "")
        )
    )


def _line(console, head: str, text: str, style: str = "bold red") -> None:
    line = Text(head, style=style)
    line.append(f" {printable(text)}")
    console.print(line, soft_wrap=True)


def _cell(o) -> Text:
    if o is None:
        return Text("")
    return Text(SHOWN.get(o.status, o.status), style=STYLE.get(o.status, ""))
