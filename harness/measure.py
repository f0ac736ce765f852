"""The measurement loop and what it records: the runner owns the clock, decoders never time themselves.

- Clock: ``time.perf_counter`` after synchronizing the device (CUDA work is asynchronous; a step's tokens are
  only known once its kernels finish, so a sync per step costs nothing extra: the decoder already reads them).
- :func:`measure_rows`: the one timing loop, one decoder on B prompts (B = 1 a batch of one; :func:`measure` and
  :func:`measure_batch` are its two shapes), a timestamp per iteration, forward passes counted by hooks
  (:class:`ForwardCounter`), peak memory (:mod:`dtbench.harness.memory`), energy (:mod:`dtbench.harness.energy`),
  a per-sample time limit.
- Environment: :func:`environment` records versions and hardware with every run; :func:`hardware_flags` what
  decides dtype speed (CPU AVX-512/AMX flags, CUDA compute capability).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dtbench.harness.deadline import Deadline as _Deadline  # the per-sample time limit (harness/deadline.py)
from dtbench.harness.deadline import SampleTimeout as SampleTimeout  # re-exported: raised by measure_rows
from dtbench.harness.energy import EnergyReading, EnergyTracker
from dtbench.harness.memory import MemoryPeak, MemoryTracker, synchronize

if TYPE_CHECKING:
    from dtbench.decoders.base import Decoder, Step


def now() -> float:
    """Seconds from a monotonic high-resolution clock."""
    return time.perf_counter()


# --- The measurement loop: one decoder on one prompt, timed per Step, forwards counted, time-limited -----------


from dtbench.harness.curves import FED_LAST, FED_MASK  # noqa: E402  (defined once, torch-free, with the pricing)

# Flags of one counted forward: FED_MASK = an explicit 4D attention mask was passed (tree verification, tree
# drafting, StreamingLLM); FED_LAST = logits for the last position only (``logits_to_keep=1``: prefills, chain
# drafting). The cost model (``reports/costmodel.py``) prices each forward on the calibration curve of its kind.


def cache_argument(kwargs: dict[str, Any]) -> Any:
    """The KV cache a forward was called with: ``cache`` (transformers 5.2x's keyword, see
    :func:`dtbench.decoders.modelinfo.cache_keyword`) or ``past_key_values`` (older models); None if neither."""
    return kwargs["cache"] if "cache" in kwargs else kwargs.get("past_key_values")


def _past_len(cache: Any) -> int | None:
    """KV positions a forward's cache held before it ran (None where unknown)."""
    if cache is None:
        return 0
    try:
        return int(cache.get_seq_length())
    except Exception:
        return None


def _flags(kwargs: dict[str, Any]) -> int:
    mask = kwargs.get("attention_mask")
    flags = FED_MASK if torch.is_tensor(mask) and mask.dim() == 4 else 0
    keep = kwargs.get("logits_to_keep")
    if isinstance(keep, int) and not isinstance(keep, bool) and keep == 1:
        flags |= FED_LAST
    return flags


Snapshot = tuple[int, int | None, int, int | None]  # ForwardCounter.snapshot: forwards and tokens so far


class ForwardCounter:
    """Counts forward passes and the tokens they fed, for the target and the draft, with forward pre-hooks, and
    times them with pre/post hooks.

    The runner installs it around each sample, so the counts are observed, never declared by the decoder
    (a ``generate`` inside transformers' assisted generation is counted the same way). Only the top-level
    module's calls are counted: one call = one forward pass over ``input_ids.shape[-1]`` new tokens.

    Timing (issue 12, where a sample's time goes): on CPU, :func:`now` around each forward (CPU
    kernels are synchronous); on CUDA, a pair of ``torch.cuda.Event`` per forward recorded on the current stream
    (no host sync inside the loop; :meth:`forward_seconds` reads them after the sample's final synchronize).

    Args:
        target, draft: the models (``draft`` may be None). If the draft *is* the target object, every pass is
            counted as the target's and the draft counts stay None.
    """

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None):
        self.models = {"target": target}
        if draft is not None and draft is not target:
            self.models["draft"] = draft
        self.forwards = {k: 0 for k in ("target", "draft")}
        self.tokens = {k: 0 for k in ("target", "draft")}
        # One entry per forward, in call order: (new tokens n, KV positions before it, flags) — see FED_MASK.
        self.fed: dict[str, list[tuple[int, int | None, int]]] = {k: [] for k in ("target", "draft")}
        self._handles: list[Any] = []
        self._seconds = {k: 0.0 for k in ("target", "draft")}
        self._open: dict[str, Any] = {}
        self._events: dict[str, list[tuple[Any, Any]]] = {k: [] for k in ("target", "draft")}
        self._cuda = {k: getattr(m, "device", torch.device("cpu")).type == "cuda" for k, m in self.models.items()}

    def _hook(self, role: str) -> Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:  # called with inputs_embeds
                ids = kwargs.get("inputs_embeds")
                n = int(ids.shape[-2]) if ids is not None and ids.dim() >= 2 else 0
            else:
                n = int(ids.shape[-1])
            self.forwards[role] += 1
            self.tokens[role] += n
            self.fed[role].append((n, _past_len(cache_argument(kwargs)), _flags(kwargs)))
            if self._cuda[role]:
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                self._open[role] = start
            else:
                self._open[role] = now()

        return pre_hook

    def _post_hook(self, role: str) -> Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def post_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            start = self._open.pop(role, None)
            if start is None:
                return
            if self._cuda[role]:
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end.record()
                self._events[role].append((start, end))
            else:
                self._seconds[role] += now() - start

        return post_hook

    def forward_seconds(self) -> dict[str, float | None]:
        """Seconds spent inside each model's forward passes so far: ``{"target": s, "draft": s or None}`` (draft
        None when it is not counted). On CUDA call it after synchronizing the device."""
        out: dict[str, float | None] = {}
        for role in ("target", "draft"):
            if role not in self.models:
                out[role] = None
                continue
            out[role] = self._seconds[role] + sum(a.elapsed_time(b) for a, b in self._events[role]) / 1000.0
        return out

    def __enter__(self) -> ForwardCounter:
        for role, model in self.models.items():
            self._handles.append(model.register_forward_pre_hook(self._hook(role), with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._post_hook(role), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def fed_between(self, role: str, start: int, end: int) -> list[list[int | None]] | None:
        """The per-forward entries ``[n, past, flags]`` of ``role``'s forwards ``start..end-1`` (None for an
        uncounted draft)."""
        if role not in self.models:
            return None
        return [list(e) for e in self.fed[role][start:end]]

    def snapshot(self) -> Snapshot:
        """(target forwards, draft forwards, target tokens fed, draft tokens fed) so far; draft None if uncounted."""
        has_draft = "draft" in self.models
        return (
            self.forwards["target"],
            self.forwards["draft"] if has_draft else None,
            self.tokens["target"],
            self.tokens["draft"] if has_draft else None,
        )

    def record(self, t: float, last: Snapshot, snap: Snapshot) -> StepRecord:
        """The :class:`StepRecord` of one step ending at ``t`` seconds: the forwards and tokens counted between the
        snapshots ``last`` and ``snap`` (:meth:`snapshot`), the draft's None where it is not counted."""
        draft_fw = None if snap[1] is None or last[1] is None else snap[1] - last[1]
        draft_tok = None if snap[3] is None or last[3] is None else snap[3] - last[3]
        return StepRecord(
            t,
            snap[0] - last[0],
            draft_fw,
            snap[2] - last[2],
            draft_tok,
            self.fed_between("target", last[0], snap[0]) or [],
            None if snap[1] is None or last[1] is None else self.fed_between("draft", last[1], snap[1]),
        )


@dataclass
class StepRecord:
    """The runner's observation of one Step: seconds from the start, forwards and tokens fed since the last."""

    time_s: float
    target_forwards: int
    draft_forwards: int | None
    target_tokens: int
    draft_tokens: int | None
    # Per forward of this step, in call order: (tokens fed n, KV positions before it, FED_* flags); the draft's
    # None where its forwards are not counted. Default empty: records made before they existed.
    target_fed: list[list[int | None]] = field(default_factory=list)
    draft_fed: list[list[int | None]] | None = None


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
        energy: the sample's energy (:class:`~dtbench.harness.energy.EnergyReading`), None when not measured.
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
        """The counter, memory and energy columns (:func:`~dtbench.harness.metrics.measured_columns`): what makes
        a Measurement a :class:`~dtbench.harness.metrics.Observation`."""
        from dtbench.harness.metrics import measured_columns

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


def measure_batch(
    decoder: Decoder[Any],
    prompts: Sequence[Sequence[int]],
    gen_length: int,
    device: torch.device,
    *,
    timeout_s: float | None = None,
    cpu_timeout_s: float | None = None,
) -> list[Measurement]:
    """Run ``decoder`` on B prompts decoded together (``generate_batch``): :func:`measure_rows` with ``batched``."""
    return measure_rows(
        decoder, prompts, gen_length, device, timeout_s=timeout_s, cpu_timeout_s=cpu_timeout_s, batched=True
    )


def _one_row(gen: Iterator[Step]) -> Iterator[dict[int, Step]]:
    """``generate``'s Steps as the rows dicts of a batch of one; closing it closes ``gen``."""
    try:
        for step in gen:
            yield {0: step}
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()


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
    import operator

    from dtbench.decoders.base import Step, cut_at_eos, eos_ids
    from dtbench.harness.errors import DtbenchError

    eos = eos_ids(getattr(decoder, "eos_token_id", None))
    b = len(prompts)
    batched = b > 1 if batched is None else batched
    inputs = [torch.tensor([list(p)], dtype=torch.long, device=device) for p in prompts]
    tokens: list[list[int]] = [[] for _ in range(b)]
    steps: list[list[Step]] = [[] for _ in range(b)]
    records: list[list[StepRecord]] = [[] for _ in range(b)]
    done = [False] * b
    ended = [False] * b

    def where(r: int) -> str:  # a row named in errors only in a batch
        return f" for row {r}" if batched else ""

    synchronize(device)
    counter = ForwardCounter(decoder.target, decoder.draft)
    cpu0 = time.process_time()
    with _Deadline(timeout_s, cpu_timeout_s), counter, MemoryTracker(device) as mem, EnergyTracker(device) as energy:
        last = counter.snapshot()
        start = now()
        gen = (
            decoder.generate_batch(inputs, gen_length) if batched else _one_row(decoder.generate(inputs[0], gen_length))
        )
        try:
            for it, out in enumerate(gen):
                synchronize(device)
                t = now() - start
                snap = counter.snapshot()
                record = counter.record(t, last, snap)
                last = snap
                for r, step in out.items():
                    if not (isinstance(r, int) and 0 <= r < b):
                        raise DtbenchError(f"decoder yielded a step for row {r!r} of a batch of {b} at iteration {it}")
                    if done[r]:
                        continue
                    if not step.tokens:
                        raise DtbenchError(f"decoder yielded a step with no tokens{where(r)} at iteration {it}")
                    try:
                        ids = [operator.index(x) for x in step.tokens]
                    except TypeError:
                        raise DtbenchError(
                            f"decoder yielded a token that is not an integer id{where(r)} at "
                            f"iteration {it}: {step.tokens[:8]!r}"
                        ) from None
                    step = Step(tuple(ids), step.drafted, step.accepted, step.depth)  # plain int ids from here on
                    step, ended[r] = cut_at_eos(step, eos) if eos else (step, False)
                    steps[r].append(step)
                    records[r].append(record)
                    tokens[r].extend(step.tokens)
                    done[r] = ended[r] or len(tokens[r]) >= gen_length
                if all(done):
                    break
        finally:
            close = getattr(gen, "close", None)  # a generator (the contract's usual generate_batch) is closed
            if close is not None:
                close()
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
            tokens=tokens[r][:gen_length],
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
