"""A measuring process's own child processes (issue 50 item C): what a decoder starts ends with its cell.

A decoder may start processes (``subprocess.Popen(["sleep", "1000"])``, with ``start_new_session=True`` too) and
leave them running. Under ``isolation: process`` (:mod:`dtbench.harness.execution.isolation`) the measuring child is its own
process group leader and a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``: a process its descendants leave
behind, double-forked daemons included, is re-parented to it rather than to init), so every process a decoder
started stays its descendant: :func:`sweep` kills them when the cell ends, and the parent's :func:`kill_tree` kills
the child, its process group and every descendant found when it must stop the child (a deadline passed, the run
ends). Processes the harness itself keeps across cells are spared: launched servers (their pids handed in) and
torch's compile workers (``torch/_inductor`` on their command line).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

import psutil

PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux); True when it is one."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except OSError:
        return False


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it dies (Linux ``PR_SET_PDEATHSIG``): a measuring child
    in a process group of its own no longer gets the terminal's signals, and must not outlive a killed run."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass


def _spared(proc: psutil.Process) -> bool:
    """torch's compile workers (kept by torch across compiles): never killed between cells."""
    try:
        return any("torch/_inductor" in part or "torch._inductor" in part for part in proc.cmdline())
    except (psutil.Error, OSError):
        return False


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (children, theirs, ...), [] when ``pid`` is gone."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)  # reaps those that are this process's children


def sweep(keep: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """Kill (SIGKILL) this process's descendants except those in ``keep`` and theirs, and torch's compile workers;
    return the pids killed. Called by the measuring child when a cell ends."""
    kept: set[int] = set()
    for pid in keep:
        kept |= {pid, *(p.pid for p in descendants(pid))}
    doomed = [p for p in descendants(os.getpid()) if p.pid not in kept and not _spared(p)]
    _kill(doomed)
    return [p.pid for p in doomed]


def kill_tree(pid: int) -> None:
    """Kill process ``pid`` (SIGKILL), its process group when it leads one, and every descendant found now (those
    in a session of their own included); never raises. A pid below 1 (never started) is ignored: ``kill(0)`` would
    signal this process's own group."""
    if pid < 1:
        return
    found = descendants(pid)
    try:
        leads = os.getpgid(pid) == pid
    except OSError:
        leads = False
    with contextlib.suppress(OSError):
        if leads:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    _kill(found)


def kill_group(pgid: int) -> None:
    """SIGKILL whatever is left in process group ``pgid`` (a child's group after it exited); never raises."""
    if pgid < 1 or pgid == os.getpgid(0):  # never this process's own group
        return
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def signal_name(exitcode: int | None) -> str:
    """``SIGSEGV`` for an exit code of -11, ``exit code 3`` for 3, ``unknown`` for None."""
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"
