"""The plan's capability checks (split from :mod:`dtbench.harness.suites.plan`): batch sizes B > 1 only where a decoder
declares ``batching``, compiled execution only where it declares ``compiles``; each refusal one line naming the
decoder and what to change."""

from __future__ import annotations

from typing import Any

from dtbench.harness.data import datasets as data
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.suites.grouping import CellKey
from dtbench.harness.suites.suite import DatasetSpec, Suite


def check_batching(suite: Suite, plans: list[Any]) -> None:
    """Batch sizes B > 1 only for decoders that declare ``batching`` (a capability), greedy, on raw-text datasets
    with at least B measured prompts (prompts - warmup; issue 42 item 7: a larger B measures only a remainder group,
    which every report leaves out; question datasets count their questions only when loaded, and are not checked).

    Raises:
        DtbenchError: one line naming the decoder (or dataset) and what to change.
    """
    for p in plans:
        sizes = sorted({k.batch_size for k in p.points if k.batch_size > 1})
        if not sizes:
            continue
        where = f"{p.spec.where}: " if p.spec.where else ""
        name = clip(p.spec.display, 80)
        if not p.cls.batching:
            raise DtbenchError(
                f"{where}decoder '{name}' cannot decode batches (its class does not declare batching); "
                f"restrict it with `batch_sizes: [1]` or drop batch sizes {sizes} from the suite"
            )
        if why := p.cls.batching_error(p.params):
            raise DtbenchError(f"{where}decoder '{name}': {why}; restrict it with `batch_sizes: [1]`")
        if p.sampling is not None and not p.cls.batch_sampling:
            raise DtbenchError(
                f"{where}decoder '{name}': batch sizes {sizes} decode greedily only (its class does not declare "
                f"batch_sampling); set `sampling: greedy` on it or `batch_sizes: [1]`"
            )
    for ds in suite.datasets:  # a batch size above the measured prompts has no full batch: nothing to report at B
        used = sorted({k.batch_size for p in plans for k in p.points if k.dataset == ds.key and k.batch_size > 1})
        measured = ds.prompts - ds.warmup
        if not data.is_chat(ds) and used and used[-1] > measured:
            where = f"{ds.where}: " if ds.where else ""
            raise DtbenchError(
                f"{where}dataset '{clip(ds.name, 60)}': batch size {used[-1]} is larger than its {measured} measured "
                f"prompts (prompts {ds.prompts} - warmup {ds.warmup}), so no full batch would be measured; raise "
                f"prompts: to at least {ds.warmup + used[-1]} or drop the batch size"
            )
        if data.is_chat(ds) and any(
            p.points
            & {
                CellKey(ds.key, c, T, B)
                for c in ds.l_maxes
                for T in suite.generation_lengths
                for B in suite.batch_sizes
                if B > 1
            }
            for p in plans
        ):
            if _single_turn(ds):
                continue  # single-turn questions (every Spec-Bench group but mt_bench): grouped in order
            where = f"{ds.where}: " if ds.where else ""
            raise DtbenchError(
                f"{where}dataset '{clip(ds.name, 60)}' has multi-turn questions (later turns are "
                f"prompted with earlier answers); batch sizes > 1 need single-turn questions (leave "
                f"out mt_bench with `categories:`) or a raw-text dataset"
            )


def check_execution(plans: list[Any]) -> None:
    """Compiled execution only for decoders that declare ``compiles`` (a capability), eager only for params with an
    eager form (:meth:`~dtbench.decoders.base.Decoder.eager_error`); compiled at every batch size the
    decoder batches at (issue 46 item 6: a batch runs on a batch-B static cache, :class:`~dtbench.decoders.kv.RaggedBatch`).

    Raises:
        DtbenchError: one line naming the decoder and what to change.
    """
    for p in plans:
        where = f"{p.spec.where}: " if p.spec.where else ""
        name = clip(p.spec.display, 80)
        if p.execution != "compiled":
            if why := p.cls.eager_error(p.params):
                raise DtbenchError(f"{where}decoder '{name}': {why}; set `execution: [compiled]` on it")
            continue
        if not p.cls.compiles:
            raise DtbenchError(
                f"{where}decoder '{name}' cannot run compiled (its class does not declare compiles); "
                f"restrict it with `execution: [eager]`"
            )
        if why := p.cls.compile_error(p.params):
            raise DtbenchError(f"{where}decoder '{name}': {why}; restrict it with `execution: [eager]`")


def _single_turn(ds: DatasetSpec) -> bool:
    """Whether a question entry holds single-turn questions only: Spec-Bench's own file (no ``path:``) with
    ``categories:`` that leave out MT-bench (its only group with second turns)."""
    if ds.name != "spec-bench" or ds.path is not None or not ds.categories:
        return False
    from dtbench.harness.data.questions import GROUPS

    return not any(c == "mt_bench" or c in GROUPS["mt_bench"] for c in ds.categories)
