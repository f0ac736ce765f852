"""What a measurement observed, and the one row builder (:func:`sample_row`): the samples-table columns of one
decoder's measurement (:class:`Stepped`, a :class:`~dtbench.harness.measurement.measure.Measurement`'s Steps) or of one request to
a server (:class:`Served`). The definitions of every column are :mod:`dtbench.harness.measurement.metrics`'s docstring; the
metrics' names, units and aggregations are its :data:`~dtbench.harness.measurement.metrics.METRICS`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dtbench.harness.values import first_divergence

if TYPE_CHECKING:
    from dtbench.harness.data.prompt import Prompt


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import operator

            return operator.index(value)
        except TypeError:
            raise TypeError(f"Step.{what} must be an integer, got {value!r}") from None
    return value


def _clip100(text: str | None) -> str | None:
    return None if text is None else text[:100]


class Observation(Protocol):
    """What :func:`sample_row` takes: the first T output ``tokens`` of one decoder on one prompt and ``step_times``,
    seconds from the start (the call, or the send) to each observation that brought tokens. A
    :class:`~dtbench.harness.measurement.measure.Measurement` (Steps timed by :func:`~dtbench.harness.measurement.measure.measure_rows`) and
    a :class:`Served` request (network reads timed by the server client) differ in their counters (:meth:`counted`)."""

    @property
    def tokens(self) -> list[int]: ...
    @property
    def step_times(self) -> list[float]: ...

    def counted(self) -> dict[str, Any]:
        """The counter, memory and energy columns of the sample (``iterations`` >= 1, ``step_tokens``, ...)."""
        ...


class Stepped(Observation, Protocol):
    """A :class:`~dtbench.harness.measurement.measure.Measurement` as :func:`measured_columns` reads it (this module imports no
    ``measure``): its Steps, one StepRecord each, and its MemoryPeak."""

    @property
    def steps(self) -> Sequence[Any]: ...
    @property
    def records(self) -> Sequence[Any]: ...
    @property
    def memory(self) -> Any: ...


@dataclass(frozen=True)
class Served:
    """What the client saw of one request to a server (:mod:`dtbench.harness.serving`), timed by the harness's clock:
    the observation :func:`sample_row` takes beside a :class:`~dtbench.harness.measurement.measure.Measurement`.

    Attributes:
        tokens: the first T output token ids.
        step_times: seconds from the send to each network read that brought tokens (the first: TTFT; the last: the
            end-to-end latency); its iterations are those reads.
        step_tokens: the tokens each of those reads brought (client-side).
        drafted, accepted: drafted and accepted tokens the server reported for the request (0 when it reported none).
        steps: its target verification steps, reported or derived by its engine adapter; None when not reported.
        stats: its ``step_stats`` (``{"server": {...}}``: engine, load, latencies, counters, the check's rule).
    """

    tokens: list[int]
    step_times: list[float]
    step_tokens: list[int]
    drafted: int
    accepted: int
    steps: int | None
    stats: dict[str, Any]

    def counted(self) -> dict[str, Any]:
        """The server's reported totals as counter columns (:func:`reported_columns`)."""
        return reported_columns(self)


def measured_columns(m: Stepped) -> dict[str, Any]:
    """The counter, memory and energy columns of a measurement: from its Steps and the runner's hooks."""
    from dtbench.harness.measurement.energy import sample_columns

    iterations = len(m.steps)
    drafted = [_int(s.drafted, "drafted") for s in m.steps]
    accepted = [_int(s.accepted, "accepted") for s in m.steps]
    depth = [_int(s.depth, "depth") for s in m.steps]
    committed = [len(s.tokens) for s in m.steps]
    drafting = [i for i, d in enumerate(drafted) if d > 0]
    depth_sum = sum(depth)
    target_fw = [r.target_forwards for r in m.records]
    # counted from a self-drafting decoder's first draft forward on (issue 68 item 2): the steps before it drafted
    # nothing, 0; all None: no draft forwards counted (no draft model, no drafting)
    draft_counted = any(r.draft_forwards is not None for r in m.records)
    draft_fw = [r.draft_forwards or 0 for r in m.records] if draft_counted else [None for _ in m.records]
    return dict(
        iterations=iterations,
        drafted=sum(drafted),
        accepted=sum(accepted),
        draft_depth=depth_sum,
        acceptance_rate=sum(accepted) / depth_sum if depth_sum else None,
        acceptance_incl_bonus=sum(committed[i] for i in drafting) / depth_sum if depth_sum else None,
        mean_path_length=sum(accepted[i] for i in drafting) / len(drafting) if drafting else None,
        mean_path_length_all=sum(accepted) / iterations if drafting else None,
        target_forwards=sum(target_fw),
        draft_forwards=sum(draft_fw) if draft_counted else None,
        step_tokens=committed,
        step_stats={
            "drafted": drafted,
            "accepted": accepted,
            "depth": depth,
            "target_forwards": target_fw,
            "draft_forwards": draft_fw if draft_counted else None,
            "target_tokens": [r.target_tokens for r in m.records],
            "draft_tokens": [r.draft_tokens or 0 for r in m.records] if draft_counted else None,
            # per step, per forward in call order: [tokens fed n, KV positions before it, flags (measure.FED_*)]
            "target_fed": [getattr(r, "target_fed", None) or [] for r in m.records],
            "draft_fed": [getattr(r, "draft_fed", None) or [] for r in m.records] if draft_counted else None,
            # seconds inside the target's / draft's forward passes (hooks; the cost model's time decomposition)
            "forward_s": getattr(m, "forward_s", None),
            # the decoder's state after the sample (Decoder.state_stats: adjacency matrix, n-gram pool bytes...)
            "state": getattr(m, "state", None),
        },
        peak_rss_bytes=m.memory.rss_bytes,
        peak_allocated_bytes=m.memory.allocated_bytes,
        peak_nvml_bytes=m.memory.nvml_bytes,
        nvml_scope=getattr(m.memory, "nvml_scope", None),
        **sample_columns(getattr(m, "energy", None)),
    )


def reported_columns(m: Served) -> dict[str, Any]:
    """The counter columns of a served request: the server's reported totals (no per-step counters, no forwards
    counted by dtbench, no memory or energy of its own). A chain server drafts one token per drafted position, so
    its draft depth is its drafted tokens; ``mean_path_length`` = accepted / verification steps."""
    return dict(
        iterations=len(m.step_tokens),
        drafted=m.drafted,
        accepted=m.accepted,
        draft_depth=m.drafted,
        acceptance_rate=m.accepted / m.drafted if m.drafted else None,
        acceptance_incl_bonus=None,
        mean_path_length=m.accepted / m.steps if m.steps else None,
        mean_path_length_all=None,
        target_forwards=None,
        draft_forwards=None,
        step_tokens=m.step_tokens,
        step_stats=m.stats,
    )


def sample_row(m: Observation, prompt: Prompt, warmup: bool, reference: list[int] | None) -> dict[str, Any]:
    """The samples-table columns of one measurement, or of one request to a server (definitions in this module's
    docstring): the one row builder of every decoder.

    Args:
        m: the :class:`Observation`: a :class:`dtbench.harness.measurement.measure.Measurement` (Steps timed by the runner), or
            a :class:`~Served` request (network reads timed by the server client).
        prompt: the :class:`dtbench.harness.data.prompt.Prompt` it decoded.
        warmup: whether the prompt is one of the first W.
        reference: the reference decoder's tokens on this prompt, or None (the sample is a reference itself).

    Raises:
        TypeError: if a Step's counters are not integers (the runner fails the cell with it).
    """
    T = len(m.tokens)
    times = m.step_times
    total, ttft = times[-1], times[0]
    counted = m.counted()
    div = first_divergence(m.tokens, reference) if reference is not None else None
    return dict(
        prompt_index=prompt.index,
        document=prompt.document[:500],
        task_group=_clip100(getattr(prompt, "task_group", None)),
        category=_clip100(getattr(prompt, "category", None)),
        turn=getattr(prompt, "turn", None),
        question_id=_clip100(getattr(prompt, "question_id", None)),
        warmup=warmup,
        prompt_tokens=len(prompt.token_ids),
        new_tokens=T,
        total_s=total,
        ttft_s=ttft,
        tpot_s=(total - ttft) / (T - 1) if T > 1 else None,
        throughput=T / total if total > 0 else float("inf"),
        tokens_per_iteration=T / counted["iterations"],
        **counted,
        step_times_s=times,
        output_hash=hashlib.sha256(json.dumps(m.tokens).encode()).hexdigest(),
        output_tokens=m.tokens,
        lossless=(div is None) if reference is not None else None,
        first_divergence=div,
    )
