"""Measuring one prompt group's cells (split from :mod:`dtbench.harness.execution.worker`, which owns the models):
:func:`run_group` yields one :class:`~dtbench.harness.measurement.measurers.Outcome` per decoder as soon as it is measured: each
cell by one :class:`~dtbench.harness.measurement.measurers.Measurer` (the local one,
:class:`~dtbench.harness.measurement.local_measurer.LocalMeasurer`: dtbench's own decoders through the one timing loop, B = 1 a
group of one; the served one of :mod:`dtbench.harness.serving.measurer` for a server's requests), then one shared
tail (:func:`~dtbench.harness.measurement.measurers.measure_outcome`: rows, batch columns, record, the one-line error). Nothing
here touches the database: the driver (:mod:`dtbench.harness.execution.runner`) commits what it yields. A worker's hardware
facts and the compile step are :mod:`dtbench.harness.measurement.hardware`; the cells' time limits :mod:`dtbench.harness.execution.deadline`
(issue 58 item 7: split by concern).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

from dtbench.harness.data import datasets as data
from dtbench.harness.measurement import load
from dtbench.harness.measurement.hardware import Hardware
from dtbench.harness.measurement.local_measurer import LocalMeasurer
from dtbench.harness.measurement.measurers import Measurer, Outcome, measure_outcome, measurer_name
from dtbench.harness.measurement.sample import Reference
from dtbench.harness.suites.plan import PromptGroup
from dtbench.harness.suites.suite import Suite

__all__ = [
    "Outcome",
    "run_group",
]  # Outcome lives in harness/measurement/measurers.py; executors, the runner and isolation take it here


def run_group(
    group: PromptGroup,
    prompt,
    target,
    draft,
    device,
    suite: Suite,
    done: dict[str, Reference],
    skip: set[str],
    data_dir: str | None = None,
    servers=None,
    tokenizer=None,
    hardware: Hardware | None = None,
    announce: Callable[[str], None] | None = None,
) -> Iterator[Outcome]:
    """Measure a prompt group's decoders in order (references first), yielding each outcome as it is measured: each
    cell by its :class:`~dtbench.harness.measurement.measurers.Measurer` (:func:`~dtbench.harness.measurement.measurers.measurer_name`: the
    :class:`LocalMeasurer`, or the served one for a decoder that declares ``requests``), then the one shared tail
    (:func:`~dtbench.harness.measurement.measurers.measure_outcome`).

    Args:
        group: the unit of work; prompt: its :class:`~dtbench.harness.data.prompt.Prompt` (when ``group.multi``, the
            list of its rows' prompts, decoded together).
        done: :class:`Reference` (per-row tokens, the group's seconds) of decoders already stored for this group (a
            resumed run): not re-measured, but available as references.
        skip: labels of cells that already failed: not measured.
        servers, tokenizer: the worker's server pool and the target's tokenizer, for served cells (at every B).
        hardware: the worker's :class:`Hardware` (roofline inputs, compiled execution), or None.
        announce: called with a decoder's label right before it is measured (crash isolation names the cell a
            dying process was measuring, :mod:`dtbench.harness.execution.isolation`).
    """
    outputs = dict(done)
    stop = data.stops_at_eos(suite.stop_at_eos, group.dataset)
    prompts = prompt if group.multi else [prompt]
    by_label = {cp.label: cp for cp in group.decoders}
    measurers: dict[str, Measurer] = {}
    for cp in group.decoders:
        if cp.label in outputs or cp.label in skip:
            continue
        ref = outputs.get(cp.reference_label) if cp.reference_label else None
        ref_plan = by_label.get(cp.reference_label) if cp.reference_label is not None else None
        compare = cp.sampling is None and (ref_plan is None or ref_plan.sampling is None)
        if announce is not None:
            announce(cp.label)
        kind = measurer_name(cp.cls)
        if kind not in measurers:
            measurers[kind] = _measurer(
                kind, target, draft, device, suite, stop, data_dir, hardware, servers, tokenizer
            )
        start = load.probe()
        outcome = measure_outcome(measurers[kind], cp, prompts, group, ref, compare)
        _finish(outcome, group, start)
        if outcome.rows is not None:
            outputs[cp.label] = outcome.reference()
        yield outcome


def _measurer(kind: str, target, draft, device, suite, stop, data_dir, hardware, servers, tokenizer) -> Measurer:
    """The worker's measurer of ``kind`` (``local`` or ``served``)."""
    if kind == "served":
        from dtbench.harness.serving.measurer import ServedMeasurer

        return ServedMeasurer(suite, servers, tokenizer, stop)
    return LocalMeasurer(target, draft, device, suite, stop, data_dir, hardware)


def _finish(outcome: Outcome, group: PromptGroup, start: load.Reading) -> None:
    """Stamp an outcome with its group's repeat (every row) and the machine's load since ``start``."""
    outcome.load = load.span(start, load.probe())
    if outcome.rows is not None:
        outcome.rows = [replace(row, repeat=group.repeat) for row in outcome.rows]
