"""Memory trackers (bytes): the peak memory of one sample, measured by the runner around it.

On CUDA, the torch allocator peak (``max_memory_allocated``; the allocator cache is emptied and its peak reset
before each sample) and the NVML peak (pynvml, polled every 5 ms): this process's GPU memory where NVML reports it
per process (``nvmlDeviceGetComputeRunningProcesses``, CUDA context included), else the device-wide used memory
(other processes included); :attr:`MemoryPeak.nvml_scope` says which. The NVML device is looked up by the CUDA
device's UUID, so a ``CUDA_VISIBLE_DEVICES`` remapping cannot point it at another GPU. On CPU, the process
resident-set peak (Linux ``VmHWM``, reset per sample through ``/proc/self/clear_refs``; otherwise a polling
thread). They answer different questions and are stored apart (optimum-benchmark's memory tracker does the same).
A reading that fails is stored as None, never as 0.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (CUDA) so the clock reads completed work; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


NVML_PROCESS, NVML_DEVICE = "process", "device"


@dataclass
class MemoryPeak:
    """Peak memory of one sample, bytes; None where not measurable on this device or where a reading failed.

    ``nvml_scope`` says what ``nvml_bytes`` counts: ``"process"`` (this process's GPU memory, from
    ``nvmlDeviceGetComputeRunningProcesses``), ``"device"`` (the whole GPU's used memory, other processes
    included: NVML gives no per-process figure, e.g. inside a container whose PID namespace hides ours), or None
    (no NVML reading).
    """

    rss_bytes: int | None = None
    allocated_bytes: int | None = None
    nvml_bytes: int | None = None
    nvml_scope: str | None = None


class _Poller(threading.Thread):
    """Polls a reading (bytes) every ``interval`` seconds and keeps its maximum.

    ``stop()`` returns None when any reading failed (a peak missing part of the sample is not a peak) or when
    none succeeded, so a failure is stored as "unknown", never as 0.
    """

    def __init__(self, read: Callable[[], int], interval: float = 0.005):
        super().__init__(daemon=True)
        self.read, self.interval = read, interval
        self.peak: int | None = None
        self.failed = False
        self._stop_event = threading.Event()

    def _poll(self) -> bool:
        try:
            value = int(self.read())
        except Exception:  # a failed read must never break a measurement
            self.failed = True
            return False
        self.peak = value if self.peak is None else max(self.peak, value)
        return True

    def run(self) -> None:
        while not self._stop_event.is_set() and self._poll():
            self._stop_event.wait(self.interval)

    def stop(self) -> int | None:
        self._stop_event.set()
        if self.ident is not None:  # started
            self.join()
        if not self.failed:
            self._poll()
        return None if self.failed else self.peak


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

    def __enter__(self) -> MemoryTracker:
        self._hwm = self._reset_hwm()
        if not self._hwm:
            proc = psutil.Process()
            self._pollers["rss"] = _Poller(lambda: proc.memory_info().rss)
        if self.device.type == "cuda":
            reset_device_memory(self.device)
            reader = nvml_reader(self.device)
            if reader is not None:
                read, self.peak.nvml_scope = reader
                self._pollers["nvml"] = _Poller(read)
        for p in self._pollers.values():
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        peaks = {k: p.stop() for k, p in self._pollers.items()}
        self.peak.rss_bytes = self._read_hwm() if self._hwm else peaks.get("rss")
        if self.device.type == "cuda":
            try:
                self.peak.allocated_bytes = int(torch.cuda.max_memory_allocated(self.device))
            except Exception:
                self.peak.allocated_bytes = None
            self.peak.nvml_bytes = peaks.get("nvml")
            if self.peak.nvml_bytes is None:
                self.peak.nvml_scope = None

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


def reset_device_memory(device: torch.device) -> None:
    """Before a sample on CUDA: return cached allocator blocks to the driver (``torch.cuda.empty_cache``) and reset
    the allocator's peak (``reset_peak_memory_stats``), so neither the allocator peak nor NVML's figure carries over
    from the previous sample. A no-op elsewhere; never raises (a failure only leaves the previous state)."""
    if device.type != "cuda":
        return
    for step in (torch.cuda.empty_cache, lambda: torch.cuda.reset_peak_memory_stats(device)):
        try:
            step()
        except Exception:
            pass


_NVML_READY: bool | None = None


def _nvml_uuid(device: torch.device) -> str | None:
    """The NVML UUID string (``GPU-8-4-4-4-12 hex``) of a CUDA device as this process numbers it.

    torch numbers devices after ``CUDA_VISIBLE_DEVICES`` remapping, NVML by physical index: the UUID
    (``torch.cuda.get_device_properties(i).uuid``, printed without NVML's ``GPU-`` prefix) is the one key both agree on.
    """
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return None
    if not uuid:
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _nvml_handle(device: torch.device):
    """An NVML handle for ``device`` looked up by UUID, or None when NVML is unavailable (no driver, container
    limits, a UUID NVML does not know). Never falls back to the CUDA index: that could be another GPU."""
    global _NVML_READY
    if _NVML_READY is False:
        return None
    try:
        import pynvml

        if _NVML_READY is None:
            pynvml.nvmlInit()
            _NVML_READY = True
    except Exception:
        _NVML_READY = False
        return None
    uuid = _nvml_uuid(device)
    if uuid is None:
        return None
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:
        return None


def nvml_reader(device: torch.device) -> tuple[Callable[[], int], str] | None:
    """A function reading ``device``'s NVML memory figure (bytes) and its scope, or None without NVML.

    Scope ``"process"`` when NVML lists this process (by PID) among the device's compute processes with a known
    ``usedGpuMemory``; otherwise ``"device"``: the device's used memory (``nvmlDeviceGetMemoryInfo(...).used``).
    The scope is chosen once, before the sample, so one sample's peak never mixes the two.
    """
    handle = _nvml_handle(device)
    if handle is None:
        return None
    import pynvml

    pid = os.getpid()

    def process_bytes() -> int:
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid:
                if proc.usedGpuMemory is None:  # NVML_VALUE_NOT_AVAILABLE (e.g. Windows WDDM)
                    raise LookupError("NVML has no per-process memory figure")
                return int(proc.usedGpuMemory)
        raise LookupError(f"NVML does not list pid {pid} on this device")

    def device_bytes() -> int:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)

    for read, scope in ((process_bytes, NVML_PROCESS), (device_bytes, NVML_DEVICE)):
        try:
            read()
        except Exception:
            continue
        return read, scope
    return None
