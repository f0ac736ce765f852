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
