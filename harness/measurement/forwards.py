"""The one forward timer (issue 49 item 2): :class:`ForwardTimer` times model forwards, with the source chosen once
per device (CUDA: a pair of ``torch.cuda.Event`` per forward on the current stream, resolved after one synchronize;
otherwise host clock differences). The measurement's :class:`ForwardCounter` (module hooks: the measurement loop,
:mod:`dtbench.harness.measurement.measure`, installs it around each sample), the calibration (:mod:`dtbench.harness.calibration.calibrate`)
and the GPU check (:mod:`dtbench.gpucheck`) all time forwards through it. The host clock has one name,
:func:`dtbench.decoders.base.clock` (``time.perf_counter``; the same clock a push-based decoder stamps ``Step.at``
with, :func:`dtbench.decoders.base.commit_clock`; issue 58 item 5). ``tests/test_architecture.py`` keeps other modules
from reading a clock around a forward themselves.

Repeated timing (issue 58 item 5, after optimum-benchmark's ``LatencySessionTracker``): :meth:`ForwardTimer.session`
times calls until a :class:`StopRule` says enough and returns one :class:`Latency` (the calibration's points and
visits, the GPU check's compiled forwards and the kernel profile's calls): the rule "repeat until enough samples" is
written once, here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dtbench.decoders import base, roles
from dtbench.harness.calibration.curves import FED_LAST, FED_MASK  # defined once, torch-free, with the pricing
from dtbench.harness.measurement import memory

__all__ = [
    "FED_LAST",
    "FED_MASK",
    "ForwardCounter",
    "ForwardTimer",
    "Latency",
    "Snapshot",
    "StepRecord",
    "StopRule",
    "cache_argument",
    "fed_flags",
    "past_length",
]


@dataclass(frozen=True)
class StopRule:
    """When a timing session stops (issue 58 item 5): asked after each timed call with every time so far and the
    seconds since the session's first timed call began, it stops once ``max_time_s`` have passed with at least
    ``floor`` calls, or once there are ``min_repeats`` calls and ``min_time_s`` seconds and (with ``rel_tol``) the
    median of all calls lies within ``rel_tol`` of the median of the first half (a stable median).

    ``StopRule(min_repeats=n)`` is a fixed count of n calls.
    """

    min_repeats: int = 1
    min_time_s: float = 0.0
    max_time_s: float = math.inf
    rel_tol: float | None = None
    floor: int = 1

    def done(self, times: Sequence[float], elapsed_s: float) -> bool:
        """Whether to stop after ``times`` (seconds per call so far) and ``elapsed_s`` seconds."""
        n = len(times)
        if elapsed_s >= self.max_time_s and n >= self.floor:
            return True
        if n < self.min_repeats or elapsed_s < self.min_time_s:
            return False
        if self.rel_tol is None:
            return True
        med, first = statistics.median(times), statistics.median(times[: max(1, n // 2)])
        return med == 0 or abs(med - first) <= self.rel_tol * med


@dataclass(frozen=True)
class Latency:
    """The seconds of each timed call of one session (or of several visits of one point), with their statistics.

    Attributes:
        times: seconds per call, in order.
    """

    times: tuple[float, ...]

    @property
    def repeats(self) -> int:
        """Timed calls."""
        return len(self.times)

    @property
    def median(self) -> float:
        """Median seconds per call."""
        return statistics.median(self.times)

    @property
    def mean(self) -> float:
        """Mean seconds per call."""
        return sum(self.times) / len(self.times)

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the seconds, numpy's linear interpolation."""
        import numpy as np

        return float(np.percentile(self.times, q))

    @property
    def iqr(self) -> float:
        """Interquartile range in seconds (75th - 25th percentile); 0 for fewer than two calls."""
        if len(self.times) < 2:
            return 0.0
        return self.percentile(75) - self.percentile(25)


class ForwardTimer:
    """Times forward passes on one device, the source chosen once, at construction.

    CUDA (``device.type == "cuda"``, no ``clock`` given and not ``host``): :meth:`start` and :meth:`stop` record a
    ``torch.cuda.Event`` pair on the current stream (no host synchronization between forwards); :meth:`resolve`
    synchronizes once, on the last end event, and reads every pair. Otherwise: ``clock`` (default
    :func:`dtbench.decoders.base.clock`, looked up at each call, so a test that replaces it replaces it here) is read
    at :meth:`start` and :meth:`stop` (CPU kernels are synchronous). Every time is in seconds.

    Args:
        device: the device the timed forwards run on (a ``torch.device`` or its name).
        clock: a host clock in seconds to time with instead of CUDA events (tests pass a fake one).
        host: time with the host clock even on CUDA (:meth:`host`).
    """

    def __init__(self, device: torch.device | str, clock: Callable[[], float] | None = None, *, host: bool = False):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and clock is None and not host
        self._clock = clock
        self._laps: list[Any] = []  # CPU: seconds; CUDA: (start, end) event pairs not yet resolved
        self.source = "cuda events" if self.cuda else "host clock"

    @classmethod
    def host(cls, device: torch.device | str) -> ForwardTimer:
        """A timer on the host clock (:func:`dtbench.decoders.base.clock`) even on CUDA: the wall clock around a
        forward the caller synchronizes itself (the GPU check compares it with the CUDA events)."""
        return cls(device, host=True)

    def read(self) -> float:
        """The host clock in seconds (budgets and the like around whole loops, never a single forward's time)."""
        return self._clock() if self._clock is not None else base.clock()

    def start(self, host: float | None = None) -> Any:
        """Mark the start of a forward; returns the mark :meth:`stop` takes. ``host``: the host clock just read by
        the caller, used as the start on the host clock (saves a second read)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return self.read() if host is None else host

    def stop(self, mark: Any) -> None:
        """Mark the end of the forward started at ``mark``; its seconds join the next :meth:`resolve`."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end.record()
            self._laps.append((mark, end))
        else:
            self._laps.append(self.read() - mark)

    def resolve(self) -> list[float]:
        """Seconds of each forward stopped since the last call, in order (CUDA: after one synchronize, on the last
        end event)."""
        laps, self._laps = self._laps, []
        if not self.cuda:
            return laps
        if laps:
            laps[-1][1].synchronize()
        return [a.elapsed_time(b) / 1000.0 for a, b in laps]

    def time(self, forward: Callable[[], object]) -> float:
        """Seconds of one call of ``forward`` (resolved at once: one synchronize on CUDA)."""
        mark = self.start()
        forward()
        self.stop(mark)
        return self.resolve()[-1]

    def session(
        self,
        forward: Callable[[], object],
        rule: StopRule,
        *,
        reset: Callable[[], object] | None = None,
        warmup: int = 0,
        synchronize: bool = True,
    ) -> Latency:
        """Time calls of ``forward`` until ``rule`` says enough (issue 58 item 5): ``warmup`` untimed calls (each
        followed by ``reset``), then per call: the device synchronized (with ``synchronize``), one timed call
        (:meth:`time`), ``reset`` (untimed), and ``rule`` asked with the seconds since the first timed call began
        (:meth:`read`). At least one call is timed.

        Returns:
            the seconds of every timed call.
        """
        for _ in range(warmup):
            forward()
            if reset is not None:
                reset()
        times: list[float] = []
        begin = self.read()
        while True:
            if synchronize:
                memory.synchronize(self.device)
            times.append(self.time(forward))
            if reset is not None:
                reset()
            if rule.done(times, self.read() - begin):
                return Latency(tuple(times))


# Flags of one counted forward: FED_MASK = an explicit 4D attention mask was passed (tree verification, tree
# drafting, StreamingLLM); FED_LAST = logits for the last position only (``logits_to_keep=1``: prefills, chain
# drafting). The cost model (``reports/pricing/costmodel.py``) prices each forward on the calibration curve of its kind.


def cache_argument(kwargs: dict[str, Any]) -> Any:
    """The KV cache a forward was called with: ``cache`` (transformers 5.2x's keyword, see
    :func:`dtbench.decoders.modelinfo.cache_keyword`) or ``past_key_values`` (older models); None if neither."""
    return kwargs["cache"] if "cache" in kwargs else kwargs.get("past_key_values")


def past_length(cache: Any, kwargs: dict[str, Any] | None = None, n: int = 0) -> int | None:
    """KV positions a forward's cache held before it ran (None where unknown), learnt without reading the device:
    a host read in a forward hook would synchronize a GPU with the host once per forward (issue 46: the harness must
    not slow the loop it measures).

    In order: a cache compiled execution drives (:class:`~dtbench.decoders.static_kv.StaticKV`) carries its logical
    length as a Python int (``dtbench_length``); a cache whose ``get_seq_length()`` is an int (``DynamicCache``) gives
    it; a cache holding its length in a device tensor (transformers' ``StaticCache``) is read off the forward's 2D
    attention mask, which covers the past and the ``n`` new tokens (``kwargs["attention_mask"]``, shape (B, past + n));
    without one, None.
    """
    if cache is None:
        return 0
    held = getattr(cache, "dtbench_length", None)
    if held is not None:
        return int(held)
    try:
        length = cache.get_seq_length()
    except Exception:
        return None
    if not torch.is_tensor(length):
        return int(length)
    mask = (kwargs or {}).get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[-1] >= n:
        return int(mask.shape[-1]) - n
    return None


def fed_flags(kwargs: dict[str, Any]) -> int:
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

    Timing (issue 12, where a sample's time goes): one :class:`ForwardTimer` per model, on its device: on CPU,
    the host clock around each forward (CPU kernels are synchronous); on CUDA, a pair of ``torch.cuda.Event`` per
    forward recorded on the current stream (no host sync inside the loop; :meth:`forward_seconds` resolves them).

    Roles (issue 68 item 2): a forward is counted and timed by its *role*, not by its model object. Every forward of
    the draft object is a draft forward; a forward of the target object is a draft forward when it runs inside
    :func:`~dtbench.decoders.roles.drafting` (a Proposer, a tree's drafting: a decoder that drafts with its own
    target, or whose draft *is* the target object), else the target's. Without a draft object the draft counts stay
    None until the first draft forward; steps before it count 0 then (:func:`dtbench.harness.measurement.metrics` reads them so).

    Args:
        target, draft: the models (``draft`` may be None or the target object itself).
    """

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None):
        self.models = {"target": target}
        if draft is not None and draft is not target:
            self.models["draft"] = draft
        self.self_drafted = False  # a draft-role forward of the target object was counted
        self.forwards = {k: 0 for k in ("target", "draft")}
        self.tokens = {k: 0 for k in ("target", "draft")}
        # One entry per forward, in call order: (new tokens n, KV positions before it, flags) — see FED_MASK.
        self.fed: dict[str, list[tuple[int, int | None, int]]] = {k: [] for k in ("target", "draft")}
        self._handles: list[Any] = []
        # Per forward, in call order: the host clock (base.clock) when it was called, and the tokens fed up to and
        # including it: what :meth:`snapshot_at` bisects for a push-based Step's commit time (Step.at).
        self._called: dict[str, list[float]] = {k: [] for k in ("target", "draft")}
        self._cum_tokens: dict[str, list[int]] = {k: [] for k in ("target", "draft")}
        self._seconds = {k: 0.0 for k in ("target", "draft")}
        self._prefill_s = {k: 0.0 for k in ("target", "draft")}  # of forwards from an empty cache (the prefill)
        self._resolved = {k: 0 for k in ("target", "draft")}  # forwards whose seconds were resolved (fed's index)
        self._open: dict[str, Any] = {}
        self._roles: list[str] = []  # the role of each forward still open (pre hook -> post hook)
        device = getattr(target, "device", torch.device("cpu"))
        self._timers = {
            k: ForwardTimer(getattr(self.models.get(k, target), "device", device)) for k in ("target", "draft")
        }

    def counts_draft(self) -> bool:
        """Whether draft forwards are counted: a draft object, or a draft-role forward of the target seen."""
        return "draft" in self.models or self.self_drafted

    def _hook(self, owner: str) -> Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            role = "draft" if owner == "draft" or roles.forward_role() == "draft" else "target"
            if role == "draft" and owner == "target":
                self.self_drafted = True
            self._roles.append(role)
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:  # called with inputs_embeds
                ids = kwargs.get("inputs_embeds")
                n = int(ids.shape[-2]) if ids is not None and ids.dim() >= 2 else 0
            else:
                n = int(ids.shape[-1])
            self.forwards[role] += 1
            self.tokens[role] += n
            self.fed[role].append((n, past_length(cache_argument(kwargs), kwargs, n), fed_flags(kwargs)))
            called = base.clock()
            self._called[role].append(called)
            self._cum_tokens[role].append(self.tokens[role])
            self._open[role] = self._timers[role].start(called)

        return pre_hook

    def _post_hook(self, owner: str) -> Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def post_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            role = self._roles.pop() if self._roles else owner
            start = self._open.pop(role, None)
            if start is not None:
                self._timers[role].stop(start)

        return post_hook

    def forward_seconds(self) -> dict[str, float | None]:
        """Seconds spent inside each model's forward passes so far: ``{"target": s, "draft": s or None,
        "target_prefill": s, "draft_prefill": s or None}`` (draft None when it is not counted); ``*_prefill`` is the
        part in forwards that started from an empty cache (KV positions before it 0: the prompt's prefill), which a
        speedup's explanation sets apart (issue 58 item 2). On CUDA it synchronizes once, on the last forward's end
        event (:meth:`ForwardTimer.resolve`)."""
        out: dict[str, float | None] = {}
        for role in ("target", "draft"):
            if role == "draft" and not self.counts_draft():
                out[role] = out[f"{role}_prefill"] = None
                continue
            laps = self._timers[role].resolve()
            fed = self.fed[role][self._resolved[role] : self._resolved[role] + len(laps)]
            self._resolved[role] += len(laps)
            self._seconds[role] += sum(laps)
            self._prefill_s[role] += sum(s for s, (_, past, _) in zip(laps, fed) if past == 0)
            out[role], out[f"{role}_prefill"] = self._seconds[role], self._prefill_s[role]
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
        if role == "draft" and not self.counts_draft():
            return None
        return [list(e) for e in self.fed[role][start:end]]

    def snapshot(self) -> Snapshot:
        """(target forwards, draft forwards, target tokens fed, draft tokens fed) so far; draft None if uncounted."""
        has_draft = self.counts_draft()
        return (
            self.forwards["target"],
            self.forwards["draft"] if has_draft else None,
            self.tokens["target"],
            self.tokens["draft"] if has_draft else None,
        )

    def snapshot_at(self, at: float) -> Snapshot:
        """:meth:`snapshot` as it was at host time ``at`` (seconds on :func:`dtbench.decoders.base.clock`): the forwards called
        before ``at`` and the tokens they fed. A push-based decoder stamps a Step's ``at`` after its iteration's
        forwards returned and before the next iteration's began, so this attributes every forward to the iteration
        it ran in, exactly as :meth:`snapshot` at a yield does."""
        import bisect

        def upto(role: str) -> tuple[int, int]:
            k = bisect.bisect_right(self._called[role], at)
            return k, self._cum_tokens[role][k - 1] if k else 0

        target_fw, target_tok = upto("target")
        if not self.counts_draft():
            return target_fw, None, target_tok, None
        draft_fw, draft_tok = upto("draft")
        return target_fw, draft_fw, target_tok, draft_tok

    def record(self, t: float, last: Snapshot, snap: Snapshot) -> StepRecord:
        """The :class:`StepRecord` of one step ending at ``t`` seconds: the forwards and tokens counted between the
        snapshots ``last`` and ``snap`` (:meth:`snapshot`), the draft's None where it is not counted."""
        # a self-drafting decoder's draft counts start at its first draft forward: before it they were 0
        draft_fw = None if snap[1] is None else snap[1] - (last[1] or 0)
        draft_tok = None if snap[3] is None else snap[3] - (last[3] or 0)
        return StepRecord(
            t,
            snap[0] - last[0],
            draft_fw,
            snap[2] - last[2],
            draft_tok,
            self.fed_between("target", last[0], snap[0]) or [],
            None if snap[1] is None else self.fed_between("draft", last[1] or 0, snap[1]),
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
