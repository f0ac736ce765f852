"""One measuring interface (issue 49 item 1): a :class:`Measurer` observes a cell on a prompt group, and one shared
tail turns what it observed into ``samples`` rows.

Two measurers implement it: the *local* one (:class:`dtbench.harness.measurement.local_measurer.LocalMeasurer`: dtbench's own decoders,
their Steps timed by the one timing loop :func:`~dtbench.harness.measurement.measure.measure_rows`) and the *served* one
(:class:`dtbench.harness.serving.measurer.ServedMeasurer`: a server's requests, timed by the request client). Which
one measures a cell is what the cell's decoder declares (:attr:`~dtbench.decoders.base.Decoder.requests`:
:func:`measurer_name`), and that name is stored with the cell (``cells.measurer``), so reports read it instead of
guessing from params.

The shared tail (:func:`measure_outcome`, :func:`record_rows`): the one row builder
(:func:`~dtbench.harness.measurement.observation.sample_row`), the batch columns (a :class:`Batch`, set here only), the measurer's
own columns (:meth:`Measurer.finish`, returned, never written into the row: the local roofline, compile statistics
and lossless check; a served request's output check came with its observation), the record (:class:`~dtbench.harness.measurement.sample.SampleRecord`, JSON-checked) and
the one-line error that fails a cell (a measurer never fails the run for what a decoder or server does wrong).

This module imports no torch and nothing of :mod:`dtbench.harness.serving` (the request client imports it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

from dtbench.harness.measurement.observation import Observation, sample_row
from dtbench.harness.measurement.sample import Reference, SampleRecord

if TYPE_CHECKING:
    from dtbench.harness.data.prompt import Prompt
    from dtbench.harness.suites.plan import CellPlan, PromptGroup

MeasurerName = Literal["local", "served"]
MEASURERS: tuple[MeasurerName, ...] = ("local", "served")  # the values of ``cells.measurer``


def measurer_name(decoder_cls: Any) -> MeasurerName:
    """``served`` for a decoder class measured through requests (it declares ``requests``), else ``local``."""
    return "served" if getattr(decoder_cls, "requests", False) else "local"


def registered_measurer(decoder: str) -> str:
    """The measurer of a registered decoder's cells (:func:`~dtbench.harness.measurement.measurers.measurer_name`; ``local`` for a
    name that is not registered now), for a writer of cells that has only the decoder's name (the runner names the
    measurer of every cell it writes from its class; issue 58 item 4: the store has no hook to ask for it)."""
    from dtbench.harness import registry
    from dtbench.harness.errors import DtbenchError

    try:
        return measurer_name(registry.get(decoder))
    except DtbenchError:
        return "local"


@dataclass
class Outcome:
    """The result of one decoder on one prompt group: its samples rows (one per row; one at B = 1), or the error
    that fails the cell.

    Each row is a frozen :class:`~dtbench.harness.measurement.sample.SampleRecord` (issue 49 item 5: one shape from the
    measurement to the database; it pickles, so an executor ships it between processes as it is), mapped to the
    ``samples`` table once, by the runner (:func:`~dtbench.harness.execution.runner.commit_outcome`).
    """

    label: str
    rows: list[SampleRecord] | None = None
    error: str | None = None
    cpu_s: float | None = None  # the process's CPU seconds during the sample (the next decoders' timeout yardstick)
    load: dict[str, Any] | None = None  # the machine's load during the measurement (harness/measurement/load.py: span)
    compile_s: float | None = None  # compiled cells, first sample: seconds of the compile step before it (issue 37)
    compile_graphs: int | None = None  # graphs torch.compile made in that step

    def reference(self) -> Reference:
        """What a dependent decoder compares with: every row's output tokens, and the group's wall time (the batch's
        ``batch_total_s`` where the rows were decoded or paired together, else the one row's ``total_s``)."""
        assert self.rows is not None
        first = self.rows[0]
        total = first.batch_total_s if first.batch_total_s is not None else first.total_s
        prompts = tuple(r.prompt_index for r in self.rows)
        return Reference([list(r.output_tokens) for r in self.rows], total, self.cpu_s, prompts)


@dataclass(frozen=True)
class Batch:
    """The rows a row was decoded (or, for a server, paired) with: ``group`` the first prompt's index (the pairing key
    ``batch_group``), ``rows`` their number, ``total_s`` their wall time in seconds."""

    group: int
    rows: int
    total_s: float

    def columns(self) -> dict[str, Any]:
        """The ``samples`` batch columns: ``batch_group``, ``batch_rows``, ``batch_total_s``."""
        return {"batch_group": self.group, "batch_rows": self.rows, "batch_total_s": self.total_s}


@dataclass
class Observed:
    """What a measurer observed of one row: its :class:`~dtbench.harness.measurement.observation.Observation` (a Measurement's Steps
    or a Served request), the prompt, the reference's tokens on it (None: not compared), its :class:`Batch` (None:
    unbatched) and the measurer's own columns known at observation time (a served request's output check)."""

    observation: Observation
    prompt: Prompt
    reference: list[int] | None
    batch: Batch | None = None
    columns: dict[str, Any] = field(default_factory=dict)


StateT = TypeVar("StateT")


@dataclass
class Measured(Generic[StateT]):
    """A measurer's observation of one prompt group: one :class:`Observed` per row in row order, the process's CPU
    seconds during it (None: not measured), the compile step's (seconds, graphs) when one ran before it, and
    ``state``: what the measurer's :meth:`Measurer.finish` needs of this measurement, a value of the measurer's own
    type (issue 58 item 4: the local measurer's :class:`~dtbench.harness.measurement.local_measurer.LocalState`; None: nothing)."""

    rows: list[Observed]
    cpu_s: float | None = None
    compile: tuple[float, int] | None = None
    state: StateT | None = None


class CellError(Exception):
    """A cell that cannot be measured on this group, as one line (a missing reference, a timed-out sample)."""


class Measurer(Protocol):
    """Who measures a cell: observes its rows (:meth:`measure`), adds its own columns to each row (:meth:`finish`)
    and words an exception as the cell's one-line error (:meth:`failure`). Never touches the database."""

    def measure(
        self, cp: CellPlan, prompts: list[Prompt], group: PromptGroup, ref: Reference | None, compare: bool
    ) -> Measured:
        """Observe ``cp`` on the group's ``prompts`` (row order). ``ref``: the reference's rows on the group (None:
        none measured); ``compare``: check the output token for token against it (False when either samples).

        Raises:
            CellError: the cell cannot be measured here (one line); any other exception: worded by :meth:`failure`.
        """
        ...

    def finish(self, cp: CellPlan, measured: Measured[Any], r: int, row: Mapping[str, Any]) -> dict[str, Any]:
        """The measurer's own columns of row ``r`` after the shared row builder made ``row`` (read-only: a column it
        changes, e.g. ``step_stats``, is returned whole; {}: none), stored over the row's by :func:`record_rows`."""
        ...

    def failure(self, cp: CellPlan, prompts: list[Prompt], group: PromptGroup, exc: BaseException) -> str:
        """The one-line error of a cell whose measurement raised ``exc``."""
        ...


def record_rows(
    observed: list[Observed],
    warmup: bool,
    finish: Callable[[int, Mapping[str, Any]], dict[str, Any]] | None = None,
) -> list[SampleRecord]:
    """The ``samples`` rows of a measurement: per row the one row builder
    (:func:`~dtbench.harness.measurement.observation.sample_row`), its batch columns, the observation's own columns, then the columns
    ``finish(r, row)`` returns (a measurer's :meth:`Measurer.finish`, given the row read-only), as exactly the
    sample's columns (:class:`~dtbench.harness.measurement.sample.SampleRecord`).

    Raises:
        TypeError: a Step's counters are not integers, or a row that does not serialize as JSON (the decoder's fault:
            the caller fails the cell).
    """
    rows = []
    for r, o in enumerate(observed):
        row = sample_row(o.observation, o.prompt, warmup, o.reference)
        if o.batch is not None:
            row.update(o.batch.columns())
        row.update(o.columns)
        if finish is not None:
            row.update(finish(r, MappingProxyType(row)))
        rows.append(SampleRecord.from_row(row))
    json.dumps([r.as_row() for r in rows])  # the JSON columns must serialize: a bad Step is the decoder's failure
    return rows


def unit_name(prompts: list[Prompt], group: PromptGroup) -> str:
    """How an error names the group's prompts: ``prompt i`` for one, ``the prompt group i`` (its first) for more."""
    return f"the prompt group {group.prompt_index}" if len(prompts) > 1 else f"prompt {prompts[0].index}"


def measure_outcome(
    measurer: Measurer,
    cp: CellPlan,
    prompts: list[Prompt],
    group: PromptGroup,
    ref: Reference | None,
    compare: bool = True,
) -> Outcome:
    """Measure ``cp`` on a prompt group with ``measurer`` and the shared tail; never raises for what the decoder or
    server does wrong (raising, ``sys.exit``, a timeout, Steps that cannot become a sample): that comes back as an
    :class:`Outcome` with a one-line error. Only Ctrl-C propagates.

    Args:
        prompts: the group's :class:`~dtbench.harness.data.prompt.Prompt` objects in row order; ref: the reference
            decoder's rows on this group (None for a reference itself); compare: as :meth:`Measurer.measure`.
    """
    if cp.reference_label and ref is None:
        what = unit_name(prompts, group)
        return Outcome(cp.label, error=f"reference decoder '{cp.reference_label}' has no output for {what}")
    try:
        measured = measurer.measure(cp, prompts, group, ref, compare)
        rows = record_rows(measured.rows, group.warmup, lambda r, row: measurer.finish(cp, measured, r, row))
    except KeyboardInterrupt:
        raise
    except CellError as exc:
        return Outcome(cp.label, error=str(exc))
    except (Exception, SystemExit) as exc:  # a decoder or server failing mid-run fails its cell, never the run
        return Outcome(cp.label, error=measurer.failure(cp, prompts, group, exc))
    outcome = Outcome(cp.label, rows=rows, cpu_s=measured.cpu_s)
    if measured.compile is not None:
        outcome.compile_s, outcome.compile_graphs = measured.compile
    return outcome
