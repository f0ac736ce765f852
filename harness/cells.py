"""Measuring one prompt group's cells (split from :mod:`dtbench.harness.worker`, which owns the models): the per-sample
time limits, a worker's :class:`Hardware` (the roofline's inputs and the compile step of compiled cells), the local
measurer, and :func:`run_group`.

:func:`run_group` yields one :class:`~dtbench.harness.measurers.Outcome` per decoder as soon as it is measured: each
cell by one :class:`~dtbench.harness.measurers.Measurer` (:class:`LocalMeasurer`: dtbench's own decoders through the
one timing loop :func:`dtbench.harness.measure.measure_rows`, B = 1 a group of one; the served measurer of
:mod:`dtbench.harness.serving.measurer` for a server's requests), then one shared tail
(:func:`~dtbench.harness.measurers.measure_outcome`: rows, batch columns, record, the one-line error). Nothing here
touches the database: the driver (:mod:`dtbench.harness.runner`) commits what it yields.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dtbench.decoders import base, draft_region, static_kv
from dtbench.harness import data, load, lossless, models, roofline, selection
from dtbench.harness.deadline import Deadline
from dtbench.harness.errors import clip, error_line
from dtbench.harness.measure import SampleTimeout, measure_rows
from dtbench.harness.measurers import (
    Batch,
    CellError,
    Measured,
    Measurer,
    Observed,
    Outcome,
    measure_outcome,
    measurer_name,
)
from dtbench.harness.plan import CellPlan, Plan, PromptGroup
from dtbench.harness.sample import Reference
from dtbench.harness.suite import Suite

__all__ = [  # Outcome lives in harness/measurers.py since issue 49; executors, the runner and isolation import it here
    "AUTO_TIMEOUT_FACTOR",
    "AUTO_TIMEOUT_MIN_S",
    "AUTO_TIMEOUT_REFERENCE_S",
    "Hardware",
    "LocalMeasurer",
    "LocalState",
    "Outcome",
    "cpu_timeout",
    "make_decoder",
    "measure_cell",
    "run_group",
    "sample_timeout",
    "sampling_for",
]


AUTO_TIMEOUT_FACTOR, AUTO_TIMEOUT_MIN_S, AUTO_TIMEOUT_REFERENCE_S = 10.0, 60.0, 1800.0


def sample_timeout(setting: float | str | None, reference_s: float | None) -> float | None:
    """The time limit of one sample in seconds (suite ``timeout_s``).

    ``auto``: 10x the reference decoder's time on the same prompt, at least 60 s; a reference itself (or a
    decoder whose reference time is unknown) gets 1800 s. A number is used as is; None means no limit.
    """
    if setting is None:
        return None
    if setting != "auto":
        return float(setting)
    if reference_s is None:
        return AUTO_TIMEOUT_REFERENCE_S
    return max(AUTO_TIMEOUT_MIN_S, AUTO_TIMEOUT_FACTOR * reference_s)


def cpu_timeout(
    setting: float | str | None, reference_s: float | None, reference_cpu_s: float | None
) -> tuple[float | None, float | None]:
    """(wall limit, CPU limit) of one sample in seconds: ``auto`` measured in CPU time when the reference's is known.

    On a shared machine the wall time of a sample stretches with whatever else runs, so ``10x the reference's wall
    time`` failed cells that would have finished when the load rose between the reference and the decoder (issue
    19: ``hf_assisted`` past 60 s while ``ar`` took 4.2 s). The process's CPU time stretches far less with the load:
    ``auto`` with the reference's CPU time gives the decoder 10x that (at least 60 s) of CPU time, and keeps a wall
    limit of max(1800 s, 10x the reference's wall time) for a decoder that blocks without computing. A number, None,
    or a reference measured without CPU time (a resumed run's stored samples): :func:`sample_timeout`, wall only.
    """
    if setting != "auto" or reference_s is None or reference_cpu_s is None:
        return sample_timeout(setting, reference_s), None
    return (
        max(AUTO_TIMEOUT_REFERENCE_S, AUTO_TIMEOUT_FACTOR * reference_s),
        max(AUTO_TIMEOUT_MIN_S, AUTO_TIMEOUT_FACTOR * reference_cpu_s),
    )


@dataclass
class Hardware:
    """A worker's per-run facts for issue 37: the roofline's inputs and the compiled execution of compiled cells.

    Attributes:
        bandwidth: the device's measured memory bandwidth, bytes/s (:func:`roofline.measure_bandwidth`), or None.
        target_bytes, draft_bytes: :func:`roofline.model_bytes` of the loaded models (None: no such model).
        execution: the :class:`~dtbench.decoders.static_kv.Execution` every compiled cell of this worker shares (its
            compiled graphs and static caches), None when the plan has no compiled cell.
        compiled: label -> (compile seconds, graphs) of the compiled cells whose compile step already ran here.
    """

    bandwidth: float | None = None
    bandwidth_info: dict[str, Any] | None = None  # the copy benchmark's result (method; on CUDA NVML's figure too)
    target_bytes: dict[str, int] | None = None
    draft_bytes: dict[str, int] | None = None
    execution: static_kv.Execution | None = None
    compiled: dict[str, tuple[float, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: Plan, suite: Suite, target, draft, device) -> Hardware:
        """Measure the bandwidth, size the models, and make the compiled execution when a cell needs one."""
        compiled = [p for p in plan.decoders if p.execution == "compiled"]
        execution = None
        if compiled:
            largest = max(p.cls.cache_headroom(p.params) for p in compiled)
            longest = max(l_max for ds in suite.datasets for l_max in ds.l_maxes) + max(suite.generation_lengths)
            width = 2 * (static_kv.bucket(largest) or largest)
            execution = static_kv.Execution(-(-(longest + width) // 64) * 64)
        measured = roofline.measure_bandwidth(device)
        return cls(
            bandwidth=measured["bytes_per_s"],
            bandwidth_info=measured,
            target_bytes=roofline.model_bytes(target.model),
            draft_bytes=roofline.model_bytes(draft.model) if draft is not None else None,
            execution=execution,
        )

    def compile_step(
        self, cp: CellPlan, decoder, rows: list, T: int, models_: list, timeout_s: float | None = None
    ) -> tuple[float, int] | None:
        """The compile step of a compiled cell, once per worker, before its first sample (the warmup's): the
        buckets of the forward sizes the decoder declares for each model it uses compiled
        (:meth:`~dtbench.decoders.base.Decoder.compiled_sizes`, by default every bucket up to its largest verification;
        :meth:`~dtbench.decoders.static_kv.Execution.precompile`), then the decoder run once on the prompt for up to 16
        tokens (shapes only its own loop makes: transformers' compiled ``generate``), untimed and not stored. That run
        is the decoder's code, so it runs under the cell's wall-time limit ``timeout_s`` (seconds; None: none).

        Returns:
            (seconds, graphs torch.compile made) the first time for ``cp``'s label at this batch size, else None.

        Raises:
            SampleTimeout: the decoder's run took longer than ``timeout_s``.
        """
        key = cp.label if len(rows) == 1 else f"{cp.label} B={len(rows)}"
        if self.execution is None or key in self.compiled:
            return None
        self.compiled[key] = compile_decoder(self.execution, decoder, rows, T, models_, timeout_s)
        return self.compiled[key]

    def roofline_of(self, m, total_s: float, uses_draft: bool) -> float | None:
        """The roofline fraction of one measurement (:func:`roofline.sample_fraction`)."""
        return roofline.sample_fraction(
            m.records, total_s, self.target_bytes, self.draft_bytes if uses_draft else None, self.bandwidth
        )


COMPILE_PHASE = "in the compile step"  # how a time-out of the compile step names it (issue 59 item 8)


def compile_decoder(
    execution: static_kv.Execution, decoder, rows: list, T: int, models_: list, timeout_s: float | None = None
) -> tuple[float, int]:
    """The compile step of a compiled cell (:meth:`CellContext.compile_step`) and of the conformance kit's
    ``compiled_equals_eager`` check (:mod:`dtbench.testing`): the same code, so the kit holds a decoder to exactly
    the buckets a cell compiles.

    Args:
    execution: the compiled execution (static caches, bucketed forwards).
    decoder: the bound decoder (its class's ``compiled_sizes``/``compiled_chains`` of its params are read).
    rows: the prompt ids of the batch (B = len(rows)); T: new tokens (the untimed run decodes min(T, 16)).
    models_: [target] or [target, draft].
    timeout_s: the wall-time limit of the decoder's own run, seconds (None: none).

    Returns:
    (seconds, graphs torch.compile made).

    Raises:
    SampleTimeout: the decoder's run took longer than ``timeout_s``.
    """
    cls, params = type(decoder), decoder.params
    t0, graphs0 = base.clock(), static_kv.compiled_graphs()
    largest = max(cls.verify_sizes(params))
    target_sizes, draft_sizes = cls.compiled_sizes(params)  # only the buckets the cell uses (issue 46)
    if target_sizes != ():  # the target verifies the batch together
        execution.precompile(models_[:1], largest, target_sizes, batch=len(rows))
    if len(models_) > 1 and draft_sizes != ():  # a draft model drafts each row with its own cache
        execution.precompile(models_[1:], largest, draft_sizes)
    if len(models_) > 1 and len(rows) == 1:  # draft chains run as one compiled region (B = 1, issue 46 item 2)
        for k in cls.compiled_chains(params):
            draft_region.precompile_chain(execution, models_[1], k)
    with static_kv.compiled(execution), Deadline(timeout_s, phase=COMPILE_PHASE):
        execution.begin_sample()
        device = models_[0].device
        if len(rows) > 1:  # a batch compiles its (B, bucket) graphs: the decoder's batched loop, as measured
            for _ in decoder.generate_batch([torch.as_tensor([list(r)], device=device) for r in rows], min(T, 16)):
                pass
        else:
            n = 0
            for step in decoder.generate(torch.as_tensor([list(rows[0])], device=device), min(T, 16)):
                n += len(step.tokens)
                if n >= min(T, 16):
                    break
    return base.clock() - t0, static_kv.compiled_graphs() - graphs0


def make_decoder(cp: CellPlan, target, draft, suite: Suite, data_dir: str | None = None):
    """The decoder of ``cp`` bound to the loaded models (torch seeded with the suite's seed first), its declared
    corpus (:meth:`Decoder.corpus_of`), held out from the suite's prompts with the suite's seed, handed to it."""
    torch.manual_seed(suite.seed)
    decoder = cp.cls(target.model, draft.model if (draft and cp.cls.needs_draft) else None, cp.params)
    corpus = cp.cls.corpus_of(cp.params)
    if corpus is not None:
        tokenizer = getattr(target.model.config, "name_or_path", "") or ""
        decoder.use_corpus(selection.corpus_documents(corpus, tokenizer, suite.seed, data_dir))
    return decoder


@dataclass(frozen=True)
class LocalState:
    """What the local measurer's :meth:`LocalMeasurer.finish` needs of one measurement (issue 58 item 4: a typed
    value, not a dict): the rows' prompt token ids (the lossless check's companions at B > 1), whether the rows were
    decoded as one batch, and the graphs torch.compile made during the sample (a compiled cell; None: eager)."""

    ids: list[Sequence[int]]
    batched: bool
    recompiles: int | None = None


class LocalMeasurer:
    """The local :class:`~dtbench.harness.measurers.Measurer`: dtbench's own decoders on the loaded models, a group's
    B prompts decoded together (B = 1: one prompt, ``generate``; B > 1: ``generate_batch``) through the one timing
    loop (:func:`~dtbench.harness.measure.measure_rows`).

    Every row becomes its own samples row (its own tokens, TTFT, TPOT, acceptance, output check); at B > 1 its
    :class:`~dtbench.harness.measurers.Batch` is the group (first prompt index, rows, the batch's wall time). The
    output check is per row: the reference's row (the reference decoder at the same B) for ``first_divergence``, and
    the tie-aware teacher-forced check of every emitted token of each row (:func:`lossless.sample_columns`, batch 1,
    the other rows as companions at B > 1), outside the timed region.

    Args:
        target, draft: :class:`~dtbench.harness.models.LoadedModel` (draft may be None); device: theirs.
        stop_at_eos: end the generation at the target's first EOS (:func:`models.eos_token_id`), T at most.
        data_dir: the run's data folder, where a corpus the decoder declares (:meth:`Decoder.corpus_of`) is read:
            its documents, held out from the suite's prompts with the suite's seed, are handed to the decoder
            (:meth:`Decoder.use_corpus`) before timing starts.
        hardware: the worker's :class:`Hardware`: each sample's roofline fraction (the batch's forwards, weights once
            each, over the row's own time); for a compiled cell its compile step (per batch size) (before its first sample,
            timed apart as ``compile_s``) and the compiled execution it runs in, with the graphs torch.compile made
            during the sample stored as ``step_stats["compiled"]["recompiles"]``.
    """

    def __init__(
        self,
        target,
        draft,
        device,
        suite: Suite,
        stop_at_eos: bool = False,
        data_dir: str | None = None,
        hardware: Hardware | None = None,
    ):
        self.target, self.draft, self.device, self.suite = target, draft, device, suite
        self.stop_at_eos, self.data_dir, self.hardware = stop_at_eos, data_dir, hardware

    def measure(
        self, cp: CellPlan, prompts: list, group: PromptGroup, ref: Reference | None, compare: bool
    ) -> Measured[LocalState]:
        """The group's rows through the one timing loop, under the cell's limits (:func:`cpu_timeout`).

        Raises:
            CellError: the decoder ran past its limit (while made, compiled or measured).
        """
        timeout, cpu_limit = cpu_timeout(self.suite.timeout_s, ref.total_s if ref else None, ref.cpu_s if ref else None)
        phase = " (making the decoder)"
        try:
            # the decoder's own code (its constructor, use_corpus) under the cell's limit too
            with Deadline(timeout, phase="making the decoder"):
                decoder = make_decoder(cp, self.target, self.draft, self.suite, self.data_dir)
            phase = ""
            if cp.sampling is not None:  # greedy only at B > 1 (plan._check_batching)
                decoder.sampling, decoder.generator = sampling_for(
                    cp.sampling, self.suite.seed, prompts[0].index, self.device
                )
            if self.stop_at_eos:
                decoder.eos_token_id = models.eos_token_id(self.target.model)
            hw = self.hardware
            ex = hw.execution if hw is not None and cp.execution == "compiled" else None
            if ex is not None:  # at every batch size (a batch of B rows: its own (B, bucket) graphs)
                phase = f" ({COMPILE_PHASE})"
                rows = [p.token_ids for p in prompts]
                compiled = hw.compile_step(cp, decoder, rows, group.gen_length, self._used(cp), timeout)  # type: ignore[union-attr]
                phase = ""
                return self._rows(cp, decoder, prompts, group, ref, compare, (timeout, cpu_limit), ex, compiled)
            return self._rows(cp, decoder, prompts, group, ref, compare, (timeout, cpu_limit), None, None)
        except SampleTimeout:
            raise CellError(_timed_out(unit_of(prompts, group), timeout, cpu_limit, phase)) from None

    def _used(self, cp: CellPlan) -> list:
        """The models a cell's decoder runs: the target, and the draft where it needs one."""
        draft = self.draft
        return [self.target.model] + ([draft.model] if draft is not None and cp.cls.needs_draft else [])

    def _rows(self, cp, decoder, prompts, group, ref, compare, limits, ex, compiled) -> Measured[LocalState]:
        """The timed rows (in the compiled execution ``ex`` when not None) as observations."""
        batched = group.batch_size > 1
        ids = [p.token_ids for p in prompts]
        timeout, cpu_limit = limits
        run = dict(timeout_s=timeout, cpu_timeout_s=cpu_limit, batched=batched)
        recompiles = None
        if ex is not None:
            graphs0 = static_kv.compiled_graphs()
            with static_kv.compiled(ex):
                ex.begin_sample()
                ms = measure_rows(decoder, ids, group.gen_length, self.device, **run)
            recompiles = static_kv.compiled_graphs() - graphs0
        else:
            ms = measure_rows(decoder, ids, group.gen_length, self.device, **run)
        batch = Batch(group.prompt_index, len(prompts), max(m.step_times[-1] for m in ms)) if batched else None
        rows = [
            Observed(m, prompt, ref.tokens[r] if ref and compare else None, batch)
            for r, (m, prompt) in enumerate(zip(ms, prompts))
        ]
        state = LocalState(ids, batched, recompiles)
        return Measured(rows, cpu_s=ms[0].cpu_s, compile=compiled, state=state)

    def finish(self, cp: CellPlan, measured: Measured[LocalState], r: int, row: Mapping[str, Any]) -> dict[str, Any]:
        """Row ``r``'s columns added by this measurer, returned (the row is not edited; issue 58 item 4): its
        roofline fraction, its ``step_stats`` with the compile statistics (a compiled cell: ``compiled.recompiles``,
        the graphs torch.compile made during the sample) and the lossless check of every emitted token (a greedy
        lossless decoder only; outside the timed region)."""
        out: dict[str, Any] = {}
        observed, state = measured.rows[r], measured.state
        assert state is not None, "the local measurer's own Measured"
        if self.hardware is not None:
            out["roofline"] = self.hardware.roofline_of(observed.observation, row["total_s"], cp.cls.needs_draft)
        if state.recompiles is not None:
            out["step_stats"] = {**row["step_stats"], "compiled": {"recompiles": state.recompiles}}
        if cp.cls.lossless and cp.sampling is None:
            others = [list(p) for j, p in enumerate(state.ids) if j != r] if state.batched else None
            out.update(
                lossless.sample_columns(
                    self.target.model,
                    list(observed.prompt.token_ids),
                    dict(row),
                    observed.reference,
                    self.device,
                    self.suite.lossless_check,
                    companions=others,
                )
            )
        return out

    def failure(self, cp: CellPlan, prompts: list, group: PromptGroup, exc: BaseException) -> str:
        """``<prompt or group>: <the error's line>``; a decoder calling ``sys.exit`` says so."""
        where = unit_of(prompts, group)
        if isinstance(exc, SystemExit):
            return f"{where}: SystemExit (the decoder called sys.exit): {clip(exc, 1500)}"
        return f"{where}: {error_line(exc)}"


def unit_of(prompts: list, group: PromptGroup) -> str:
    """How a local cell's error names the group: ``prompt i``, or ``prompts i-j (B=b)`` for a batch."""
    if group.batch_size > 1:
        return f"prompts {group.prompt_indices[0]}-{group.prompt_indices[-1]} (B={group.batch_size})"
    return f"prompt {prompts[0].index}"


def measure_cell(
    cp: CellPlan,
    prompts: list,
    group: PromptGroup,
    ref: Reference | None,
    target,
    draft,
    device,
    suite: Suite,
    compare: bool = True,
    stop_at_eos: bool = False,
    data_dir: str | None = None,
    hardware: Hardware | None = None,
) -> Outcome:
    """Measure one decoder on a prompt group with the :class:`LocalMeasurer` and the shared tail
    (:func:`~dtbench.harness.measurers.measure_outcome`); never raises for what the decoder does wrong (its error
    comes back in the :class:`Outcome`). Arguments as :class:`LocalMeasurer` and :meth:`LocalMeasurer.measure`."""
    measurer = LocalMeasurer(target, draft, device, suite, stop_at_eos, data_dir, hardware)
    return measure_outcome(measurer, cp, prompts, group, ref, compare)


def _timed_out(where: str, timeout: float | None, cpu_limit: float | None, phase: str) -> str:
    """The error of a cell whose decoder ran past its limit (``phase``: where, outside the sample: the CPU limit
    only applies to samples)."""
    if cpu_limit and not phase:
        return f"{where}: timed out after ({cpu_limit:g} s of CPU time, 10x the reference's, or {timeout:g} s)"
    return f"{where}: timed out after {timeout:g} s{phase}"


def sampling_for(spec, suite_seed: int, prompt_index: int, device) -> tuple[Any, torch.Generator]:
    """(SamplingSettings, a generator seeded from the base seed and the prompt index) for one sample.

    The seed is ``base * 1_000_003 + prompt_index`` (base: the sampling block's ``seed``, else the suite's), so
    every prompt draws an independent, reproducible stream, whatever ran before it.
    """
    from dtbench.decoders.sampling import SamplingSettings

    base = spec.seed if spec.seed is not None else suite_seed
    generator = torch.Generator(device=device).manual_seed((base * 1_000_003 + prompt_index) % (1 << 63))
    return SamplingSettings(spec.temperature, spec.top_k, spec.top_p), generator


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
    cell by its :class:`~dtbench.harness.measurers.Measurer` (:func:`~dtbench.harness.measurers.measurer_name`: the
    :class:`LocalMeasurer`, or the served one for a decoder that declares ``requests``), then the one shared tail
    (:func:`~dtbench.harness.measurers.measure_outcome`).

    Args:
        group: the unit of work; prompt: its :class:`~dtbench.harness.prompt.Prompt` (when ``group.multi``, the
            list of its rows' prompts, decoded together).
        done: :class:`Reference` (per-row tokens, the group's seconds) of decoders already stored for this group (a
            resumed run): not re-measured, but available as references.
        skip: labels of cells that already failed: not measured.
        servers, tokenizer: the worker's server pool and the target's tokenizer, for served cells (at every B).
        hardware: the worker's :class:`Hardware` (roofline inputs, compiled execution), or None.
        announce: called with a decoder's label right before it is measured (crash isolation names the cell a
            dying process was measuring, :mod:`dtbench.harness.isolation`).
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
