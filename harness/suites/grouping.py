"""How a dataset's prompts are grouped into units of work (split from :mod:`dtbench.harness.suites.plan`, whose
:meth:`~dtbench.harness.suites.plan.Plan.groups` uses them): prompt indices only, at batch size B (raw text and single-turn
questions) and for a server cell's whole-cell units; and the frozen keys of a cell's point and of a unit of work
(:class:`CellKey`, :class:`GroupKey`, issue 58 item 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CellKey:
    """The identity of a cell's point (issue 58 item 3): the dataset entry's key (``DatasetSpec.key``: its label, else
    its name; never the name alone, which two entries may share), the prompt cap L_max, the generation length T and
    the batch size (or a server's concurrency) B. With a decoder's label it names one ``cells`` row; a server pool
    keys its launched servers by it (:class:`~dtbench.harness.serving.process.ServerPool`)."""

    dataset: str
    l_max: int
    gen_length: int
    batch_size: int

    @classmethod
    def of_row(cls, cell: Any) -> CellKey:
        """The key of a stored ``cells`` row, a report's summary row or any mapping or pandas row with ``dataset``,
        ``l_max``, ``gen_length`` and ``batch_size`` (issue 68 item 4: the reports' one group key; a row written
        before batch sizes, or a missing or NULL ``batch_size``, is B = 1)."""
        from dtbench.harness.values import is_missing

        def get(name: str) -> Any:
            if isinstance(cell, dict) or hasattr(cell, "iloc"):
                return cell[name] if name in cell else None
            return getattr(cell, name, None)

        b = get("batch_size")
        return cls(str(get("dataset")), int(get("l_max")), int(get("gen_length")), 1 if is_missing(b) else int(b))

    def columns(self) -> dict[str, Any]:
        """The key as a report's group columns (:data:`dtbench.harness.measurement.metrics.GROUP`)."""
        return {
            "dataset": self.dataset,
            "l_max": self.l_max,
            "gen_length": self.gen_length,
            "batch_size": self.batch_size,
        }

    @property
    def point(self) -> PointKey:
        """The cell's point without its load level: what a batch-size sweep or a schedule compares across B."""
        return PointKey(self.dataset, self.l_max, self.gen_length)

    def title(self) -> str:
        """The key as a report title shows it: ``dataset · L_max=… · T=…`` and `` · B=…`` when B > 1."""
        return self.point.title() + (f" · B={self.batch_size}" if self.batch_size != 1 else "")


@dataclass(frozen=True)
class PointKey:
    """A cell's point without its batch size (or a server's concurrency): the dataset entry's key, L_max and T
    (:attr:`CellKey.point`; issue 68 item 4: the reports' keys are typed, never a tuple sliced by position)."""

    dataset: str
    l_max: int
    gen_length: int

    def title(self) -> str:
        """The point as a report title shows it: ``dataset · L_max=… · T=…``."""
        return f"{self.dataset} · L_max={self.l_max} · T={self.gen_length}"

    def at(self, batch_size: int) -> CellKey:
        """The cell at this point with batch size (or concurrency) ``batch_size``."""
        return CellKey(self.dataset, self.l_max, self.gen_length, batch_size)


@dataclass(frozen=True)
class GroupKey:
    """The identity of a unit of work (issue 58 item 3: one frozen key instead of tuples rebuilt by hand): its cells'
    point (:class:`CellKey`), its (first) prompt index, the repeat, and whether it is a server cell's whole-cell
    unit (:func:`cell_units`: it starts at the same prompt as a group of dtbench's own decoders at the same point).
    The plan's :attr:`~dtbench.harness.suites.plan.PromptGroup.key`; the driver's sink counts progress by it, the Ray
    executor counts attempts by it and sends it to an actor, which looks the group up in the driver's plan."""

    cell: CellKey
    prompt_index: int
    repeat: int = 0
    served: bool = False

    @property
    def dataset(self) -> str:
        """The dataset entry's key (:attr:`CellKey.dataset`)."""
        return self.cell.dataset

    @property
    def unit(self) -> GroupKey:
        """The kind of unit this is, whatever its prompts and repeat: its point, and whether it is a server cell's
        whole-cell unit (what the plan counts a point's measured groups by, for ``min_groups``)."""
        return GroupKey(self.cell, 0, 0, self.served)


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
    in flight (a new request starts when one finishes; :func:`dtbench.harness.serving.observe_requests`), not as
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
