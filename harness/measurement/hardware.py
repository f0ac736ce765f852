"""A worker's hardware facts and the compile step (split from :mod:`dtbench.harness.measurement.cells`, issue 58 item 7):
:class:`Hardware` (the roofline's inputs: memory bandwidth, model bytes; the compiled execution every compiled cell
of the worker shares) and :func:`compile_decoder`, the compile step of a compiled cell and of the conformance kit's
``compiled_equals_eager`` check (one code path, so the kit holds a decoder to exactly the buckets a cell compiles).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dtbench.decoders import base, draft_region, static_kv
from dtbench.harness.calibration import roofline
from dtbench.harness.execution.deadline import Deadline
from dtbench.harness.suites.plan import CellPlan, Plan
from dtbench.harness.suites.suite import Suite

__all__ = ["COMPILE_PHASE", "Hardware", "compile_decoder"]


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
