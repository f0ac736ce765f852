"""The time limit of a decoder's code (issue 19, issue 50): :class:`Deadline` and :class:`SampleTimeout`.

Every call of a decoder's code runs under its cell's deadline: its construction and corpus (``make_decoder``), the
compile step of a compiled cell (:meth:`~dtbench.harness.measurement.hardware.Hardware.compile_step`) and each sample
(:func:`~dtbench.harness.measurement.measure.measure_rows`). A deadline raises :class:`SampleTimeout` asynchronously in the
measuring thread; a decoder blocked in one native call (``time.sleep(10**6)``, a hung kernel) cannot be interrupted
that way, so a process that measures in a child (``isolation: process``, :mod:`dtbench.harness.execution.isolation`) also tells
its parent every deadline it enters (:func:`observe`): the parent kills the child and its process group once the
deadline and a grace margin have passed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_observer: Callable[[float | None, str], None] | None = None


def observe(callback: Callable[[float | None, str], None] | None) -> None:
    """Call ``callback(seconds, phase)`` in the measuring thread when a :class:`Deadline` with a wall limit of
    ``seconds`` is entered (``phase``: its words, e.g. ``in the compile step``, "" for a sample) and
    ``callback(None, "")`` when it is left (None: stop observing). Used by the isolated child to hand its deadlines to
    the parent (which names the phase when it kills the child: issue 59 item 8); a deadline without a wall limit is
    not reported."""
    global _observer
    _observer = callback


class SampleTimeout(BaseException):
    """Raised inside a decoder that ran past the per-sample time limit.

    A BaseException, so a plugin's broad ``except Exception`` cannot swallow it.
    """


class Deadline:
    """Raises :class:`SampleTimeout` in the measuring thread once ``seconds`` of wall time, or ``cpu_seconds`` of
    this process's CPU time, have passed (None: no such limit).

    A watchdog thread raises the exception asynchronously in the measuring thread (``PyThreadState_SetAsyncExc``),
    so a decoder stuck in pure Python between two yields is stopped too, in any thread; a single long native call
    (one huge matmul) is interrupted when it returns. The CPU-time limit is the load-independent one: on a machine
    shared with other work the process gets less CPU per wall second, so wall time stretches with the load and CPU
    time does not (a busy decoder still burns CPU and is stopped by it; a blocked one by the wall limit).
    ``phase``: words naming what runs under it (``in the compile step``; "" for a sample), handed to the observer.
    """

    POLL_S = 0.25

    def __init__(self, seconds: float | None, cpu_seconds: float | None = None, phase: str = ""):
        self.seconds, self.cpu_seconds, self.phase = seconds, cpu_seconds, phase
        self.fired = False
        self._lock = threading.Lock()
        self._armed = False
        self._timer: threading.Thread | None = None
        self._stop = threading.Event()
        self._tid = threading.get_ident()

    def _fire(self) -> None:
        import ctypes

        with self._lock:
            if self._armed:
                self.fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), ctypes.py_object(SampleTimeout))

    def _watch(self, wall0: float, cpu0: float) -> None:
        while not self._stop.wait(self.POLL_S):
            if (self.seconds is not None and time.monotonic() - wall0 >= self.seconds) or (
                self.cpu_seconds is not None and time.process_time() - cpu0 >= self.cpu_seconds
            ):
                self._fire()
                return

    def __enter__(self) -> Deadline:
        if self.seconds is not None and _observer is not None:
            _observer(self.seconds, self.phase)
        if self.seconds is not None or self.cpu_seconds is not None:
            self._armed = True
            self._timer = threading.Thread(
                target=self._watch, args=(time.monotonic(), time.process_time()), daemon=True, name="dtbench-deadline"
            )
            self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.seconds is not None and _observer is not None:
            _observer(None, "")
        if self._timer is None:
            return
        import ctypes

        with self._lock:
            self._armed = False
            if self.fired:  # not delivered yet (we left on our own): withdraw it
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), None)
        self._stop.set()


# --- the limits of a cell's samples (suite ``timeout_s``; moved from harness/measurement/cells.py, issue 58 item 7) ---------

AUTO_TIMEOUT_FACTOR, AUTO_TIMEOUT_MIN_S, AUTO_TIMEOUT_REFERENCE_S = 10.0, 60.0, 1800.0


def sample_timeout(setting: float | str | None, reference_s: float | None) -> float | None:
    """The time limit of one sample in seconds (suite ``timeout_s``).

    ``auto``: 10x the reference decoder's time on the same prompt, at least 60 s; a reference itself (or a
    decoder whose reference time is unknown) gets 1800 s. A number is used as is; None means no limit.
    """
    if setting is None:
        return None
    if setting != "auto":
        return float(setting)
    if reference_s is None:
        return AUTO_TIMEOUT_REFERENCE_S
    return max(AUTO_TIMEOUT_MIN_S, AUTO_TIMEOUT_FACTOR * reference_s)


def cpu_timeout(
    setting: float | str | None, reference_s: float | None, reference_cpu_s: float | None
) -> tuple[float | None, float | None]:
    """(wall limit, CPU limit) of one sample in seconds: ``auto`` measured in CPU time when the reference's is known.

    On a shared machine the wall time of a sample stretches with whatever else runs, so ``10x the reference's wall
    time`` failed cells that would have finished when the load rose between the reference and the decoder (issue
    19: ``hf_assisted`` past 60 s while ``ar`` took 4.2 s). The process's CPU time stretches far less with the load:
    ``auto`` with the reference's CPU time gives the decoder 10x that (at least 60 s) of CPU time, and keeps a wall
    limit of max(1800 s, 10x the reference's wall time) for a decoder that blocks without computing. A number, None,
    or a reference measured without CPU time (a resumed run's stored samples): :func:`sample_timeout`, wall only.
    """
    if setting != "auto" or reference_s is None or reference_cpu_s is None:
        return sample_timeout(setting, reference_s), None
    return (
        max(AUTO_TIMEOUT_REFERENCE_S, AUTO_TIMEOUT_FACTOR * reference_s),
        max(AUTO_TIMEOUT_MIN_S, AUTO_TIMEOUT_FACTOR * reference_cpu_s),
    )
