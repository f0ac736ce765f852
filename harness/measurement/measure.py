"""The measurement loop and what it records: the runner owns the clock, decoders never time themselves.

- Clock: :func:`dtbench.decoders.base.clock` (``time.perf_counter``; the clock's one name, issue 58 item 5) after
  synchronizing the device (CUDA work is asynchronous; a step's tokens are only known once its kernels finish, so a
  sync per step costs nothing extra: the decoder already reads them). A
  push-based decoder (a blocking call such as transformers' ``generate``, issue 47) stamps each Step with the same
  clock at the moment its tokens were known (``Step.at``, :func:`dtbench.decoders.base.commit_clock`), and the loop
  takes the time and the forwards counted up to it from there (:meth:`ForwardCounter.snapshot_at`).
- :func:`measure_rows`: the one timing loop, one decoder on B prompts (B = 1 a batch of one; :func:`measure` its
  B = 1 shape), a timestamp per iteration, forward passes counted and timed by hooks (:class:`ForwardCounter`, the
  one forward timer, :mod:`dtbench.harness.measurement.forwards`), peak memory (:mod:`dtbench.harness.measurement.memory`), energy
  (:mod:`dtbench.harness.measurement.energy`), a per-sample time limit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dtbench.decoders import base
from dtbench.decoders.cut import cut_tokens
from dtbench.harness.execution.deadline import (
    Deadline as _Deadline,  # the per-sample time limit (harness/execution/deadline.py)
)
from dtbench.harness.execution.deadline import SampleTimeout as SampleTimeout  # re-exported: raised by measure_rows
from dtbench.harness.measurement.energy import EnergyReading, EnergyTracker
from dtbench.harness.measurement.forwards import FED_LAST, FED_MASK, ForwardCounter, StepRecord, cache_argument
from dtbench.harness.measurement.memory import MemoryPeak, MemoryTracker, synchronize

if TYPE_CHECKING:
    from dtbench.decoders.base import Decoder, Step

# Re-exported: the forward timer's names as the measurement loop's callers have always imported them.
__all__ = [
    "FED_LAST",
    "FED_MASK",
    "ForwardCounter",
    "Measurement",
    "SampleTimeout",
    "StepRecord",
    "cache_argument",
    "measure",
    "measure_rows",
]


# --- The measurement loop: one decoder on one prompt, timed per Step, forwards counted, time-limited -----------


@dataclass
class Measurement:
    """What the runner saw of one decoder on one prompt.

    Attributes:
        tokens: the first T committed token ids.
        steps: the decoder's Steps, in order.
        records: one :class:`StepRecord` per Step (same length as ``steps``).
        memory: the sample's :class:`MemoryPeak`.
        forward_s: seconds inside the target's and the draft's forward passes (:meth:`ForwardCounter.forward_seconds`;
            the draft None when not counted), None when not measured.
        state: the decoder's :meth:`~dtbench.decoders.base.Decoder.state_stats` after the sample (None: none).
        energy: the sample's energy (:class:`~dtbench.harness.measurement.energy.EnergyReading`), None when not measured.
    """

    tokens: list[int]
    steps: list[Step]
    records: list[StepRecord]
    memory: MemoryPeak
    forward_s: dict[str, float | None] | None = None
    state: dict[str, int] | None = None
    energy: EnergyReading | None = None
    cpu_s: float | None = None  # this process's CPU seconds during the sample (all threads): the timeout's yardstick

    @property
    def step_times(self) -> list[float]:
        return [r.time_s for r in self.records]

    def counted(self) -> dict[str, Any]:
        """The counter, memory and energy columns (:func:`~dtbench.harness.measurement.observation.measured_columns`): what makes
        a Measurement a :class:`~dtbench.harness.measurement.observation.Observation`."""
        from dtbench.harness.measurement.observation import measured_columns

        return measured_columns(self)


def measure(
    decoder: Decoder[Any],
    prompt_ids: Sequence[int],
    gen_length: int,
    device: torch.device,
    *,
    timeout_s: float | None = None,
    cpu_timeout_s: float | None = None,
) -> Measurement:
    """Run ``decoder`` on one prompt (``generate``), a batch of one through :func:`measure_rows`.

    The clock starts right before ``generate`` is called (prefill included) and reads after each Step; the
    committed tokens are truncated to exactly ``gen_length`` (T) and iteration stops once T are committed, or, when
    the decoder's ``eos_token_id`` is set (``stop_at_eos``), once the first EOS is committed: the Step holding it is
    cut after it (:func:`~dtbench.decoders.base.cut_at_eos`, so a third-party loop that runs past EOS is cut too).
    Forward passes of the decoder's target and draft are counted by hooks (:class:`ForwardCounter`).

    Args:
        decoder: a :class:`dtbench.decoders.base.Decoder` bound to its models.
        prompt_ids: prompt token ids (length >= 1).
        gen_length: T, new tokens to generate.
        device: where the models live (CUDA is synchronized before each clock read).
        timeout_s: time limit of the whole sample in seconds (None: none).
        cpu_timeout_s: limit on this process's CPU seconds during the sample (None: none).

    Raises:
        DtbenchError: the decoder yielded an empty step, a token that is not an integer id, or stopped before T
            (and before an EOS, when stopping at EOS).
        SampleTimeout: the sample ran past ``timeout_s``.
        Exception: whatever the decoder raises (the runner fails the cell).
    """
    return measure_rows(decoder, [prompt_ids], gen_length, device, timeout_s=timeout_s, cpu_timeout_s=cpu_timeout_s)[0]


def _one_row(gen: Iterator[Step]) -> Iterator[dict[int, Step]]:
    """``generate``'s Steps as the rows dicts of a batch of one; closing it closes ``gen``."""
    try:
        for step in gen:
            yield {0: step}
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()


def _commit_time(out: dict[int, Step], it: int, previous: float) -> float | None:
    """The commit time (``Step.at``) of one yielded iteration, None when its Steps carry none (pull-based).

    Raises:
        DtbenchError: its rows' Steps disagree on ``at``, or ``at`` is earlier than the previous iteration's.
    """
    from dtbench.harness.errors import DtbenchError

    stamps = {getattr(step, "at", None) for step in out.values()}
    if stamps == {None} or not stamps:
        return None
    if len(stamps) > 1:
        raise DtbenchError(f"decoder yielded rows with different commit times (Step.at) at iteration {it}")
    (at,) = stamps
    if not isinstance(at, float):
        raise DtbenchError(f"decoder yielded a commit time (Step.at) that is not a clock reading at iteration {it}")
    if at < previous and it > 0:
        raise DtbenchError(f"decoder yielded a commit time (Step.at) at iteration {it} before the previous one")
    return at


class _Rows:
    """The rows of :func:`measure_rows` as their Steps arrive: each Step checked, its ids made plain ints, cut after
    the row's first EOS, and kept with the iteration's forward record until the row has its T tokens."""

    def __init__(self, b: int, gen_length: int, eos: frozenset[int], batched: bool):
        self.b, self.gen_length, self.eos, self.batched = b, gen_length, eos, batched
        self.tokens: list[list[int]] = [[] for _ in range(b)]
        self.steps: list[list[Any]] = [[] for _ in range(b)]
        self.records: list[list[StepRecord]] = [[] for _ in range(b)]
        self.done = [False] * b

    def where(self, r: int) -> str:
        """A row named in errors only in a batch."""
        return f" for row {r}" if self.batched else ""

    def add(self, r: object, step: Any, record: StepRecord, it: int) -> None:
        """Take row ``r``'s Step of iteration ``it`` (ignored once the row is done).

        Raises:
            DtbenchError: a row that does not exist, a Step with no tokens or a token that is not an integer id.
        """
        import operator

        from dtbench.decoders.base import Step, cut_at_eos
        from dtbench.harness.errors import DtbenchError

        if not (isinstance(r, int) and 0 <= r < self.b):
            raise DtbenchError(f"decoder yielded a step for row {r!r} of a batch of {self.b} at iteration {it}")
        if self.done[r]:
            return
        if not step.tokens:
            raise DtbenchError(f"decoder yielded a step with no tokens{self.where(r)} at iteration {it}")
        try:
            ids = [operator.index(x) for x in step.tokens]
        except TypeError:
            raise DtbenchError(
                f"decoder yielded a token that is not an integer id{self.where(r)} at "
                f"iteration {it}: {step.tokens[:8]!r}"
            ) from None
        step = Step(tuple(ids), step.drafted, step.accepted, step.depth)  # plain int ids from here on
        step, ended = cut_at_eos(step, self.eos) if self.eos else (step, False)
        self.steps[r].append(step)
        self.records[r].append(record)
        self.tokens[r].extend(step.tokens)
        self.done[r] = ended or len(self.tokens[r]) >= self.gen_length


def measure_rows(
    decoder: Decoder[Any],
    prompts: Sequence[Sequence[int]],
    gen_length: int,
    device: torch.device,
    *,
    timeout_s: float | None = None,
    cpu_timeout_s: float | None = None,
    batched: bool | None = None,
) -> list[Measurement]:
    """The timing loop (the only one; issue 40): run ``decoder`` on B prompts, timing each iteration after
    synchronizing the device; one :class:`Measurement` per row. B = 1 is a batch of one.

    ``batched`` (default: B > 1) calls :meth:`~dtbench.decoders.base.Decoder.generate_batch` with the B prompts
    (a decoder whose class declares ``batching``); otherwise ``generate`` on the one prompt, its Steps read as row 0.
    The clock starts right before the call (the prefill included) and reads after each yielded {row: Step} dict: a
    row's step times are the times of the iterations it committed in (its TTFT the prefill's, its total the time its
    last token was committed), so every row's TTFT and TPOT are its own while the batch's wall time is the last row's
    total. Each row keeps its first T tokens, cut after its first EOS when the decoder's ``eos_token_id`` is set
    (:func:`~dtbench.decoders.base.cut_at_eos`, so a third-party loop that runs past EOS is cut too). Forwards are
    counted by hooks (:class:`ForwardCounter`): one forward serves every active row, and each row's records carry the
    forwards of the iterations it took part in. Memory, energy, forward seconds and CPU time are the batch's, the
    same in every row.

    Args:
        decoder: a :class:`dtbench.decoders.base.Decoder` bound to its models.
        prompts: per row the prompt token ids (ragged lengths, each >= 1).
        gen_length: T, new tokens per row.
        device: where the models live (CUDA is synchronized before each clock read).
        timeout_s: time limit of the whole batch in seconds (None: none).
        cpu_timeout_s: limit on this process's CPU seconds during the batch (None: none).
        batched: call ``generate_batch`` (default: when B > 1).

    Raises:
        DtbenchError: a step for a row that does not exist, an empty step, a token that is not an integer id, or a
            row that stopped before T (and before an EOS, when stopping at EOS).
        SampleTimeout: the batch ran past ``timeout_s`` (or ``cpu_timeout_s``).
        Exception: whatever the decoder raises (the runner fails the cell).
    """
    from dtbench.decoders.base import eos_ids
    from dtbench.harness.errors import DtbenchError

    b = len(prompts)
    batched = b > 1 if batched is None else batched
    inputs = [torch.tensor([list(p)], dtype=torch.long, device=device) for p in prompts]
    rows = _Rows(b, gen_length, eos_ids(getattr(decoder, "eos_token_id", None)), batched)
    synchronize(device)
    counter = ForwardCounter(decoder.target, decoder.draft)
    cpu0 = time.process_time()
    with _Deadline(timeout_s, cpu_timeout_s), counter, MemoryTracker(device) as mem, EnergyTracker(device) as energy:
        last = counter.snapshot()
        start = base.clock()
        stamped = start  # the previous iteration's commit time (Step.at must not go back)
        gen = (
            decoder.generate_batch(inputs, gen_length) if batched else _one_row(decoder.generate(inputs[0], gen_length))
        )
        try:
            for it, out in enumerate(gen):
                at = _commit_time(out, it, stamped)
                if at is None:  # pull-based: the iteration ended when its Step was yielded
                    synchronize(device)
                    at, snap = base.clock(), counter.snapshot()
                else:  # push-based (Step.at): the time and the forwards counted up to it
                    snap = counter.snapshot_at(at)
                if not start <= at <= base.clock():
                    raise DtbenchError(f"decoder stamped iteration {it} at a time outside its sample (Step.at)")
                stamped = at
                record = counter.record(at - start, last, snap)
                last = snap
                for r, step in out.items():
                    rows.add(r, step, record, it)
                if all(rows.done):
                    break
        finally:
            close = getattr(gen, "close", None)  # a generator (the contract's usual generate_batch) is closed
            if close is not None:
                close()
    tokens, steps, records, done = rows.tokens, rows.steps, rows.records, rows.done
    where = rows.where
    short = [r for r in range(b) if not done[r]]
    if short:
        raise DtbenchError(f"decoder stopped{where(short[0])} after {len(tokens[short[0]])} of {gen_length} tokens")
    synchronize(device)
    stats = getattr(decoder, "state_stats", None)
    with _Deadline(timeout_s, cpu_timeout_s):  # the decoder's code, under the sample's limit too (issue 50)
        state = stats() if stats else None
    forward_s, cpu_s = counter.forward_seconds(), time.process_time() - cpu0
    return [
        Measurement(
            tokens=cut_tokens(tokens[r], gen_length, rows.eos),  # the one cut (its Steps were cut at EOS)
            steps=steps[r],
            records=records[r],
            memory=mem.peak,
            forward_s=forward_s,
            state=state,
            energy=energy.reading,
            cpu_s=cpu_s,
        )
        for r in range(b)
    ]
