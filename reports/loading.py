"""The one loader of a run's cells for every report (issue 58 item 1: "one loader of a run's cells for every report.
The reports become views of it").

Every report reads a run's cells, and their samples where it needs them, through the functions here; no other module
of ``reports/`` issues a query on cells or samples (tests/test_loading.py holds the rule). The order is part of what
they return, so every report sees the same rows in the same order:

- cells in id order (the order the runner stored them: the suite's order);
- a cell's samples in the order they were stored (sample id: prompt order, repeats as the runner wrote them), or, with
  ``by_prompt=True``, by prompt index, then repeat, then sample id.

Warmup samples are included unless a function says otherwise; callers that need samples after warmup only ask for
them (:func:`measured_cells`, :func:`sample_values`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, overload

from sqlalchemy import select
from sqlalchemy.orm import Session

from dtbench.harness.store.db import Cell, Sample


def run_cells(session: Session, run_id: int) -> list[Cell]:
    """Every cell of run ``run_id`` in id order ([] for a run without cells or no such run)."""
    return list(session.scalars(select(Cell).where(Cell.run_id == run_id).order_by(Cell.id)))


@overload
def cell_rows(
    session: Session,
    run_id: int,
    *,
    outer: Literal[False] = False,
    by_prompt: bool = False,
    first_repeat: bool = False,
    tasked: bool = False,
) -> list[tuple[Cell, Sample]]: ...


@overload
def cell_rows(
    session: Session,
    run_id: int,
    *,
    outer: Literal[True],
    by_prompt: bool = False,
    first_repeat: bool = False,
    tasked: bool = False,
) -> list[tuple[Cell, Sample | None]]: ...


def cell_rows(
    session: Session,
    run_id: int,
    *,
    outer: bool = False,
    by_prompt: bool = False,
    first_repeat: bool = False,
    tasked: bool = False,
) -> list[tuple[Cell, Sample]] | list[tuple[Cell, Sample | None]]:
    """(cell, sample) for every sample of run ``run_id``'s cells, warmup samples included, cells in id order.

    Args:
        outer: also a (cell, None) row for each cell without samples (a cell that failed before its first prompt).
        by_prompt: a cell's samples by prompt index, then repeat (else in the order they were stored).
        first_repeat: only repeat 0 of each prompt (a repeat decodes the same tokens with the same seed).
        tasked: only samples with a task group (question datasets, ``samples.task_group``; issue 21).
    """
    query = select(Cell, Sample).join(Sample, Sample.cell_id == Cell.id, isouter=outer).where(Cell.run_id == run_id)
    if first_repeat:
        query = query.where(Sample.repeat == 0)
    if tasked:
        query = query.where(Sample.task_group.is_not(None))
    order = (Sample.prompt_index, Sample.repeat, Sample.id) if by_prompt else (Sample.id,)
    return [(cell, sample) for cell, sample in session.execute(query.order_by(Cell.id, *order)).all()]


def cells_with_samples(
    session: Session, run_id: int, *, after_warmup: bool = False, by_prompt: bool = False
) -> list[tuple[Cell, list[Sample]]]:
    """(cell, its samples) for every cell of run ``run_id`` in id order, cells without samples with []; with
    ``after_warmup`` only the samples after warmup (a cell whose samples are all warmup gets [])."""
    out: dict[int, tuple[Cell, list[Sample]]] = {}
    for cell, sample in cell_rows(session, run_id, outer=True, by_prompt=by_prompt):
        entry = out.setdefault(cell.id, (cell, []))
        if sample is not None and not (after_warmup and sample.warmup):
            entry[1].append(sample)
    return list(out.values())


def measured_cells(session: Session, run_id: int, *, by_prompt: bool = False) -> list[tuple[Cell, list[Sample]]]:
    """(cell, its samples after warmup) for every cell of run ``run_id`` that has such samples, in id order."""
    return [(c, ss) for c, ss in cells_with_samples(session, run_id, after_warmup=True, by_prompt=by_prompt) if ss]


def sample_values(session: Session, cell_ids: Iterable[int], *columns: str) -> list[Any]:
    """Rows of ``cell_id`` and the named ``samples`` columns (e.g. ``"total_s"``, ``"step_stats"``) of the samples
    after warmup of the cells ``cell_ids``, by cell id, each cell's in the order they were stored: for reports that need a few columns of
    many samples without loading whole rows.

    Raises:
        AttributeError: a name that is no column of ``samples``.
    """
    ids = list(cell_ids)
    query = select(Sample.cell_id, *(getattr(Sample, c) for c in columns)).where(
        Sample.cell_id.in_(ids), Sample.warmup.is_(False)
    )
    return list(session.execute(query.order_by(Sample.cell_id, Sample.id)).all())
