"""The reports of their own of ``dtbench report`` (issue 40 item 4): each one run, given alone, declared once in
:data:`OWN_REPORTS` (its option, flag, what it combines with, how it is produced)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from dtbench.harness.safetext import printable


def _note(msg: str) -> None:
    click.echo(printable(msg), err=True)


@dataclass
class OwnRequest:
    """What a report of its own is produced from: the database's session factory, the run (None: the latest), the
    output format, its option's value (parsed), ``--profile-json`` and the confidence level (1 - ``--alpha``)."""

    sessions: Any
    run_id: int | None
    fmt: str
    value: Any
    profile_json: str | None = None
    confidence: float = 0.95
    fig_dir: str | None = None


@dataclass(frozen=True)
class OwnReport:
    """A report of its own: one run, given alone (the report kinds' one table; issue 40 item 4).

    Attributes:
        option: ``report_command``'s keyword; flag: the command-line flag; takes: what it combines with (the
            error's parenthesis); produce: renders it from an :class:`OwnRequest`; parse: turns the option's value
            into the request's ``value`` before the database is opened (raising DtbenchError), or None.
    """

    option: str
    flag: str
    takes: str
    produce: Callable[[OwnRequest], None]
    parse: Callable[[Any], Any] | None = None


def _schedule(r: OwnRequest) -> None:
    from dtbench.reports.pricing.schedule import schedule_report

    schedule_report(r.sessions, r.run_id, r.fmt, r.value)


def _slos(text: str) -> Any:
    from dtbench.reports.views.goodput import parse_slos

    return parse_slos(text)


def _goodput(r: OwnRequest) -> None:
    from dtbench.reports.views.goodput import goodput_report

    goodput_report(r.sessions, r.run_id, r.fmt, r.value, r.confidence)


def _execution(r: OwnRequest) -> None:
    from dtbench.reports.views.execution import execution_report

    execution_report(r.sessions, r.run_id, r.fmt, r.confidence)


def _profile(r: OwnRequest) -> None:
    from dtbench.reports.views.profile_report import profile_report

    profile_report(r.sessions, r.run_id, r.fmt, r.profile_json, r.confidence)


def _engine(r: OwnRequest) -> None:
    from dtbench.reports.views.engine import engine_report

    engine_report(r.sessions, r.run_id, r.fmt, r.confidence)


def _spec_bench(r: OwnRequest) -> None:
    from dtbench.reports.views.specbench import spec_bench_report

    spec_bench_report(r.sessions, r.run_id, r.fmt)


def _cost_model(r: OwnRequest) -> None:
    from dtbench.reports.pricing.costmodel import cost_report

    cost_report(r.sessions, r.run_id, r.fmt)


def _curves(path: str) -> Any:
    """``--predict-on``'s file read and validated before the database opens (issue 59 item 8: ``/dev/zero`` or a
    huge file is one line, never a MemoryError)."""
    from dtbench.harness.calibration.curves_file import read

    return read(path)


def _predict_on(r: OwnRequest) -> None:
    from dtbench.reports.pricing.predict import predict_report, write_figure

    predict_report(r.sessions, r.run_id, r.fmt, r.value)
    if r.fig_dir:
        for path in write_figure(r.sessions, r.run_id, r.value, r.fig_dir):
            _note(f"wrote {path}")


def _export_curves(r: OwnRequest) -> None:
    from dtbench.reports.pricing.predict import export_curves

    _note(f"wrote {export_curves(r.sessions, r.run_id, r.value)}")


RUN_AND_FORMAT = "--run ID and --format"
OWN_REPORTS: tuple[OwnReport, ...] = (
    OwnReport("schedule", "--schedule", RUN_AND_FORMAT, _schedule),
    OwnReport("goodput", "--goodput", "--run ID, --format, --alpha", _goodput, _slos),
    OwnReport("execution", "--execution", RUN_AND_FORMAT, _execution),
    OwnReport("profile", "--profile", "--run ID, --format, --profile-json", _profile),
    OwnReport("engine", "--engine", RUN_AND_FORMAT, _engine),
    OwnReport("spec_bench", "--spec-bench", RUN_AND_FORMAT, _spec_bench),
    OwnReport("cost_model", "--cost-model", RUN_AND_FORMAT, _cost_model),
    OwnReport("predict_on", "--predict-on", "--run ID, --format, --figures DIR", _predict_on, _curves),
    OwnReport("export_curves", "--export-curves", "--run ID", _export_curves),
)
