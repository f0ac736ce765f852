"""Clocks and memory trackers: the runner owns the clock, decoders never time themselves.

- Clock: ``time.perf_counter`` after synchronizing the device (CUDA work is asynchronous; a step's tokens are
  only known once its kernels finish, so a sync per step costs nothing extra: the decoder already reads them).
- Memory (bytes): on CUDA, the torch allocator peak (``max_memory_allocated``) and the device-wide NVML peak
  (pynvml, polled; includes other processes and the CUDA context); on CPU, the process resident-set peak
  (Linux ``VmHWM``, reset per sample through ``/proc/self/clear_refs``; otherwise a polling thread).
  They answer different questions and are stored apart (optimum-benchmark's memory tracker does the same).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (CUDA) so the clock reads completed work; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class MemoryPeak:
    """Peak memory of one sample, bytes; None where not measurable on this device."""

    rss_bytes: int | None = None
    allocated_bytes: int | None = None
    nvml_bytes: int | None = None


class _Poller(threading.Thread):
    """Polls a reading every ``interval`` seconds and keeps its maximum."""

    def __init__(self, read, interval: float = 0.005):
        super().__init__(daemon=True)
        self.read, self.interval, self.peak = read, interval, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.peak = max(self.peak, self.read())
            except Exception:  # a failed read must never break a measurement
                return
            self._stop_event.wait(self.interval)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        try:
            self.peak = max(self.peak, self.read())
        except Exception:
            pass
        return self.peak


class MemoryTracker:
    """Context manager measuring the peak memory of the code inside it.

    Usage: ``with MemoryTracker(device) as mem: ...``; then ``mem.peak`` is a :class:`MemoryPeak`.
    """

    _clear_refs = Path("/proc/self/clear_refs")
    _status = Path("/proc/self/status")

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = MemoryPeak()
        self._pollers: dict[str, _Poller] = {}
        self._hwm = False

    def __enter__(self) -> "MemoryTracker":
        self._hwm = self._reset_hwm()
        if not self._hwm:
            proc = psutil.Process()
            self._pollers["rss"] = _Poller(lambda: proc.memory_info().rss)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            handle = _nvml_handle(self.device)
            if handle is not None:
                import pynvml

                self._pollers["nvml"] = _Poller(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        for p in self._pollers.values():
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        peaks = {k: p.stop() for k, p in self._pollers.items()}
        self.peak.rss_bytes = self._read_hwm() if self._hwm else peaks.get("rss")
        if self.device.type == "cuda":
            self.peak.allocated_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.peak.nvml_bytes = peaks.get("nvml")

    def _reset_hwm(self) -> bool:
        try:
            self._clear_refs.write_text("5")
            return self._read_hwm() is not None
        except OSError:
            return False

    def _read_hwm(self) -> int | None:
        try:
            for line in self._status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


_NVML_READY: bool | None = None


def _nvml_handle(device: torch.device):
    """An NVML handle for ``device``, or None when NVML is unavailable (no driver, container limits)."""
    global _NVML_READY
    try:
        import pynvml

        if _NVML_READY is None:
            pynvml.nvmlInit()
            _NVML_READY = True
        index = device.index if device.index is not None else torch.cuda.current_device()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        _NVML_READY = False
        return None


def device_name(device: torch.device) -> str:
    """A human-readable name of the device (GPU model, or CPU model and core count)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({psutil.cpu_count(logical=True)} threads, torch {torch.get_num_threads()} threads)"


def cpu_model() -> str:
    """The CPU model string from /proc/cpuinfo, or the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def now() -> float:
    """Seconds from a monotonic high-resolution clock."""
    return time.perf_counter()


# --- The measurement loop: one decoder on one prompt, timed per Step, forwards counted, time-limited -----------


class SampleTimeout(BaseException):
    """Raised inside a decoder that ran past the per-sample time limit.

    A BaseException, so a plugin's broad ``except Exception`` cannot swallow it.
    """


class ForwardCounter:
    """Counts forward passes and the tokens they fed, for the target and the draft, with forward pre-hooks.

    The runner installs it around each sample, so the counts are observed, never declared by the decoder
    (a ``generate`` inside transformers' assisted generation is counted the same way). Only the top-level
    module's calls are counted: one call = one forward pass over ``input_ids.shape[-1]`` new tokens.

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
        self._handles: list = []

    def _hook(self, role: str):
        def pre_hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:  # called with inputs_embeds
                ids = kwargs.get("inputs_embeds")
                n = int(ids.shape[-2]) if ids is not None and ids.dim() >= 2 else 0
            else:
                n = int(ids.shape[-1])
            self.forwards[role] += 1
            self.tokens[role] += n

        return pre_hook

    def __enter__(self) -> "ForwardCounter":
        for role, model in self.models.items():
            self._handles.append(model.register_forward_pre_hook(self._hook(role), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def snapshot(self) -> tuple[int, int | None, int, int | None]:
        """(target forwards, draft forwards, target tokens fed, draft tokens fed) so far; draft None if uncounted."""
        has_draft = "draft" in self.models
        return (self.forwards["target"], self.forwards["draft"] if has_draft else None,
                self.tokens["target"], self.tokens["draft"] if has_draft else None)


class _Deadline:
    """Raises :class:`SampleTimeout` in the measuring thread once ``seconds`` have passed (None: never).

    A watchdog timer thread raises the exception asynchronously in the measuring thread
    (``PyThreadState_SetAsyncExc``), so a decoder stuck in pure Python between two yields is stopped too, in any
    thread; a single long native call (one huge matmul) is interrupted when it returns.
    """

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.fired = False
        self._lock = threading.Lock()
        self._armed = False
        self._timer: threading.Timer | None = None
        self._tid = threading.get_ident()

    def _fire(self) -> None:
        import ctypes

        with self._lock:
            if self._armed:
                self.fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), ctypes.py_object(SampleTimeout))

    def __enter__(self) -> "_Deadline":
        if self.seconds is not None:
            self._armed = True
            self._timer = threading.Timer(self.seconds, self._fire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is None:
            return
        import ctypes

        with self._lock:
            self._armed = False
            if self.fired:  # not delivered yet (we left on our own): withdraw it
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), None)
        self._timer.cancel()


@dataclass
class StepRecord:
    """The runner's observation of one Step: seconds from the start, forwards and tokens fed since the last."""

    time_s: float
    target_forwards: int
    draft_forwards: int | None
    target_tokens: int
    draft_tokens: int | None


@dataclass
class Measurement:
    """What the runner saw of one decoder on one prompt.

    Attributes:
        tokens: the first T committed token ids.
        steps: the decoder's Steps, in order.
        records: one :class:`StepRecord` per Step (same length as ``steps``).
        memory: the sample's :class:`MemoryPeak`.
    """

    tokens: list[int]
    steps: list
    records: list[StepRecord]
    memory: MemoryPeak

    @property
    def step_times(self) -> list[float]:
        return [r.time_s for r in self.records]


def measure(decoder, prompt_ids, gen_length: int, device: torch.device, *, timeout_s: float | None = None) -> Measurement:
    """Run ``decoder`` on one prompt, timing each yielded Step after synchronizing the device.

    The clock starts right before ``generate`` is called (prefill included) and reads after each Step; the
    committed tokens are truncated to exactly ``gen_length`` (T) and iteration stops once T are committed.
    Forward passes of the decoder's target and draft are counted by hooks (:class:`ForwardCounter`).

    Args:
        decoder: a :class:`dtbench.decoders.base.Decoder` bound to its models.
        prompt_ids: prompt token ids (length >= 1).
        gen_length: T, new tokens to generate.
        device: where the models live (CUDA is synchronized before each clock read).
        timeout_s: time limit of the whole sample in seconds (None: none).

    Raises:
        DtbenchError: the decoder yielded an empty step, a token that is not an integer id, or stopped before T.
        SampleTimeout: the sample ran past ``timeout_s``.
        Exception: whatever the decoder raises (the runner fails the cell).
    """
    import operator

    from dtbench.harness.errors import DtbenchError

    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    tokens: list[int] = []
    steps: list = []
    records: list[StepRecord] = []
    synchronize(device)
    counter = ForwardCounter(decoder.target, decoder.draft)
    with _Deadline(timeout_s), counter, MemoryTracker(device) as mem:
        last = counter.snapshot()
        start = now()
        gen = decoder.generate(input_ids, gen_length)
        try:
            for step in gen:
                synchronize(device)
                t = now() - start
                snap = counter.snapshot()
                if not step.tokens:
                    raise DtbenchError(f"decoder yielded a step with no tokens at iteration {len(steps)}")
                try:
                    ids = [operator.index(x) for x in step.tokens]
                except TypeError:
                    raise DtbenchError(f"decoder yielded a token that is not an integer id at iteration "
                                       f"{len(steps)}: {step.tokens[:8]!r}") from None
                records.append(StepRecord(
                    t, snap[0] - last[0], None if snap[1] is None else snap[1] - last[1],
                    snap[2] - last[2], None if snap[3] is None else snap[3] - last[3]))
                last = snap
                steps.append(step)
                tokens.extend(ids)
                if len(tokens) >= gen_length:
                    break
        finally:
            gen.close()
    if len(tokens) < gen_length:
        raise DtbenchError(f"decoder stopped after {len(tokens)} of {gen_length} tokens")
    return Measurement(tokens=tokens[:gen_length], steps=steps, records=records, memory=mem.peak)
