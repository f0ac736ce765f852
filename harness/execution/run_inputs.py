"""What the driver of a run (:func:`dtbench.harness.execution.runner.run_suite`) reads and records before the first cell:
notes on skipped decoders, the prompts of every dataset entry and L_max, the run's environment JSON, the progress
bar."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from dtbench.harness import registry
from dtbench.harness.data import chat, questions, selection
from dtbench.harness.data import datasets as data
from dtbench.harness.data.prompt import Prompt
from dtbench.harness.safetext import printable
from dtbench.harness.suites.suite import Suite


def note_skipped_and_plugins(plan, console: Console) -> None:
    """Print a note per optional decoder not installed (skipped) and the decoder registry's warnings."""
    for label in plan.skipped:
        console.print(
            f"note: optional decoder '{printable(label)}' is not installed; skipped",
            style="yellow",
            markup=False,
            highlight=False,
        )
    for line in registry.scan().warnings("decoder"):
        console.print(f"warning: {printable(line)}", style="yellow", markup=False, highlight=False)


def load_prompts(suite: Suite, tokenizer, data_dir: str | None) -> tuple[dict[tuple[str, int], list[Prompt]], list]:
    """({(dataset key, L_max): prompts}, where each dataset entry's documents came from: hub id/config/split/revision
    or local files + sha256). Question datasets give chat prompts with turns (issue 21).

    Raises:
        DtbenchError: a dataset that cannot be read or gives too few prompts.
    """
    prompts: dict[tuple[str, int], list[Prompt]] = {}
    sources = []
    for ds in suite.datasets:
        docs = data.load_documents(ds, data_dir)
        sources.append({**docs.provenance, **({"label": ds.label} if ds.label else {})})
        if data.sample_slots(ds, suite.seed, data_dir) is not None:  # questions: chat prompts, turns (issue 21)
            for l_max in ds.l_maxes:
                prompts[(ds.key, l_max)] = questions.prompts(ds, l_max, tokenizer, suite, data_dir)
            continue
        for l_max in ds.l_maxes:
            prompts[(ds.key, l_max)] = selection.select_prompts(docs, tokenizer, ds.prompts, l_max, suite.seed)
    return prompts, sources


def run_environment(
    worker_env: dict, executor: dict, quiet: dict | None, sources: list, suite: Suite, prompts: dict, tokenizer
) -> dict:
    """The run's ``environment`` JSON: the worker's, with the executor, the quiet wait, the datasets' sources,
    EOS stopping per dataset entry and the chat template where prompts are chats."""
    env = dict(worker_env)
    env["executor"] = executor
    if quiet is not None:
        env["require_quiet"] = quiet  # the 1-minute load it waited for, and the one it found
    env["datasets"] = sources
    # whether generation stopped at EOS, per dataset entry (the suite's stop_at_eos, or the dataset's default)
    env["stop_at_eos"] = {ds.key: data.stops_at_eos(suite.stop_at_eos, ds) for ds in suite.datasets}
    if any(isinstance(p, chat.ChatPrompts) for p in prompts.values()):
        env["chat"] = chat.describe(*chat.suite_template(suite, tokenizer), suite.system_prompt)
    return env


def progress_bar(console: Console, progress: bool) -> Progress:
    """The run's progress bar on ``console`` (disabled with ``progress`` False)."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not progress,
        transient=False,
    )
