"""``dtbench plugins``: every registry's entries and problems (issue 49 item 3), and the ``--executor`` choices.

Every kind of plugin is found by the one :class:`~dtbench.registry.Registry` in its entry-point group: decoders,
datasets, report formats, serving engines and executors. This command lists each registry's usable entries (name,
distribution and version, built-in or plugin, loaded or broken) and every problem in one line: a third-party
registration of a built-in name (refused), a name two distributions claim (ambiguous), an entry that fails to import
or loads the wrong kind of object (broken). It exits 0 whatever it finds: it is the place to look, not a gate. An
object registered by code in this process (a report format's ``@renderer``) is listed too, origin ``in-process``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import click

from dtbench.harness.errors import DtbenchError
from dtbench.harness.safetext import printable
from dtbench.registry import IN_PROCESS, Registry, ambiguous_line, refused_line


class ExecutorChoice(click.Choice):
    """``dtbench run --executor``: the names registered in the entry-point group ``dtbench.executors``, read when
    the option is parsed or its help shown."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        from dtbench.harness.execution.executors import REGISTRY

        return REGISTRY.names()

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ assigns it; the registry is the one source
        pass


def registries() -> list[Registry]:
    """Every registry dtbench reads plugins through, in the order ``dtbench plugins`` lists them."""
    from dtbench.decoders.engines import REGISTRY as ENGINES
    from dtbench.harness.data.datasets import REGISTRY as DATASETS
    from dtbench.harness.execution.executors import REGISTRY as EXECUTORS
    from dtbench.harness.registry import DECODERS
    from dtbench.reports.rendering.output import FORMAT_REGISTRY

    return [DECODERS, DATASETS, FORMAT_REGISTRY, ENGINES, EXECUTORS]


@dataclass
class Listed:
    """One registration as ``dtbench plugins`` lists it.

    Attributes:
        status: ``ok`` (loaded), ``broken`` (fails to load), ``refused`` (a built-in name) or ``ambiguous``.
        problem: the one-line problem, None when ``ok``.
    """

    group: str
    kind: str
    name: str
    distribution: str
    version: str
    builtin: bool
    status: str
    problem: str | None = None


def inventory(regs: list[Registry]) -> tuple[list[Listed], list[str]]:
    """(every registration of ``regs``, every problem as one line), loading each usable entry to check it."""
    rows: list[Listed] = []
    problems: list[str] = []
    for reg in regs:
        found = reg.scan()
        for name, entry in found.entries.items():
            row = Listed(reg.group, reg.kind, name, entry.distribution, entry.version, entry.builtin, "ok")
            try:
                reg.load(entry)
            except DtbenchError as exc:
                row.status, row.problem = "broken", str(exc)
                problems.append(row.problem)
            rows.append(row)
        for entry in found.refused:
            line = refused_line(reg.kind, entry)
            rows.append(
                Listed(reg.group, reg.kind, entry.name, entry.distribution, entry.version, False, "refused", line)
            )
            problems.append(line)
        for name, entries in found.ambiguous.items():
            line = ambiguous_line(reg.kind, name, entries)
            rows += [
                Listed(reg.group, reg.kind, name, e.distribution, e.version, False, "ambiguous", line) for e in entries
            ]
            problems.append(line)
    return rows, problems


def origin(row: Listed) -> str:
    """``built-in``, ``in-process`` (registered by code in this process: :meth:`Registry.register`, issue 58 item 6)
    or ``plugin`` (an installed distribution's entry point)."""
    if row.builtin:
        return "built-in"
    return "in-process" if row.distribution == IN_PROCESS else "plugin"


def _text(rows: list[Listed], problems: list[str]) -> None:
    """The listing as aligned columns, then one line per problem (user strings made printable)."""
    header = ("group", "name", "distribution", "origin", "status")
    cells = [header] + [(r.group, r.name, f"{r.distribution} {r.version}", origin(r), r.status) for r in rows]
    table = [[printable(c) for c in row] for row in cells]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    click.echo(f"\nproblems: {len(problems)}" if problems else "\nproblems: none")
    for line in problems:
        click.echo(f"  {printable(line)}")


@click.command("plugins")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="table: aligned columns and one line per problem; json: {registries: [...], problems: [...]}",
)
def plugins_command(fmt: str) -> None:
    """List every registry's entries (decoders, datasets, report formats, serving engines, executors): name,
    distribution and version, built-in or plugin, and whether it loads; then every problem in one line (a plugin
    refused for a built-in name, a name two distributions claim, a plugin that fails to import). Exits 0.
    DTBENCH_DISABLE_PLUGINS=1 lists the built-ins only."""
    regs = registries()
    rows, problems = inventory(regs)
    if fmt == "json":
        body = {
            "registries": [
                {
                    "group": reg.group,
                    "kind": reg.kind,
                    "entries": [
                        {k: v for k, v in asdict(r).items() if k not in ("group", "kind")}
                        for r in rows
                        if r.group == reg.group
                    ],
                }
                for reg in regs
            ],
            "problems": problems,
        }
        click.echo(json.dumps(body, indent=2))
        return
    _text(rows, problems)
