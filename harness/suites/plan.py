"""The run plan: a suite expanded, once, into ordered decoders, cells and prompt groups (docs/architecture.md "The data flow, once").

Cells are dataset x L_max x T x batch size B x decoder; a decoder entry may be restricted to some datasets, T, L_max
and B values.
Reference decoders (``ar``, and any decoder's declared reference) are added where a dependent runs and ordered
first, so every sample is compared as soon as it is measured. The unit of work is a :class:`PromptGroup`: one
(dataset, L_max, T, B) and B prompts decoded together (one prompt at B = 1) with the reference and every other
decoder, in order, on one device — except a server cell (a decoder declaring ``requests``), whose unit is all its
warmup prompts, then all its measured prompts, kept C in flight (:func:`cell_units`, issue 39) — the runner,
``validate``, the progress bar and any executor all read this one plan.
"""

from __future__ import annotations

import inspect
import json
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from dtbench.core import mask_urls
from dtbench.decoders.base import Decoder, DecoderParams
from dtbench.harness import registry
from dtbench.harness.data import datasets as data
from dtbench.harness.data import selection
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.suites.decoderspec import DecoderSpec, SamplingSpec
from dtbench.harness.suites.grouping import CellKey, GroupKey, batch_groups, cell_units, slot_groups
from dtbench.harness.suites.plan_checks import check_batching, check_execution
from dtbench.harness.suites.suite import DatasetSpec, Suite


@dataclass
class CellPlan:
    """A decoder configuration with its validated params, its reference's label (None for ``ar``) and the
    (dataset, L_max, T, B) points it runs at (:class:`~dtbench.harness.suites.grouping.CellKey`, issue 58 item 3)."""

    spec: DecoderSpec
    cls: type[Decoder]
    params: DecoderParams
    distribution: str
    version: str
    reference_label: str | None = None
    implicit: bool = False
    points: set[CellKey] = field(default_factory=set)
    sampling: SamplingSpec | None = None  # effective sampling settings (None: greedy)

    @property
    def label(self) -> str:
        return self.spec.display

    @property
    def execution(self) -> str:
        """``eager`` or ``compiled`` (suite key ``execution``; stored as ``cells.execution``)."""
        return self.spec.mode


@dataclass(frozen=True)
class PromptGroup:
    """The unit of work: one prompt of one (dataset, L_max, T) at batch size 1, or at batch size B the B prompts
    ``rows`` decoded together (a *prompt group*), decoded by its decoders in order (references first), all on one
    device so every speedup and lossless check pairs runs of the same machine.

    At B > 1 the dataset's prompts are grouped in order, the same groups for every decoder (:meth:`Plan.groups`): the
    W warmup prompts form warmup groups of at most B, the others groups of B; a last group of fewer than B prompts is
    the *remainder* (decoded as a smaller batch and marked, never dropped). ``prompt_index`` is the group's first
    prompt, the key every decoder's samples of the group are paired by.

    With ``repeats: N`` each group after the warmup comes N times in a row (``repeat`` 0 .. N-1), each time with
    every decoder in order: the repeats of one decoder are interleaved with the others', never back to back. With
    ``min_groups: M`` a point of fewer than M measured groups repeats each of them ceil(M / groups) times
    (:meth:`Plan.repeats_at`); ``repeats`` is that count for this group (1 for a warmup group).
    """

    dataset: DatasetSpec
    l_max: int
    gen_length: int
    prompt_index: int
    decoders: tuple[CellPlan, ...]
    slot_warmup: bool | None = None  # question datasets: the slot's own flag (W per group)
    batch_size: int = 1  # the cells' B
    rows: tuple[int, ...] = ()  # the prompt indices decoded together (B > 1); () at B = 1: (prompt_index,)
    repeat: int = 0  # which measurement of the group (suite key repeats: 0 .. N-1; warmup groups only 0)
    repeats: int = 1  # how many times the group is measured (Plan.repeats_at; warmup groups once)

    @property
    def key(self) -> GroupKey:
        """The group's frozen identity (:class:`~dtbench.harness.suites.grouping.GroupKey`, issue 58 item 3): its cells' point
        (the dataset entry's key, L_max, T, B), first prompt index, repeat, and whether it is a server cell's unit."""
        served = bool(self.decoders) and all(cp.cls.requests for cp in self.decoders)
        return GroupKey(self.cell, self.prompt_index, self.repeat, served)

    @property
    def cell(self) -> CellKey:
        """The point of the group's cells (:attr:`key`'s :class:`~dtbench.harness.suites.grouping.CellKey`)."""
        return CellKey(self.dataset.key, self.l_max, self.gen_length, self.batch_size)

    @property
    def prompt_indices(self) -> tuple[int, ...]:
        """The prompts this group decodes (one at B = 1)."""
        return self.rows or (self.prompt_index,)

    @property
    def multi(self) -> bool:
        """Whether the group decodes a list of prompts (B > 1, or a server cell's whole-cell unit at concurrency 1),
        each row its own sample, stored together."""
        return self.batch_size > 1 or bool(self.rows)

    @property
    def remainder(self) -> bool:
        """A group of fewer than B prompts after the warmup (the dataset's last, decoded as a smaller batch)."""
        return len(self.prompt_indices) < self.batch_size and not self.warmup

    @property
    def warmup(self) -> bool:
        if self.slot_warmup is not None:
            return self.slot_warmup
        return self.prompt_index < self.dataset.warmup


@dataclass
class Plan:
    """Everything a run needs, validated before any model is loaded."""

    suite: Suite
    decoders: list[CellPlan]
    skipped: list[str] = field(default_factory=list)  # optional decoders that are not installed
    data_dir: str | None = None  # where question datasets are read from (their layout: data.sample_slots)

    def points(self) -> list[tuple[DatasetSpec, int, int, int]]:
        """(dataset, L_max, T, B) in run order."""
        return [
            (ds, l_max, T, B)
            for ds in self.suite.datasets
            for l_max in ds.l_maxes
            for T in self.suite.generation_lengths
            for B in self.suite.batch_sizes
        ]

    def decoders_at(self, dataset: str, l_max: int, gen_length: int, batch_size: int = 1) -> list[CellPlan]:
        """The decoders that run at one (dataset, L_max, T, B), references first."""
        point = CellKey(dataset, l_max, gen_length, batch_size)
        return [c for c in self.decoders if point in c.points]

    def cells(self) -> list[tuple[DatasetSpec, int, int, int, CellPlan]]:
        """Every cell (dataset, L_max, T, B, decoder) in run order."""
        return [
            (ds, l_max, T, B, c) for ds, l_max, T, B in self.points() for c in self.decoders_at(ds.key, l_max, T, B)
        ]

    def groups(self) -> list[PromptGroup]:
        """Every prompt group in run order: (dataset, L_max, T, B) major, then prompt index, then repeat
        (:meth:`repeats_at` times for a group after the warmup, once for a warmup group; :class:`PromptGroup`)."""
        groups = self._groups()
        measured = Counter(g.key.unit for g in groups if not g.warmup and not g.remainder)
        out: list[PromptGroup] = []
        for g in groups:
            n = 1 if g.warmup else self.repeats_at(measured[g.key.unit])
            out.extend(replace(g, repeat=r, repeats=n) if r or n > 1 else g for r in range(n))
        return out

    def repeats_at(self, groups: int) -> int:
        """How many times each measured group of a point with ``groups`` measured prompt groups (remainder left out)
        is decoded: the suite's ``repeats``, raised to ceil(``min_groups`` / groups) where ``min_groups`` is set."""
        want = self.suite.min_groups
        return max(self.suite.repeats, -(-want // max(groups, 1)) if want else 1)

    def _groups(self) -> list[PromptGroup]:
        out: list[PromptGroup] = []
        for ds, l_max, T, B in self.points():
            decs = tuple(self.decoders_at(ds.key, l_max, T, B))
            if not decs:
                continue
            slots = data.sample_slots(ds, self.suite.seed, self.data_dir)
            served = tuple(c for c in decs if c.cls.requests)
            if served and (B > 1 or slots is None):  # steady concurrency over the whole cell (issue 39 item 1)
                decs = tuple(c for c in decs if not c.cls.requests)
                flags = [s.warmup for s in slots] if slots is not None else None
                out.extend(
                    PromptGroup(ds, l_max, T, rows[0], served, None if flags is None else flags[rows[0]], B, rows)
                    for rows in cell_units(ds.prompts, ds.warmup, flags)
                )
                if not decs:
                    continue
            if B > 1 and slots is not None:  # single-turn questions (the plan refuses later turns at B > 1)
                out.extend(
                    PromptGroup(ds, l_max, T, rows[0], decs, slots[rows[0]].warmup, batch_size=B, rows=rows)
                    for rows in slot_groups([s.warmup for s in slots], B)
                )
                continue
            if B > 1:
                out.extend(
                    PromptGroup(ds, l_max, T, rows[0], decs, batch_size=B, rows=rows)
                    for rows in batch_groups(ds.prompts, ds.warmup, B)
                )
                continue
            if slots is None:
                out.extend(PromptGroup(ds, l_max, T, i, decs) for i in range(ds.prompts))
            else:
                out.extend(PromptGroup(ds, l_max, T, i, decs, s.warmup) for i, s in enumerate(slots))
        return out

    @property
    def n_samples(self) -> int:
        return sum(len(g.decoders) * len(g.prompt_indices) for g in self.groups())


def _params_key(name: str, params: DecoderParams, sampling: SamplingSpec | None = None) -> str:
    """Identity of a decoder configuration: name, params, and how it decodes (greedy or its sampling settings)."""
    decoding = sampling.model_dump(mode="json") if sampling is not None else None
    return name + json.dumps(params.model_dump(mode="json"), sort_keys=True) + json.dumps(decoding, sort_keys=True)


def plan_suite(suite: Suite) -> Plan:
    """Validate a suite against the registry and expand it, adding implicit reference decoders.

    Reference decoders come first, in dependency order, so each sample can be compared as it is measured.

    Raises:
        DtbenchError: unknown dataset or decoder, invalid params, a draft-needing decoder without a draft model,
            a label that collides with a reference's; decoder errors name the suite's file, line and entry.
    """
    for ds in suite.datasets:
        try:
            data.check_dataset(ds)
        except DtbenchError as exc:
            raise DtbenchError(f"{ds.where}: {exc}" if ds.where else str(exc)) from None
    found = registry.scan()
    entries = registry.discover()
    plans: list[CellPlan] = []
    skipped: list[str] = []
    for spec in suite.expanded_decoders():
        if spec.optional and spec.name not in entries and spec.name not in found.ambiguous:
            skipped.append(spec.display)
            continue
        plans.append(_plan_entry(suite, spec, entries))
    by_key: dict[str, CellPlan] = {}
    for p in plans:  # the first of equal eager configurations is the reference of the others' dependents
        if p.execution == "eager":  # references run eager: a compiled cell is checked against eager output
            by_key.setdefault(_params_key(p.spec.name, p.params, p.sampling), p)
    queue = list(plans)
    while queue:
        p = queue.pop(0)
        ref = _reference_of(p)
        if ref is None:
            continue
        name, raw = ref
        try:
            rparams = registry.validate_params(name, raw)
        except DtbenchError as exc:  # the reference's own params: say whose reference they are
            where = f"{p.spec.where}: " if p.spec.where else ""
            raise DtbenchError(f"{where}reference of decoder '{clip(p.spec.display, 80)}': {exc}") from None
        rcls = registry.get(name)
        # The reference decodes the way its dependent does (greedy, or the same sampling settings).
        rsampling = p.sampling if rcls.supports_sampling else None
        key = _params_key(name, rparams, rsampling)
        if key not in by_key:
            rp = _implicit_reference(suite, name, raw, rparams, rsampling, entries, plans)
            by_key[key] = rp
            plans.append(rp)
            queue.append(rp)
        p.reference_label = by_key[key].spec.display
    _spread_to_references(plans)
    check_batching(suite, plans)
    check_execution(plans)
    return Plan(suite=suite, decoders=_reference_order(plans), skipped=skipped)


def _plan_entry(suite: Suite, spec: DecoderSpec, entries: dict[str, Any]) -> CellPlan:
    """One decoder entry of the suite, validated against the registry: its class, params, sampling and corpus.

    Raises:
        DtbenchError: as :func:`plan_suite`, naming the entry's file and line.
    """
    where = f"{spec.where}: " if spec.where else ""
    try:
        cls = registry.get(spec.name)
        params = registry.validate_params(spec.name, spec.params)
    except DtbenchError as exc:
        raise DtbenchError(f"{where}{exc}") from None
    if cls.needs_draft and suite.draft is None:
        raise DtbenchError(f"{where}decoder '{spec.display}' needs a draft model: add `draft:` to the suite")
    e = entries[spec.name]
    sampling = None if spec.sampling == "greedy" else (spec.sampling or suite.sampling)
    if sampling is not None and not cls.supports_sampling:
        raise DtbenchError(
            f"{where}decoder '{clip(spec.display, 80)}' does not support sampling (greedy only); "
            f"set `sampling: greedy` on it or remove the suite's `sampling:`"
        )
    corpus = cls.corpus_of(params)
    if corpus is not None:
        try:
            selection.check_corpus(corpus, suite.datasets)
        except DtbenchError as exc:
            raise DtbenchError(f"{where}decoder '{clip(spec.display, 80)}': {exc}") from None
    if sampling is not None and (why := cls.sampling_error(params)):
        raise DtbenchError(f"{where}decoder '{clip(spec.display, 80)}': {why}")
    return CellPlan(
        spec,
        cls,
        params,
        e.distribution,
        f"{cls.version} ({e.distribution} {e.version})",
        points=_points(suite, spec),
        sampling=sampling,
    )


def _implicit_reference(
    suite: Suite,
    name: str,
    raw: dict[str, Any],
    rparams: Any,
    rsampling: Any,
    entries: dict[str, Any],
    plans: list[CellPlan],
) -> CellPlan:
    """The reference decoder dtbench adds for a dependent (labelled by its params and, when it is not the suite's,
    its decoding).

    Raises:
        DtbenchError: an entry of the suite already has that label.
    """
    # the reference's params name it, credentials masked like its stored params (issue 50 item 2)
    label = name if not raw else f"{name} ({mask_urls(', '.join(f'{k}={v}' for k, v in raw.items()))})"
    if rsampling != suite.sampling:  # not the suite's own decoding: say how this one decodes
        label += (
            " (greedy)"
            if rsampling is None
            else f" (T={rsampling.temperature:g}, top_k={rsampling.top_k}, top_p={rsampling.top_p:g})"
        )
    rcls, e = registry.get(name), entries[name]
    clash = next((q for q in plans if q.spec.display == label), None)
    if clash is not None:
        where = f"{clash.spec.where}: " if clash.spec.where else ""
        raise DtbenchError(
            f"{where}label '{clip(label, 80)}' of decoder '{clash.spec.name}' is the label of "
            f"the reference decoder '{name}' that dtbench adds; choose another label"
        )
    return CellPlan(
        DecoderSpec(name=name, label=label, params=raw),
        rcls,
        rparams,
        e.distribution,
        f"{rcls.version} ({e.distribution} {e.version})",
        implicit=True,
        sampling=rsampling,
    )


def _points(suite: Suite, spec: DecoderSpec) -> set[CellKey]:
    """The (dataset, L_max, T, B) a suite entry runs at, after its ``datasets``/``L_max``/``generation_lengths``/
    ``batch_sizes``.

    Raises:
        DtbenchError: a restriction naming a dataset, L_max or T the suite does not have.
    """
    where = f"{spec.where}: " if spec.where else ""
    names = {ds.name for ds in suite.datasets} | {ds.key for ds in suite.datasets}
    for name in spec.datasets or []:
        if name not in names:
            raise DtbenchError(
                f"{where}decoder '{clip(spec.display, 80)}': datasets names '{clip(name, 60)}', "
                f"which the suite does not have ({', '.join(sorted(names))})"
            )
    if spec.generation_lengths is not None:
        extra = sorted(set(spec.generation_lengths) - set(suite.generation_lengths))
        if extra:
            raise DtbenchError(
                f"{where}decoder '{clip(spec.display, 80)}': generation_lengths {extra} are not in "
                f"the suite's generation_lengths"
            )
    all_l_maxes = {c for ds in suite.datasets for c in ds.l_maxes}
    if spec.l_maxes is not None and set(spec.l_maxes) - all_l_maxes:
        raise DtbenchError(
            f"{where}decoder '{clip(spec.display, 80)}': L_max {sorted(set(spec.l_maxes) - all_l_maxes)}"
            f" is not an L_max of any dataset"
        )
    if spec.batch_sizes is not None:
        extra = sorted(set(spec.batch_sizes) - set(suite.batch_sizes))
        if extra:
            raise DtbenchError(
                f"{where}decoder '{clip(spec.display, 80)}': batch_sizes {extra} are not in the suite's batch_sizes"
            )
    return {
        CellKey(
            ds.key, l_max, T, B
        )  # a restriction names an entry by its label or every entry of a dataset by its name
        for ds in suite.datasets
        if spec.datasets is None or ds.key in spec.datasets or ds.name in spec.datasets
        for l_max in ds.l_maxes
        if spec.l_maxes is None or l_max in spec.l_maxes
        for T in suite.generation_lengths
        if spec.generation_lengths is None or T in spec.generation_lengths
        for B in suite.batch_sizes
        if spec.batch_sizes is None or B in spec.batch_sizes
    }


def _spread_to_references(plans: list[CellPlan]) -> None:
    """A reference runs wherever a decoder that depends on it runs (implicit references only there)."""
    by_label = {p.label: p for p in plans}
    changed = True
    while changed:
        changed = False
        for p in plans:
            ref = by_label.get(p.reference_label) if p.reference_label else None
            if ref is not None and not p.points <= ref.points:
                ref.points |= p.points
                changed = True


def _reference_of(p: CellPlan) -> tuple[str, dict] | None:
    """The decoder's declared reference (:meth:`~dtbench.decoders.base.Decoder.reference`, from the params alone).

    Raises:
        DtbenchError: the decoder defines ``reference`` as an instance method (the contract before issue 18).
    """
    if not isinstance(inspect.getattr_static(p.cls, "reference"), classmethod):
        raise DtbenchError(
            f"decoder '{p.spec.name}' ({p.cls.__name__}) defines reference() as an instance method; "
            f"it must be a classmethod reference(cls, params) (see dtbench.decoders.base.Decoder)"
        )
    declared = p.cls.reference(p.params)
    if declared is None and p.execution == "compiled" and p.cls.lossless:
        # A compiled decoder with no reference of its own (ar) is checked against itself run eager (issue 46
        # item 6): the same configuration in the one execution every reference runs in.
        return p.spec.name, dict(p.spec.params)
    return declared


def _reference_order(plans: list[CellPlan]) -> list[CellPlan]:
    by_label = {p.spec.display: p for p in plans}
    ordered: list[CellPlan] = []
    seen: set[str] = set()

    def visit(p: CellPlan, stack: tuple[str, ...] = ()) -> None:
        if p.spec.display in seen:
            return
        if p.spec.display in stack:
            raise DtbenchError(f"decoder references form a cycle: {' -> '.join(stack)}")
        if p.reference_label:
            visit(by_label[p.reference_label], stack + (p.spec.display,))
        seen.add(p.spec.display)
        ordered.append(p)

    referenced = {p.reference_label for p in plans if p.reference_label}
    for p in [p for p in plans if p.spec.display in referenced] + plans:
        visit(p)
    return ordered
