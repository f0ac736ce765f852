"""Energy of one sample (joules), measured by the runner beside the clock and the memory trackers (issue 24).

Through Zeus (``pip install 'dtbench[energy]'``; https://ml.energy/zeus, ``zeus.monitor.ZeusMonitor``): on CUDA the
GPU's cumulative energy counter (NVML ``nvmlDeviceGetTotalEnergyConsumption``, millijoules, Volta and newer), on CPU
the RAPL package counters (plus DRAM where exposed) of ``/sys/class/powercap/intel-rapl``. A sample's energy is the
counter's increase over the sample's window; J/token and tokens/J are derived from it
(:mod:`dtbench.harness.measurement.metrics`).

Never estimated: where no counter is readable (Zeus not installed, a GPU older than Volta, no RAPL interface or no
permission to read it, as on this project's CPU machines) the sample's energy is None with status
:data:`UNAVAILABLE` and the reason in its source; never a TDP times a time, and never Zeus's
``approx_instant_energy``. A window shorter than the counter's update period (NVML: tens of ms, probed once per
process by :func:`probe_update_period`; RAPL: about 1 ms) is marked :data:`TOO_SHORT` with energy None, never stored
as 0. A counter that went backwards over a window wrapped around: by its range where the range is known (RAPL's
``max_energy_range_uj``; Zeus normally corrects RAPL wraps itself, this catches one its polling missed), else the
window is marked :data:`COUNTER_RESET` (NVML's 64-bit counter only goes back when the driver is reloaded).
"""

from __future__ import annotations

import glob
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MEASURED, UNAVAILABLE, TOO_SHORT, COUNTER_RESET = "measured", "unavailable", "too_short", "counter_reset"
RAPL_UPDATE_PERIOD_S = 0.001  # Intel SDM: the RAPL energy status counters update about every 1 ms
NVML_DEFAULT_PERIOD_S = 0.1  # used when probing saw no update (a conservative bound on "tens of ms")
PROBE_S = 0.5  # how long probe_update_period polls the counter
RAPL_DIRS = ("/sys/class/powercap/intel-rapl", "/zeus_sys/class/powercap/intel-rapl")  # Zeus's paths (host, container)


@dataclass
class EnergyReading:
    """The energy of one sample.

    Attributes:
        energy_j: joules over the sample's window, None unless ``status`` is :data:`MEASURED`.
        status: :data:`MEASURED`, :data:`UNAVAILABLE`, :data:`TOO_SHORT` or :data:`COUNTER_RESET`.
        source: what counted it ("nvml:gpu0", "rapl:package+dram"), or why nothing could (status unavailable).
        window_s: the window's length in seconds as the monitor timed it (None when nothing was measured).
    """

    energy_j: float | None
    status: str
    source: str | None
    window_s: float | None = None


def sample_columns(reading: EnergyReading | None) -> dict[str, Any]:
    """The samples columns of a sample's reading (``energy_j`` joules, ``energy_status``, ``energy_source``; all None
    without a reading)."""
    if reading is None:
        return {"energy_j": None, "energy_status": None, "energy_source": None}
    return {
        "energy_j": reading.energy_j,
        "energy_status": reading.status,
        "energy_source": (reading.source or "")[:200] or None,
    }


@dataclass
class Counter:
    """One cumulative energy counter of a window's :class:`zeus.monitor.energy.Measurement` (joules).

    ``field`` is ``gpu_energy``, ``cpu_energy`` or ``dram_energy``; ``index`` the key in it; ``wrap_j`` the
    counter's range in joules where known (RAPL), else None.
    """

    field: str
    index: int
    wrap_j: float | None = None


class Meter:
    """Zeus's monitor and what dtbench knows of the counters it reads, for one device of this process.

    Args:
        monitor: a ``zeus.monitor.ZeusMonitor`` (or an object with its ``begin_window(key, sync_execution)`` /
            ``end_window(key, sync_execution)`` returning ``.time`` (s), ``.gpu_energy``, ``.cpu_energy``,
            ``.dram_energy``: dicts of joules by index, or None).
        counters: the counters whose increases add up to the sample's energy.
        source: the :attr:`EnergyReading.source` of its readings.
        update_period_s: the counters' update period; shorter windows are :data:`TOO_SHORT`.
    """

    def __init__(self, monitor, counters: list[Counter], source: str, update_period_s: float):
        self.monitor, self.counters, self.source, self.update_period_s = monitor, counters, source, update_period_s
        self._n = 0
        self._lock = threading.Lock()

    def begin(self) -> str:
        """Open a window (the device is synchronized by the runner already); its key for :meth:`end`."""
        with self._lock:
            self._n += 1
            key = f"dtbench-sample-{self._n}"
        self.monitor.begin_window(key, sync_execution=False)
        return key

    def end(self, key: str) -> EnergyReading:
        """Close window ``key``: the energy over it, or why there is none. Never raises."""
        try:
            m = self.monitor.end_window(key, sync_execution=False)
        except Exception as exc:
            return EnergyReading(None, UNAVAILABLE, f"{self.source}: reading failed: {type(exc).__name__}")
        window = float(m.time)
        if window < self.update_period_s:
            return EnergyReading(None, TOO_SHORT, self.source, window)
        total = 0.0
        for c in self.counters:
            delta = (getattr(m, c.field, None) or {}).get(c.index)
            if delta is None:
                return EnergyReading(None, UNAVAILABLE, f"{self.source}: no {c.field}[{c.index}] reading", window)
            if delta < 0:  # went backwards: a wraparound (one, if the range is known) or a reset
                if c.wrap_j is None:
                    return EnergyReading(None, COUNTER_RESET, self.source, window)
                delta += c.wrap_j
            total += delta
        if total == 0.0:  # no update of the counter inside the window: not a zero-energy sample
            return EnergyReading(None, TOO_SHORT, self.source, window)
        return EnergyReading(total, MEASURED, self.source, window)


def probe_update_period(
    read: Callable[[], float], budget_s: float = PROBE_S, clock=time.perf_counter, sleep=time.sleep
) -> float | None:
    """The update period (s) of a cumulative counter: the longest interval between two successive changes seen
    while polling ``read`` for ``budget_s`` seconds (every 1 ms), None when fewer than two changes were seen."""
    changes: list[float] = []
    last = read()
    start = clock()
    while clock() - start < budget_s:
        value = read()
        if value != last:
            changes.append(clock())
            last = value
        sleep(0.001)
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    return max(gaps) if gaps else None


def rapl_ranges_j() -> dict[int, float]:
    """RAPL package index -> its counter's range in joules (``max_energy_range_uj``), where readable."""
    out = {}
    for base in RAPL_DIRS:
        for path in glob.glob(f"{base}/intel-rapl:*/max_energy_range_uj"):
            zone = Path(path).parent.name  # intel-rapl:N
            if zone.count(":") == 1:
                try:
                    out[int(zone.split(":")[1])] = float(Path(path).read_text()) / 1e6
                except (OSError, ValueError):
                    continue
    return out


def _rapl_readable() -> bool:
    """Whether a RAPL package counter can be read here (or Zeus's daemon serves one), without importing Zeus."""
    if os.environ.get("ZEUSD_SOCK_PATH"):
        return True
    for base in RAPL_DIRS:
        for path in glob.glob(f"{base}/intel-rapl:*/energy_uj"):
            try:
                Path(path).read_text()
                return True
            except OSError:
                continue
    return False


def _zeus_monitor(**kwargs):
    """A ``zeus.monitor.ZeusMonitor`` (the seam tests replace with a fake)."""
    from zeus.monitor import ZeusMonitor

    return ZeusMonitor(**kwargs)


def _zeus_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("zeus") is not None


def make_meter(device: torch.device) -> Meter | str:
    """A :class:`Meter` for ``device``, or the one-line reason no energy counter is readable there.

    CUDA device i: NVML's total-energy counter of GPU i (Volta or newer), its update period probed. CPU: the RAPL
    packages (and DRAM zones) Zeus finds, wraps corrected by ``max_energy_range_uj``. Never raises.
    """
    if not _zeus_installed():
        return "zeus not installed (pip install 'dtbench[energy]')"
    try:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            monitor = _zeus_monitor(gpu_indices=[index], cpu_indices=[])
            if not monitor.gpus.supports_get_total_energy_consumption(index):
                return f"GPU {index} has no NVML energy counter (older than Volta)"
            period = probe_update_period(lambda: monitor.gpus.get_total_energy_consumption(index), PROBE_S)
            return Meter(monitor, [Counter("gpu_energy", index)], f"nvml:gpu{index}", period or NVML_DEFAULT_PERIOD_S)
        if not _rapl_readable():
            return "no readable RAPL energy counter on this CPU"
        monitor = _zeus_monitor(gpu_indices=[])
        if not monitor.cpu_indices:
            return "no readable RAPL energy counter on this CPU"
        ranges = rapl_ranges_j()
        counters = [Counter("cpu_energy", i, ranges.get(i)) for i in monitor.cpu_indices]
        dram = [i for i in monitor.cpu_indices if monitor.cpus.supports_get_dram_energy_consumption(i)]
        counters += [Counter("dram_energy", i) for i in dram]  # the DRAM zone's range is not read: a wrap resets
        return Meter(monitor, counters, "rapl:package+dram" if dram else "rapl:package", RAPL_UPDATE_PERIOD_S)
    except Exception as exc:  # a broken driver or permissions must never break a measurement
        return f"energy counters unreadable: {type(exc).__name__}: {str(exc)[:200]}"


_METERS: dict[str, Meter | str] = {}
_METERS_LOCK = threading.Lock()


def meter_for(device: torch.device) -> Meter | str:
    """The process's :class:`Meter` for ``device`` (made once: Zeus's setup and the period probe are not free)."""
    key = str(device)
    with _METERS_LOCK:
        if key not in _METERS:
            _METERS[key] = make_meter(device)
        return _METERS[key]


class EnergyTracker:
    """Context manager measuring the energy of the code inside it, like :class:`~dtbench.harness.measurement.memory.MemoryTracker`.

    Usage: ``with EnergyTracker(device) as energy: ...``; then ``energy.reading`` is an :class:`EnergyReading`.
    The runner synchronizes the device before entering and leaves after its last synchronize, so the window holds
    the sample's work only. Never raises.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.reading = EnergyReading(None, UNAVAILABLE, None)
        self._meter: Meter | str | None = None
        self._key: str | None = None

    def __enter__(self) -> EnergyTracker:
        self._meter = meter_for(self.device)
        if isinstance(self._meter, str):
            self.reading = EnergyReading(None, UNAVAILABLE, self._meter)
            return self
        try:
            self._key = self._meter.begin()
        except Exception as exc:
            self.reading = EnergyReading(None, UNAVAILABLE, f"{self._meter.source}: {type(exc).__name__}")
        return self

    def __exit__(self, *exc: Any) -> None:
        if isinstance(self._meter, Meter) and self._key is not None:
            self.reading = self._meter.end(self._key)
