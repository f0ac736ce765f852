"""Crash isolation (issue 38): a worker whose models and measurements live in a child process.

A decoder that crashes natively (a segfault in a CUDA kernel, ``os.abort()`` in a plugin, an out-of-memory kill)
takes its whole process down. With ``isolation: process`` (the default on every device since issue 50) the local executor keeps one child
process (``multiprocessing``'s *spawn* start method: no CUDA state is inherited) that loads the target and draft once
and measures prompt groups exactly as the in-process :class:`~dtbench.harness.execution.worker.Worker` does (it *is* one, in
the child). The parent only forwards requests and outcomes. When the child dies, the cell it was measuring fails with
the signal's name (``SIGSEGV``, ``SIGABRT``, ...) and the tail of the faulthandler trace the child wrote; a fresh
child is started (its models loaded again) and the group goes on with its remaining decoders; results stored before
are untouched and ``--resume`` does not redo done cells. The child ignores Ctrl-C (the parent stops it), and its
stderr goes to the trace file, so a crash prints nothing on the terminal but the runner's own lines. The log is
emptied as each cell starts (:func:`begin_cell_log`, issue 59 item 8), so a crashed or killed cell's error, and the
log kept for it, hold that cell's own output only, never an earlier cell's.

Cost: one process start plus one model load per child (once per run unless a cell crashes) and a pipe round trip per
decoder per group; docs/measurement.md gives the measured figure.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from dtbench.core import redact_credentials
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.execution import deadline, proctree
from dtbench.harness.execution.proctree import signal_name
from dtbench.harness.execution.worker import WorkerInfo
from dtbench.harness.measurement import load
from dtbench.harness.measurement.cells import Outcome
from dtbench.harness.measurement.sample import Reference
from dtbench.harness.safetext import printable
from dtbench.harness.suites.plan import Plan, PromptGroup
from dtbench.harness.suites.suite import Suite

TRACE_TAIL = 1500  # characters of the faulthandler trace stored in the failed cell's error
OUTPUT_TAIL = 300  # characters of the child's output (its log's last lines) shown with a crash or a kill
LOG_CAP_BYTES = 64 << 20  # the child's log is emptied at the end of a cell once it holds more than this
KILL_GRACE_S = 10.0  # the parent kills a child this long (or a tenth of the limit, if longer) past a deadline


def isolation_of(suite: Suite, device_type: str) -> str:
    """The isolation a run uses: the suite's ``isolation``; ``auto`` is ``process`` on every device (issue 50: a
    native crash on the CPU lost the run's state too); ``none`` measures in the driver's process (debugging).
    ``device_type`` is kept for callers; it no longer changes the answer."""
    mode = getattr(suite, "isolation", "auto")
    return "process" if mode == "auto" else mode


def kill_grace(seconds: float) -> float:
    """Seconds the parent waits past a child's deadline of ``seconds`` before it kills the child."""
    return max(KILL_GRACE_S, 0.1 * seconds)


def _after_cell(worker, trace_path: str) -> None:
    """In the child when a cell ends: kill the processes its decoder left (launched servers spared), and empty an
    oversized log."""
    proctree.sweep({server.proc.pid for server in worker.servers.servers.values()})
    try:
        if os.path.getsize(trace_path) > LOG_CAP_BYTES:
            os.truncate(trace_path, 0)  # the log is opened for appending: later output starts at 0
            print(f"[dtbench: log emptied at {LOG_CAP_BYTES} bytes]", file=sys.stderr)
    except OSError:
        pass


def begin_cell_log(trace_path: str) -> None:
    """In the child as a cell starts: empty its log (issue 59 item 8), so the tail a crash or a kill shows, and the
    log kept for it, are this cell's own output. The log is open for appending: later output starts at 0."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        os.truncate(trace_path, 0)
    except OSError:
        pass


def _child(conn, trace_path: str, suite: Suite, device: str, plan: Plan, threads: int | None) -> None:
    """The child process: a :class:`~dtbench.harness.execution.worker.Worker` serving requests from ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops this process
    os.environ[load.DRIVER_ENV] = str(os.getppid())  # the load note counts the driver's tree as dtbench's own
    os.setpgid(0, 0)  # its own process group, which the parent kills with it (issue 50)
    proctree.become_subreaper()  # what a decoder starts stays a descendant (proctree)
    proctree.die_with_parent()  # a killed run (SIGKILL) takes its measuring child with it
    trace = open(trace_path, "a", buffering=1)  # noqa: SIM115  (open for the process's whole life)
    os.dup2(trace.fileno(), 1)  # a decoder's prints go to the log, not the terminal (issue 50 item D)
    os.dup2(trace.fileno(), 2)  # native crash messages and tracebacks go to the log too
    sys.stdout = sys.stderr = trace
    faulthandler.enable(file=trace, all_threads=True)
    deadline.observe(lambda seconds, phase: conn.send(("deadline", seconds, phase)))  # the parent kills past it
    from dtbench.harness.execution.worker import Worker

    try:
        worker = Worker(suite, device, plan=plan, threads=threads)
    except BaseException as exc:  # noqa: BLE001  (reported to the parent as one line)
        conn.send(("error", f"{type(exc).__name__}: {exc}" if not isinstance(exc, DtbenchError) else str(exc)))
        return
    conn.send(("info", worker.info))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        kind = message[0]
        if kind == "close":
            break
        if kind == "run":
            _, group, prompt, done, skip = message

            def announce(label: str) -> None:
                begin_cell_log(trace_path)  # the cell's error shows its own output only
                conn.send(("start", label))

            for outcome in worker.run(group, prompt, done, skip, announce=announce):
                _after_cell(worker, trace_path)
                conn.send(("outcome", outcome))
            conn.send(("end",))
        elif kind == "calibrate":
            conn.send(("calibrated", worker.calibrate(message[1], message[2], None)))
        elif kind == "budgets":
            worker.set_budgets(message[1])
            conn.send(("ok",))
    worker.close()
    proctree.sweep()


def remember(outcome: Outcome, done: dict[str, Reference], skip: set[str]) -> None:
    """Record a measured outcome in a group's ``done`` (its :class:`~dtbench.harness.measurement.sample.Reference`: tokens, total
    seconds, CPU seconds; every row's tokens, at B > 1 the batch's seconds) or, failed, its label in ``skip``."""
    if outcome.rows is None:
        skip.add(outcome.label)
        return
    done[outcome.label] = outcome.reference()


def own_process_segments(decoders, device_type: str) -> list[tuple[str | None, set[str]]]:
    """A prompt group's decoders (plan order) cut into consecutive runs by the process that measures them: (None,
    labels) for the shared measuring process, (label, {label}) for a decoder whose ``own_process`` names this device
    type (it gets a child of its own, where no other decoder ran: issue 38, ``hf_assisted`` on CUDA)."""
    out: list[tuple[str | None, set[str]]] = []
    for cp in decoders:
        key = cp.label if device_type in getattr(cp.cls, "own_process", ()) else None
        if out and out[-1][0] is None and key is None:
            out[-1][1].add(cp.label)
        else:
            out.append((key, {cp.label}))
    return out


def fault_trace(lines: list[str], frames_shown: int = 8) -> list[str]:
    """What faulthandler wrote of a native crash among a log's ``lines``: its "Fatal Python error" line and the
    crashing thread's innermost ``frames_shown`` frames (without the extension-module list); [] when it wrote none."""
    fatal = [line for line in lines if line.startswith("Fatal Python error")]
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    frames = [line for line in lines[start + 1 :] if line.startswith("File ")] if start is not None else []
    return [*fatal[-1:], *frames[:frames_shown]] if fatal or frames else []


class IsolatedWorker:
    """A :class:`~dtbench.harness.execution.worker.Worker` in a child process: the same ``info``, ``run``, ``calibrate``,
    ``set_budgets`` and ``close``, with a native crash failing only the cell being measured (module docstring).

    Args:
        suite, device, plan, threads: what the child's Worker is made from (the plan pickled across).

    Raises:
        DtbenchError: the child could not load the models (its one-line error), or died while loading them.
    """

    def __init__(self, suite: Suite, device: str, plan: Plan, threads: int | None = None):
        self.suite, self.device, self.plan, self.threads = suite, device, plan, threads
        self.budgets: dict[str, int] | None = None
        self.children = 0  # processes started (1 + crashes survived)
        self.kept: list[str] = []  # logs of children that crashed or were killed (kept for the user)
        # the child's current deadline: (limit s, kill at monotonic s, its phase's words, "" for a sample)
        self._deadline: tuple[float, float, str] | None = None
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        fd, self.trace_path = tempfile.mkstemp(prefix="dtbench-child-", suffix=".log")
        os.close(fd)
        self.proc = ctx.Process(
            target=_child,
            args=(child, self.trace_path, self.suite, self.device, self.plan, self.threads),
            daemon=True,
        )
        self._deadline = None
        self.proc.start()
        child.close()
        self.children += 1
        kind, payload = self._receive()
        if kind == "crashed":
            raise DtbenchError(f"the measuring process died while loading the models ({payload})")
        if kind == "error":
            raise DtbenchError(payload)
        self.info: WorkerInfo = payload
        if self.budgets:
            self._request(("budgets", self.budgets))

    def _receive(self) -> tuple[str, Any]:
        """The child's next message; ("crashed", description) when it died; ("killed", description) when it ran
        :func:`kill_grace` past a deadline it announced (blocked in native code: the async exception of
        :class:`~dtbench.harness.execution.deadline.Deadline` cannot stop it) and was killed with its process group."""
        while True:
            try:
                if self.conn.poll(0.5):
                    message = self.conn.recv()
                    if message[0] == "deadline":
                        limit, phase = message[1], (message[2] if len(message) > 2 else "")
                        self._deadline = (
                            None if limit is None else (limit, time.monotonic() + limit + kill_grace(limit), phase)
                        )
                        continue
                    return message[0], (message[1] if len(message) > 1 else None)
            except (EOFError, OSError):  # the pipe closed: the child is gone
                break
            if self._deadline is not None and time.monotonic() > self._deadline[1]:
                limit, _, phase = self._deadline
                self._deadline = None
                proctree.kill_tree(self.proc.pid or 0)
                self.proc.join(5)
                return "killed", (
                    f"timed out after {limit:g} s{f' ({phase})' if phase else ''} and did not stop (blocked outside "
                    f"Python): its measuring process and process group were killed{self._output_tail()}"
                )
            if not self.proc.is_alive() and not self.conn.poll(0):
                break
        self.proc.join(5)
        return "crashed", self._crash_text()

    def _log_tail(self, size: int = 65536) -> str:
        try:
            with open(self.trace_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.trace_path) - size))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _output_tail(self) -> str:
        """``; output: ...`` with the last lines the child printed (escaped, clipped) and where its log is kept."""
        self.kept.append(self.trace_path)
        lines = [line.strip() for line in self._log_tail(4096).splitlines() if line.strip()]
        tail = printable(redact_credentials(" | ".join(lines[-3:])))[-OUTPUT_TAIL:]  # a child's output: by value too
        return (f"; output: ...{tail}" if tail else "") + f"; log {self.trace_path}"

    def _crash_text(self) -> str:
        lines = [line.strip() for line in self._log_tail().splitlines() if line.strip()]
        trace = fault_trace(lines)
        where = f"; faulthandler: {clip(printable(' | '.join(trace)), TRACE_TAIL)}" if trace else self._output_tail()
        if trace:
            self.kept.append(self.trace_path)
            where += f"; log {self.trace_path}"
        return f"the measuring process died of {signal_name(self.proc.exitcode)}{where}"

    def _request(self, message: tuple) -> Any:
        self.conn.send(message)
        kind, payload = self._receive()
        if kind in ("crashed", "killed"):
            self._restart()
            raise DtbenchError(payload)
        return payload

    def _restart(self) -> None:
        self._stop()
        self._start()

    def run(
        self, group: PromptGroup, prompt, done: dict[str, Reference], skip: set[str], announce=None
    ) -> Iterator[Outcome]:
        """Measure one prompt group in the child, yielding each outcome; a crash fails the decoder being measured
        (an :class:`~dtbench.harness.measurement.cells.Outcome` with the signal and trace) and the group goes on in a fresh
        child with the remaining decoders. ``announce(label)``: called as the child starts each decoder."""
        done, skip = dict(done), set(skip)
        while True:
            self.conn.send(("run", group, prompt, done, skip))
            current = None
            while True:
                kind, payload = self._receive()
                if kind == "start":
                    current = payload
                    if announce is not None:
                        announce(payload)
                elif kind == "outcome":
                    current = None
                    remember(payload, done, skip)
                    yield payload
                elif kind == "end":
                    return
                else:  # crashed, or killed past its deadline
                    if current is None:  # between decoders: nothing of this group was lost but the process
                        self._restart()
                        break
                    why = "crashed: " if kind == "crashed" else ""
                    yield Outcome(current, error=f"prompt {group.prompt_index}: {why}{payload}")
                    skip.add(current)
                    self._restart()
                    break

    def calibrate(self, contexts, settings, console=None):
        """The cost model's curves measured in the child (plain data)."""
        return self._request(("calibrate", contexts, settings))

    def set_budgets(self, budgets: dict[str, int]) -> None:
        """The resolved ``n_max: auto`` budgets, handed to this and every later child."""
        self.budgets = dict(budgets)
        self._request(("budgets", self.budgets))

    def _stop(self) -> None:
        try:
            if self.proc.is_alive():
                try:
                    self.conn.send(("close",))
                except (OSError, EOFError):
                    pass
                self.proc.join(10)
            if self.proc.is_alive() and self.proc.pid is not None:
                proctree.kill_tree(self.proc.pid)
                self.proc.join(5)
            if self.proc.pid is not None:
                proctree.kill_group(self.proc.pid)  # whatever the decoder left in the child's group
        finally:
            self.conn.close()
            if self.trace_path not in self.kept:
                try:
                    os.unlink(self.trace_path)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop the child (its launched servers with it); never raises."""
        try:
            self._stop()
        except Exception:  # noqa: BLE001
            pass
