"""Measuring one prompt group's cells (split from :mod:`dtbench.harness.worker`, which owns the models): the per-sample
time limits, the :class:`Outcome` of one decoder on one group, a worker's :class:`Hardware` (the roofline's inputs and
the compile step of compiled cells), and the measurement itself.

:func:`run_group` yields one :class:`Outcome` per decoder as soon as it is measured, :func:`measure_cell` times one
decoder on one prompt group, B = 1 a group of one (the one timing loop, :func:`dtbench.harness.measure.measure_rows`),
and never raises for a decoder's fault; :func:`measure_served` measures a server cell through requests. Nothing here
touches the database: the driver (:mod:`dtbench.harness.runner`) commits what it yields.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from dtbench.decoders import static_kv
from dtbench.harness import data, load, lossless, models, roofline, selection
from dtbench.harness.deadline import Deadline
from dtbench.harness.errors import clip, error_line
from dtbench.harness.measure import SampleTimeout, measure_rows
from dtbench.harness.measure import now as measure_now
from dtbench.harness.metrics import sample_row
from dtbench.harness.plan import CellPlan, Plan, PromptGroup
from dtbench.harness.sample import Reference, SampleRecord
from dtbench.harness.suite import Suite

if TYPE_CHECKING:
    from dtbench.decoders.server import ServerParams

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
class Outcome:
    """The result of one decoder on one prompt group: its samples rows (one per row; one at B = 1), or the error
    that fails the cell.

    Each row is a dict of ``samples`` columns (plain JSON-able values, so an executor can ship it between processes).
    """

    label: str
    rows: list[dict[str, Any]] | None = None
    error: str | None = None
    cpu_s: float | None = None  # the process's CPU seconds during the sample (the next decoders' timeout yardstick)
    load: dict[str, Any] | None = None  # the machine's load during the measurement (harness/load.py: span)
    compile_s: float | None = None  # compiled cells, first sample: seconds of the compile step before it (issue 37)
    compile_graphs: int | None = None  # graphs torch.compile made in that step

    def reference(self) -> Reference:
        """What a dependent decoder compares with: every row's output tokens, and the group's wall time (the batch's
        ``batch_total_s`` where the rows were decoded or paired together, else the one row's ``total_s``)."""
        assert self.rows is not None
        first = self.rows[0]
        total = first["batch_total_s"] if first.get("batch_total_s") is not None else first["total_s"]
        return Reference([r["output_tokens"] for r in self.rows], total, self.cpu_s)


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
        """The compile step of a compiled cell, once per worker, before its first sample (the warmup's): every
        bucket up to the cell's largest verification compiled for each model it uses
        (:meth:`~dtbench.decoders.static_kv.Execution.precompile`), then the decoder run once on the prompt for up to 16
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
        t0, graphs0 = measure_now(), static_kv.compiled_graphs()
        largest = max(cp.cls.verify_sizes(cp.params))
        self.execution.precompile(models_[:1], largest, batch=len(rows))  # the target verifies the batch together
        if len(models_) > 1:
            self.execution.precompile(models_[1:], largest)  # a draft model drafts each row with its own cache
        with static_kv.compiled(self.execution), Deadline(timeout_s):
            self.execution.begin_sample()
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
        self.compiled[key] = (measure_now() - t0, static_kv.compiled_graphs() - graphs0)
        return self.compiled[key]

    def roofline_of(self, m, total_s: float, uses_draft: bool) -> float | None:
        """The roofline fraction of one measurement (:func:`roofline.sample_fraction`)."""
        return roofline.sample_fraction(
            m.records, total_s, self.target_bytes, self.draft_bytes if uses_draft else None, self.bandwidth
        )


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
    """Measure one decoder on a prompt group, its B prompts decoded together (B = 1: one prompt, ``generate``;
    B > 1: ``generate_batch``) through the one timing loop (:func:`~dtbench.harness.measure.measure_rows`); never
    raises for what the decoder does wrong.

    Anything the decoder does wrong — raising, calling ``sys.exit``, yielding Steps that cannot become a sample,
    running past the time limit — comes back as an :class:`Outcome` with the error; only Ctrl-C propagates.
    Every row becomes its own samples row (its own tokens, TTFT, TPOT, acceptance, output check); at B > 1 plus
    the group's ``batch_group`` (first prompt index), ``batch_rows`` and ``batch_total_s`` (the batch's wall time).
    The output check is per row: the reference's row (the reference decoder at the same B) for
    ``first_divergence``, and the tie-aware teacher-forced check of every emitted token of each row
    (:func:`lossless.sample_columns`, batch 1, the other rows as companions at B > 1).

    Args:
        cp: the decoder's plan entry; prompts: the group's :class:`~dtbench.harness.prompt.Prompt` objects, in row
            order (one at B = 1); group: the unit of work (T, warmup, B).
        ref: the reference decoder's :class:`Reference` on this group (tokens: one list per row; total_s: the
            batch's wall time), or None for a reference itself.
        compare: check the output token for token against the reference's (False when either samples: a sampled
            output is checked as a distribution, by the tests, never against one draw; sampling is B = 1 only).
        stop_at_eos: end the generation at the target's first EOS (:func:`models.eos_token_id`), T at most.
        target, draft: :class:`~dtbench.harness.models.LoadedModel` (draft may be None).
        data_dir: the run's data folder, where a corpus the decoder declares (:meth:`Decoder.corpus_of`) is read:
            its documents, held out from the suite's prompts with the suite's seed, are handed to the decoder
            (:meth:`Decoder.use_corpus`) before timing starts.
        hardware: the worker's :class:`Hardware`: each sample's roofline fraction (the batch's forwards, weights once
            each, over the row's own time); for a compiled cell (B = 1) its compile step (before its first sample,
            timed apart as ``compile_s``) and the compiled execution it runs in, with the graphs torch.compile made
            during the sample stored as ``step_stats["compiled"]["recompiles"]``.
    """
    batched = group.batch_size > 1
    where = (
        f"prompts {group.prompt_indices[0]}-{group.prompt_indices[-1]} (B={group.batch_size})"
        if batched
        else f"prompt {prompts[0].index}"
    )
    if cp.reference_label and ref is None:
        what = f"the prompt group {group.prompt_index}" if batched else f"prompt {prompts[0].index}"
        return Outcome(cp.label, error=f"reference decoder '{cp.reference_label}' has no output for {what}")
    timeout, cpu_limit = cpu_timeout(suite.timeout_s, ref.total_s if ref else None, ref.cpu_s if ref else None)
    T = group.gen_length
    ids = [p.token_ids for p in prompts]
    compiled, phase = None, " (making the decoder)"
    try:
        with Deadline(timeout):  # the decoder's own code (its constructor, use_corpus) under the cell's limit too
            decoder = make_decoder(cp, target, draft, suite, data_dir)
        phase = ""
        if cp.sampling is not None:  # greedy only at B > 1 (plan._check_batching)
            decoder.sampling, decoder.generator = sampling_for(cp.sampling, suite.seed, prompts[0].index, device)
        if stop_at_eos:
            decoder.eos_token_id = models.eos_token_id(target.model)
        ex = hardware.execution if hardware is not None and cp.execution == "compiled" else None
        if ex is not None:  # at every batch size (a batch of B rows: its own (B, bucket) graphs)
            used = [target.model] + ([draft.model] if draft is not None and cp.cls.needs_draft else [])
            phase = " (in the compile step)"
            compiled = hardware.compile_step(cp, decoder, ids, T, used, timeout)  # type: ignore[union-attr]
            phase = ""
            graphs0 = static_kv.compiled_graphs()
            with static_kv.compiled(ex):
                ex.begin_sample()
                ms = measure_rows(decoder, ids, T, device, timeout_s=timeout, cpu_timeout_s=cpu_limit, batched=batched)
            recompiles = static_kv.compiled_graphs() - graphs0
        else:
            ms = measure_rows(decoder, ids, T, device, timeout_s=timeout, cpu_timeout_s=cpu_limit, batched=batched)
        wall = max(m.step_times[-1] for m in ms)
        rows = []
        for r, (m, prompt) in enumerate(zip(ms, prompts)):
            reference = ref.tokens[r] if ref and compare else None
            row = sample_row(m, prompt, group.warmup, reference)
            if batched:
                row.update(batch_group=group.prompt_index, batch_rows=len(prompts), batch_total_s=wall)
            if hardware is not None:
                row["roofline"] = hardware.roofline_of(m, row["total_s"], cp.cls.needs_draft)
            if ex is not None:
                row["step_stats"]["compiled"] = {"recompiles": recompiles}
            if cp.cls.lossless and cp.sampling is None:  # every emitted token checked, outside the timed region
                others = [p for j, p in enumerate(ids) if j != r] if batched else None
                row.update(
                    lossless.sample_columns(
                        target.model, prompt.token_ids, row, reference, device, suite.lossless_check, companions=others
                    )
                )
            rows.append(SampleRecord.from_row(row).as_row())  # exactly the sample's columns (harness/sample.py)
        json.dumps(rows)  # the JSON columns must serialize: a bad Step is the decoder's failure, not the run's
    except KeyboardInterrupt:
        raise
    except SampleTimeout:
        return Outcome(cp.label, error=_timed_out(where, timeout, cpu_limit, phase))
    except (Exception, SystemExit) as exc:  # a decoder failing mid-run fails its cell, never the run
        if isinstance(exc, SystemExit):
            return Outcome(cp.label, error=f"{where}: SystemExit (the decoder called sys.exit): {clip(exc, 1500)}")
        return Outcome(cp.label, error=f"{where}: {error_line(exc)}")
    outcome = Outcome(cp.label, rows=rows, cpu_s=ms[0].cpu_s)
    if compiled is not None:
        outcome.compile_s, outcome.compile_graphs = compiled
    return outcome


def _timed_out(where: str, timeout: float | None, cpu_limit: float | None, phase: str) -> str:
    """The error of a cell whose decoder ran past its limit (``phase``: where, outside the sample: the CPU limit
    only applies to samples)."""
    if cpu_limit and not phase:
        return f"{where}: timed out after ({cpu_limit:g} s of CPU time, 10x the reference's, or {timeout:g} s)"
    return f"{where}: timed out after {timeout:g} s{phase}"


def measure_served(
    cp: CellPlan,
    prompts: list,
    group: PromptGroup,
    ref_rows: list[dict] | None,
    suite: Suite,
    servers,
    tokenizer,
    stop_at_eos: bool = False,
) -> Outcome:
    """Measure a server cell (a decoder declaring ``requests``, issue 30) on one prompt group through requests
    (:func:`dtbench.harness.serving.measure_requests`); never raises for what the server does wrong (as
    :func:`measure_cell`): a server that does not start, exits, or answers with an error fails its cell with one line
    naming the server and its log.

    Args:
        prompts: the group's prompts in row order (one at B = 1).
        ref_rows: the reference server's rows on this group (their output tokens), or None.
        servers: the worker's :class:`~dtbench.harness.serving.ServerPool`.
    """
    from dtbench.harness import serving

    if cp.reference_label and ref_rows is None:
        return Outcome(
            cp.label, error=f"reference decoder '{cp.reference_label}' has no output for prompt {group.prompt_index}"
        )
    batched = group.batch_size > 1  # rows paired per block of C prompts (serving.blocks_of); at C = 1 per prompt
    try:
        rows = serving.measure_requests(
            cp.label,
            cast("ServerParams", cp.params),  # a decoder declaring ``requests`` takes a server's params
            prompts,
            group.warmup,
            group.gen_length,
            group.batch_size,
            (group.dataset.name, group.l_max, group.gen_length, group.batch_size),
            servers,
            seed=suite.seed,
            stop_at_eos=stop_at_eos,
            references=[r["output_tokens"] for r in ref_rows] if ref_rows else None,
            reference=next(
                ((c.label, cast("ServerParams", c.params)) for c in group.decoders if c.label == cp.reference_label),
                None,
            ),
            rule=suite.lossless_check,
            tokenizer=tokenizer,
            batch_group=group.prompt_index if batched else None,
        )
        rows = [SampleRecord.from_row(row).as_row() for row in rows]
        json.dumps(rows)
    except KeyboardInterrupt:
        raise
    except (Exception, SystemExit) as exc:
        return Outcome(cp.label, error=error_line(exc))  # an exception group: its first real error (issue 50)
    return Outcome(cp.label, rows=rows)


def _served_reference(cp: CellPlan, served: dict[str, list[dict]], outputs: dict[str, Reference]) -> list[dict] | None:
    """The reference server's rows on this group: measured now, or read back from the database on a resumed run;
    None without a reference."""
    if not cp.reference_label:
        return None
    if cp.reference_label in served:
        return served[cp.reference_label]
    ref = outputs.get(cp.reference_label)
    if ref is None:
        return None
    return [{"output_tokens": t} for t in ref.tokens]


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
    """Measure a prompt group's decoders in order (references first), yielding each outcome as it is measured.

    Args:
        group: the unit of work; prompt: its :class:`~dtbench.harness.prompt.Prompt` (when ``group.multi``, the
            list of its rows' prompts, decoded together by :func:`measure_cell`).
        done: :class:`Reference` (per-row tokens, the group's seconds) of decoders already stored for this group (a
            resumed run): not re-measured, but available as references.
        skip: labels of cells that already failed: not measured.
        servers, tokenizer: the worker's server pool and the target's tokenizer, for server cells (decoders that
            declare ``requests``: :func:`measure_served`, at every B).
        hardware: the worker's :class:`Hardware` (roofline inputs, compiled execution), or None.
        announce: called with a decoder's label right before it is measured (crash isolation names the cell a
            dying process was measuring, :mod:`dtbench.harness.isolation`).
    """
    outputs = dict(done)
    served: dict[str, list[dict]] = {}  # server cells' rows of this group: a dependent server's reference rows
    stop = data.stops_at_eos(suite.stop_at_eos, group.dataset)
    prompts = prompt if group.multi else [prompt]
    by_label = {cp.label: cp for cp in group.decoders}
    for cp in group.decoders:
        if cp.label in outputs or cp.label in skip:
            continue
        ref = outputs.get(cp.reference_label) if cp.reference_label else None
        ref_plan = by_label.get(cp.reference_label) if cp.reference_label is not None else None
        compare = cp.sampling is None and (ref_plan is None or ref_plan.sampling is None)
        if announce is not None:
            announce(cp.label)
        start = load.probe()
        if cp.cls.requests:
            outcome = measure_served(
                cp, prompts, group, _served_reference(cp, served, outputs), suite, servers, tokenizer, stop
            )
            if outcome.rows is not None:
                served[cp.label] = outcome.rows
        else:
            outcome = measure_cell(
                cp, prompts, group, ref, target, draft, device, suite, compare, stop, data_dir, hardware
            )
        _finish(outcome, group, start)
        if outcome.rows is not None:
            outputs[cp.label] = outcome.reference()
        yield outcome


def _finish(outcome: Outcome, group: PromptGroup, start: load.Reading) -> None:
    """Stamp an outcome with its group's repeat (every row) and the machine's load since ``start``."""
    outcome.load = load.span(start, load.probe())
    for row in outcome.rows or []:
        row["repeat"] = group.repeat
