"""The machine's load around every measured cell (issue 41): was the machine busy while a cell was measured?

The worker reads the machine (:func:`probe`) right before and right after each decoder's measurement of a prompt
group (its samples and their lossless check); :func:`span` turns the two readings into plain data shipped with the
outcome, and the runner folds the spans of a cell into its row (:func:`merge`, the ``cells`` columns of migration
0014). Definitions:

- ``load_start`` / ``load_end``: the 1-minute load average (``os.getloadavg()[0]``: runnable and uninterruptible
  threads, exponentially averaged over about a minute) right before the cell's first measured sample and right after
  its last one (a resumed run keeps the first session's start).
- ``others_load_max``: the largest, over the cell's readings, of the 1-minute load minus this process tree's own
  contribution (its CPU seconds per wall second over the minute before the reading: dtbench's own threads are
  runnable too, so a quiet 2-core machine running dtbench on 2 threads shows a load near 2); at least 0.
- ``others_cpu_s`` / ``capacity_cpu_s``: over the cell's samples, the CPU seconds other processes took (system-wide
  busy CPU time, ``psutil.cpu_times()`` less idle, iowait and guest time, minus this process tree's, i.e. this
  process and its live descendants such as a launched llama-server, plus children it reaped) and the CPU seconds
  there were (wall seconds x CPU count). Their ratio is the *others' CPU share*: 0.47 means other processes kept
  47% of all cores busy while the cell was measured. With ``--executor ray`` the other workers of the same host
  count as other processes.
- ``cpu_count``: logical CPUs (``os.cpu_count()``); ``cpu_mhz_start`` / ``cpu_mhz_end``: the current CPU frequency
  in MHz (``psutil.cpu_freq()``, the mean over cores), None where the platform does not expose it (many VMs).

A cell is *busy* (:func:`busy`) when its load, less its own contribution, was above half the CPUs, or other
processes took more than 10% of the CPU time: reports mark it with one line (:func:`note`). Cells written before
0014 have no load columns: no note.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import psutil

from dtbench.harness.errors import DtbenchError

BUSY_LOAD_PER_CPU = 0.5  # busy: load from others above this many per CPU (half the cores)
BUSY_OTHERS_SHARE = 0.10  # busy: other processes took more than this share of the CPU time
OWN_WINDOW_S = 60.0  # the 1-minute load's window: this process's own CPU rate is taken over it

COLUMNS = (
    "cpu_count",
    "load_start",
    "load_end",
    "others_load_max",
    "others_cpu_s",
    "capacity_cpu_s",
    "cpu_mhz_start",
    "cpu_mhz_end",
)


@dataclass(frozen=True)
class Reading:
    """One look at the machine.

    Attributes:
        at_s: ``time.monotonic()`` (s).
        cpus: logical CPUs.
        load_1m: 1-minute load average (runnable threads), None where the platform has none.
        own_load: this process tree's CPU seconds per wall second over the last minute (its share of ``load_1m``).
        busy_cpu_s: system-wide busy CPU seconds since boot, all cores summed; None where unreadable.
        own_cpu_s: CPU seconds of this process, its live descendants and the children it reaped.
        cpu_mhz: mean current CPU frequency (MHz), None where unreadable.
    """

    at_s: float
    cpus: int
    load_1m: float | None
    own_load: float
    busy_cpu_s: float | None
    own_cpu_s: float
    cpu_mhz: float | None


_history: deque[tuple[float, float]] = deque()  # (monotonic s, own CPU s) of earlier probes, for own_load


def _busy_cpu_s() -> float | None:
    try:
        t = psutil.cpu_times()._asdict()
    except (OSError, RuntimeError):
        return None
    idle = sum(t.get(k, 0.0) for k in ("idle", "iowait", "guest", "guest_nice"))  # guest is inside user/nice
    return float(sum(t.values()) - idle)


DRIVER_ENV = "DTBENCH_DRIVER_PID"  # set in a measuring child (harness/execution/isolation.py): the run's driver process


def _own_root() -> psutil.Process:
    """The root of dtbench's own process tree: the run's driver (a measuring child's parent: its threads, a plugin's
    import left running among them, are dtbench's own, never "other processes"; issue 67 item 5), else this
    process."""
    pid = os.environ.get(DRIVER_ENV, "")
    if pid.isdigit():
        try:
            return psutil.Process(int(pid))
        except psutil.Error:
            pass
    return psutil.Process()


def _own_cpu_s() -> float:
    me = _own_root()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
    return total


def _cpu_mhz() -> float | None:
    try:
        freq = psutil.cpu_freq()
    except (OSError, RuntimeError, NotImplementedError, AttributeError):
        return None
    return float(freq.current) if freq is not None and freq.current and freq.current > 0 else None


def _own_load(now: float, own: float) -> float:
    """This process tree's CPU seconds per wall second over the last :data:`OWN_WINDOW_S` (its share of the load):
    from the earlier probes in the window, or since the process started when none is 10 s old or more."""
    while _history and now - _history[0][0] > OWN_WINDOW_S:
        _history.popleft()
    if _history and now - _history[0][0] >= 10.0:
        t0, c0 = _history[0]
        rate = (own - c0) / (now - t0)
    else:
        try:
            age = time.time() - psutil.Process().create_time()
        except (psutil.Error, OSError):
            age = 0.0
        rate = own / age if age > 0 else 0.0
    _history.append((now, own))
    return max(0.0, rate)


def probe() -> Reading:
    """Read the machine now (a few milliseconds: /proc reads; never raises for an unreadable counter)."""
    now = time.monotonic()
    try:
        load: float | None = float(os.getloadavg()[0])
    except (OSError, AttributeError):
        load = None
    own = _own_cpu_s()
    return Reading(
        at_s=now,
        cpus=os.cpu_count() or 1,
        load_1m=load,
        own_load=_own_load(now, own),
        busy_cpu_s=_busy_cpu_s(),
        own_cpu_s=own,
        cpu_mhz=_cpu_mhz(),
    )


def _others_load(r: Reading) -> float | None:
    return None if r.load_1m is None else max(0.0, r.load_1m - r.own_load)


def span(start: Reading, end: Reading) -> dict[str, Any]:
    """The load of one measured span (a decoder on one prompt group) as plain data (what a worker ships):
    :data:`COLUMNS` for this span alone (``others_cpu_s`` clipped to [0, ``capacity_cpu_s``])."""
    capacity = max(0.0, end.at_s - start.at_s) * end.cpus
    others = None
    if start.busy_cpu_s is not None and end.busy_cpu_s is not None:
        delta = (end.busy_cpu_s - start.busy_cpu_s) - (end.own_cpu_s - start.own_cpu_s)
        others = min(max(0.0, delta), capacity)
    loads = [v for v in (_others_load(start), _others_load(end)) if v is not None]
    return {
        "cpu_count": end.cpus,
        "load_start": start.load_1m,
        "load_end": end.load_1m,
        "others_load_max": max(loads) if loads else None,
        "others_cpu_s": others,
        "capacity_cpu_s": capacity if others is not None else None,
        "cpu_mhz_start": start.cpu_mhz,
        "cpu_mhz_end": end.cpu_mhz,
    }


def merge(cell: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """A cell's load columns after one more span: the start kept from its first span (set now if missing), the end
    from this one, the largest others' load, CPU seconds summed. ``cell`` holds :data:`COLUMNS` (None: not yet)."""
    out = dict(cell)
    for key in ("load_start", "cpu_mhz_start"):
        if out.get(key) is None:
            out[key] = part.get(key)
    for key in ("load_end", "cpu_mhz_end", "cpu_count"):
        if part.get(key) is not None:
            out[key] = part[key]
    loads = [v for v in (out.get("others_load_max"), part.get("others_load_max")) if v is not None]
    out["others_load_max"] = max(loads) if loads else None
    if part.get("others_cpu_s") is not None and part.get("capacity_cpu_s") is not None:
        out["others_cpu_s"] = (out.get("others_cpu_s") or 0.0) + part["others_cpu_s"]
        out["capacity_cpu_s"] = (out.get("capacity_cpu_s") or 0.0) + part["capacity_cpu_s"]
    return out


def _number(value: Any) -> float | None:
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def others_share(row: Any) -> float | None:
    """Other processes' share of the CPU time during a cell (0-1), None where not recorded."""
    others, capacity = _number(row.get("others_cpu_s")), _number(row.get("capacity_cpu_s"))
    return others / capacity if others is not None and capacity else None


def busy(row: Any) -> bool:
    """Whether a cell (a mapping with :data:`COLUMNS`) was measured on a busy machine: the load from other processes
    above half its CPUs, or other processes taking more than 10% of the CPU time. False where nothing was recorded."""
    cpus, load = _number(row.get("cpu_count")), _number(row.get("others_load_max"))
    share = others_share(row)
    return bool((cpus and load is not None and load > BUSY_LOAD_PER_CPU * cpus) or (share or 0.0) > BUSY_OTHERS_SHARE)


def describe(row: Any) -> str:
    """The load of a cell in words: ``1-min load 5.1 (4.2 from other processes) on 2 CPUs, other processes took 47%
    of the CPU time``; "" where nothing was recorded."""
    cpus = _number(row.get("cpu_count"))
    loads = [v for v in (_number(row.get("load_start")), _number(row.get("load_end"))) if v is not None]
    if cpus is None or not loads:
        return ""
    shown = (
        f"{loads[0]:.1f}" if len(loads) == 1 or abs(loads[0] - loads[1]) < 0.05 else f"{loads[0]:.1f}-{loads[1]:.1f}"
    )
    text = f"1-min load {shown}"
    others = _number(row.get("others_load_max"))
    if others is not None:
        text += f" ({others:.1f} from other processes)"
    text += f" on {int(cpus)} CPUs"
    share = others_share(row)
    if share is not None:
        text += f", other processes took {share:.0%} of the CPU time"
    return text


def note(row: Any) -> str | None:
    """The one-line note a busy cell gets in every report format (:func:`busy`), else None."""
    if not busy(row):
        return None
    return f"{row.get('label', 'cell')}: measured on a busy machine: {describe(row)}"


def quiet_threshold(value: str | float | None, cpus: int | None = None) -> float:
    """The 1-minute load ``--require-quiet[=LOAD]`` waits for: LOAD, or half the CPUs when no value is given.

    Raises:
        DtbenchError: a LOAD that is not a positive number.
    """
    cpus = cpus or os.cpu_count() or 1
    if value is None or value == "" or value == "auto":
        return BUSY_LOAD_PER_CPU * cpus
    try:
        load = float(value)
    except (TypeError, ValueError):
        raise DtbenchError(f"--require-quiet={value!r}: expected a 1-minute load average such as 1.0") from None
    if not math.isfinite(load) or load <= 0:
        raise DtbenchError(f"--require-quiet={value!r}: expected a positive 1-minute load average")
    return load


def wait_quiet(below: float, limit_s: float, say=None, poll_s: float = 5.0, loadavg=None) -> float:
    """Wait until the 1-minute load average is below ``below``, at most ``limit_s`` seconds (``--require-quiet``).

    Args:
        below: the load to wait for (:func:`quiet_threshold`).
        limit_s: seconds to wait at most.
        say: called with one line when it starts waiting (None: silent).
        poll_s: seconds between readings.
        loadavg: the reading (default ``os.getloadavg()[0]``; tests inject one).

    Returns:
        The load it found below ``below``.

    Raises:
        DtbenchError: still at or above ``below`` after ``limit_s`` (one line with the load), or no load average on
            this platform.
    """
    read = loadavg or (lambda: float(os.getloadavg()[0]))
    try:
        load = read()
    except (OSError, AttributeError):
        raise DtbenchError("--require-quiet: this platform has no load average") from None
    deadline = time.monotonic() + limit_s
    if load >= below and say is not None:
        say(f"waiting up to {limit_s:g} s for the 1-min load ({load:.2f}) to drop below {below:g}")
    while load >= below:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DtbenchError(
                f"the machine is not quiet: 1-min load {load:.2f} is not below {below:g} after waiting "
                f"{limit_s:g} s ({os.cpu_count() or 1} CPUs); nothing was run"
            )
        time.sleep(min(poll_s, left))
        load = read()
    return load


def run_load(cells: list[Any]) -> dict[str, Any]:
    """A run's load over its cells (mappings with :data:`COLUMNS`): the CPU count, the first start and last end
    load, the largest others' load, the CPU seconds summed; all None when no cell recorded any."""
    out: dict[str, Any] = dict.fromkeys(COLUMNS)
    for cell in cells:
        if _number(cell.get("cpu_count")) is None:
            continue
        part = {k: (_number(cell.get(k)) if k != "cpu_count" else int(cell.get(k))) for k in COLUMNS}
        out = merge(out, part)
    return out


DIFFER_LOAD_PER_CPU = 0.25  # two runs' others' loads differ by more than a quarter of the CPUs
DIFFER_SHARE = 0.10  # ... or their others' CPU shares by more than 10 points


def loads_differ(before: dict[str, Any], after: dict[str, Any], names: tuple[str, str]) -> str | None:
    """One line when two runs' loads (:func:`run_load`) differ: one busy and the other not (:func:`busy`), the
    load from other processes apart by more than a quarter of the CPUs, or the others' CPU shares by more than 10
    points; None when they do not, or either run has no load recorded (stored before migration 0014)."""
    if _number(before.get("cpu_count")) is None or _number(after.get("cpu_count")) is None:
        return None
    cpus = max(int(before["cpu_count"]), int(after["cpu_count"]))
    lb, la = _number(before.get("others_load_max")) or 0.0, _number(after.get("others_load_max")) or 0.0
    sb, sa = others_share(before) or 0.0, others_share(after) or 0.0
    if busy(before) == busy(after) and abs(lb - la) <= DIFFER_LOAD_PER_CPU * cpus and abs(sb - sa) <= DIFFER_SHARE:
        return None

    def side(name: str, row: dict[str, Any]) -> str:
        return f"{name}: {describe(row)}" + (" (busy)" if busy(row) else "")

    return (
        f"the two runs' machine load differs ({side(names[0], before)}; {side(names[1], after)}): "
        f"their timings may differ for that reason"
    )
