"""How a dataset's prompts are grouped into units of work (split from :mod:`dtbench.harness.plan`, whose
:meth:`~dtbench.harness.plan.Plan.groups` uses them): prompt indices only, at batch size B (raw text and single-turn
questions) and for a server cell's whole-cell units.
"""

from __future__ import annotations


def batch_groups(prompts: int, warmup: int, batch_size: int) -> list[tuple[int, ...]]:
    """The prompt groups of a dataset at batch size B: prompt indices in order, the W warmup prompts in groups of at
    most B, then the other prompts in groups of B, the last one possibly smaller (the remainder).

    Every decoder at the same (dataset, L_max, T, B) gets exactly these groups, so speedups pair group by group.
    """
    warm = [tuple(range(i, min(i + batch_size, warmup))) for i in range(0, warmup, batch_size)]
    rest = [tuple(range(i, min(i + batch_size, prompts))) for i in range(warmup, prompts, batch_size)]
    return warm + rest


def cell_units(prompts: int, warmup: int, slot_warmup: list[bool] | None = None) -> list[tuple[int, ...]]:
    """The work units of a server cell (a decoder declaring ``requests``) at any concurrency C (issue 39 item 1): its
    warmup prompts as one unit and its measured prompts as another, each sent as one stream of requests that keeps C
    in flight (a new request starts when one finishes; :func:`dtbench.harness.serving.measure_requests`), not as
    groups of C that each wait for their slowest request. ``slot_warmup``: a question dataset's per-slot warmup
    flags (single-turn questions), else the first ``warmup`` of ``prompts`` are the warmup.
    """
    if slot_warmup is not None:
        units = [tuple(i for i, w in enumerate(slot_warmup) if w), tuple(i for i, w in enumerate(slot_warmup) if not w)]
    else:
        units = [tuple(range(min(warmup, prompts))), tuple(range(warmup, prompts))]
    return [u for u in units if u]


def slot_groups(warmup: list[bool], batch_size: int) -> list[tuple[int, ...]]:
    """The prompt groups of a question dataset at batch size B (single-turn questions): its warmup slots in order in
    groups of at most B, then its other slots in order in groups of B (the last possibly smaller: the remainder), so
    the W warmup questions of each task group never split the measured ones into small groups."""
    warm = [i for i, w in enumerate(warmup) if w]
    rest = [i for i, w in enumerate(warmup) if not w]
    return [tuple(warm[i : i + batch_size]) for i in range(0, len(warm), batch_size)] + [
        tuple(rest[i : i + batch_size]) for i in range(0, len(rest), batch_size)
    ]
