"""The one output layer of the reports: where a report's text goes, in the format the user asked for.

:func:`emit` dispatches ``--format`` (``table`` draws on the stdout console; ``markdown``/``csv``/``json`` print the
text their callables return); :func:`stdout` is that console (a pipe or file gets the full width rather than rich's
80-column fallback).
"""

from __future__ import annotations

import sys

import click
from rich.console import Console

FORMATS = ("table", "markdown", "csv", "json")


def stdout() -> Console:
    """The console a ``table`` report draws on: the terminal's width, or 220 columns for a pipe or file."""
    return Console() if sys.stdout.isatty() else Console(width=220)


def emit(fmt: str, *, table, markdown, csv, json) -> None:
    """The one output-format dispatcher: ``table`` draws on the stdout console; the others return text for stdout.

    Args:
        fmt: ``table``, ``markdown``, ``csv`` or ``json``.
        table: callable(console) drawing rich output; markdown, csv, json: callables returning the text.
    """
    if fmt == "table":
        table(stdout())
    elif fmt == "markdown":
        click.echo(markdown())
    elif fmt == "csv":
        click.echo(csv(), nl=False)
    else:
        click.echo(json())
