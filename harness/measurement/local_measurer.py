"""The local measurer (split from :mod:`dtbench.harness.measurement.cells`, issue 58 item 7; the served one is
:mod:`dtbench.harness.serving.measurer`): dtbench's own decoders on the loaded models, a prompt group's rows through
the one timing loop (:func:`~dtbench.harness.measurement.measure.measure_rows`), under the cell's limits
(:func:`~dtbench.harness.execution.deadline.cpu_timeout`), in the worker's compiled execution for a compiled cell (its compile
step first: :meth:`~dtbench.harness.measurement.hardware.Hardware.compile_step`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtbench.decoders import static_kv
from dtbench.harness.data import selection
from dtbench.harness.errors import clip, error_line
from dtbench.harness.execution.deadline import Deadline, cpu_timeout
from dtbench.harness.measurement import lossless
from dtbench.harness.measurement.hardware import COMPILE_PHASE, Hardware
from dtbench.harness.measurement.measure import SampleTimeout, measure_rows
from dtbench.harness.measurement.measurers import Batch, CellError, Measured, Observed, Outcome, measure_outcome
from dtbench.harness.measurement.sample import Reference
from dtbench.harness.models import loading as models
from dtbench.harness.suites.plan import CellPlan, PromptGroup
from dtbench.harness.suites.suite import Suite

__all__ = ["LocalMeasurer", "LocalState", "make_decoder", "measure_cell", "sampling_for", "unit_of"]


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
    """The local :class:`~dtbench.harness.measurement.measurers.Measurer`: dtbench's own decoders on the loaded models, a group's
    B prompts decoded together (B = 1: one prompt, ``generate``; B > 1: ``generate_batch``) through the one timing
    loop (:func:`~dtbench.harness.measurement.measure.measure_rows`).

    Every row becomes its own samples row (its own tokens, TTFT, TPOT, acceptance, output check); at B > 1 its
    :class:`~dtbench.harness.measurement.measurers.Batch` is the group (first prompt index, rows, the batch's wall time). The
    output check is per row: the reference's row (the reference decoder at the same B) for ``first_divergence``, and
    the tie-aware teacher-forced check of every emitted token of each row (:func:`lossless.sample_columns`, batch 1,
    the other rows as companions at B > 1), outside the timed region.

    Args:
        target, draft: :class:`~dtbench.harness.models.loading.LoadedModel` (draft may be None); device: theirs.
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
            if (
                cp.sampling is not None
            ):  # at B > 1 only for batch_sampling decoders (plan_checks); rows share the generator
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
            raise CellError(timed_out(unit_of(prompts, group), timeout, cpu_limit, phase)) from None

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
    (:func:`~dtbench.harness.measurement.measurers.measure_outcome`); never raises for what the decoder does wrong (its error
    comes back in the :class:`Outcome`). Arguments as :class:`LocalMeasurer` and :meth:`LocalMeasurer.measure`."""
    measurer = LocalMeasurer(target, draft, device, suite, stop_at_eos, data_dir, hardware)
    return measure_outcome(measurer, cp, prompts, group, ref, compare)


def timed_out(where: str, timeout: float | None, cpu_limit: float | None, phase: str) -> str:
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
