"""Run rows: who owns a run (owner host/pid, heartbeat), whether it may be resumed, and opening it.

A running run belongs to one process, recorded as ``runs.owner_host``/``owner_pid`` and refreshed in
``runs.heartbeat_at`` (:class:`Heartbeat`, every HEARTBEAT_S seconds and at every committed sample). ``--resume-run``
continues a run only when its owner is gone (:func:`owner_alive`), its suite text is the same, and the measuring
environment matches on :data:`MUST_MATCH` (:func:`open_run`); the driver (:mod:`dtbench.harness.execution.runner`) does the rest.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import UTC
from typing import Any

import psutil

from dtbench.core import redact_json, redact_yaml
from dtbench.harness.errors import DtbenchError
from dtbench.harness.store.db import Run, utcnow
from dtbench.harness.suites.bounds import valid_id
from dtbench.harness.suites.suitefile import suite_hash

HEARTBEAT_S = 30.0  # a running run refreshes runs.heartbeat_at this often (and at every committed sample)
STALE_S = 300.0  # a run of another host whose heartbeat is older than this is taken as dead


class Heartbeat:
    """Refreshes ``runs.heartbeat_at`` every HEARTBEAT_S seconds from a daemon thread while a run is measured."""

    def __init__(self, sessions, run_id: int):
        self.sessions, self.run_id = sessions, run_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="dtbench-heartbeat")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with self.sessions() as session:
                    session.get(Run, self.run_id).heartbeat_at = utcnow()
                    session.commit()
            except Exception:  # a busy database must not kill the run; the next beat retries
                pass

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _aware(t):
    return t if t is None or t.tzinfo is not None else t.replace(tzinfo=UTC)


def owner_alive(run: Run) -> str | None:
    """Why ``run`` still looks owned by a live process (a one-line reason), or None if it is free to resume.

    Same host: the owner pid exists and that process started before the run's last heartbeat (a reused pid
    started later). Another host: a heartbeat younger than STALE_S seconds.
    """
    if run.status != "running" or run.owner_pid is None:
        return None
    beat = _aware(run.heartbeat_at)
    age = (utcnow() - beat).total_seconds() if beat is not None else None
    if run.owner_host == socket.gethostname():
        try:
            proc = psutil.Process(run.owner_pid)
            started = proc.create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        if beat is not None and started > beat.timestamp() + 1:
            return None
        return f"its owner, pid {run.owner_pid} on this host, is still running"
    if age is not None and age < STALE_S:
        return f"its owner on host {run.owner_host} (pid {run.owner_pid}) sent a heartbeat {age:.0f} s ago"
    return None


CRASHED_CELL = (
    "crashed: the run's process died while measuring this cell (killed, or a native crash); "
    "--resume retries it, --resume --skip-failed goes past it"
)


def mark_crashed(run: Run) -> str | None:
    """Record ``run`` as ``crashed`` when it is still ``running`` but its owner is gone (:func:`owner_alive`: on
    this host its pid no longer runs, or runs a process started after the last heartbeat; on another host no
    heartbeat for STALE_S seconds); return a one-line note saying so, or None (nothing changed; the caller commits).

    A process that dies without closing its run (``os.abort()`` in a decoder under ``isolation: none``, the OOM
    killer, SIGKILL) cannot record it itself, so the next ``run --resume`` or ``report`` does. The pid is the test
    on this host because it is exact and immediate (a heartbeat is only refreshed every HEARTBEAT_S seconds, so its
    age cannot tell a dead run from a live one for that long); the process's start time guards against a reused
    pid, and the heartbeat remains the test for an owner on another host. The cell being measured
    (``measuring_cell_id``) becomes ``failed`` (:data:`CRASHED_CELL`), cells holding samples ``interrupted``.
    """
    if run.status != "running" or owner_alive(run) is not None:
        return None
    run.status = "crashed"
    run.finished_at = run.heartbeat_at or run.finished_at
    who = f"pid {run.owner_pid} on {run.owner_host}" if run.owner_pid is not None else "unknown"
    run.error = f"the run's process ({who}) ended without closing the run (killed, or a native crash)"
    for cell in run.cells:
        if cell.id == run.measuring_cell_id and cell.status != "failed":
            cell.status, cell.error = "failed", CRASHED_CELL
        elif cell.status == "running":  # holds samples
            cell.status = "interrupted"
    run.measuring_cell_id = None
    return f"run {run.id} was still marked running, but {run.error}: recorded as crashed"


# The environment keys two measurements must share to be compared: a resumed run's samples and the run it
# continues (all of them), two runs compared by ``dtbench report --compare`` (they are flagged when they differ).
MUST_MATCH = ("dtbench", "torch", "transformers", "device", "device_name", "target", "draft")


def check_resumable(run: Run | None, resume: int, suite_text: str, force: bool) -> Run:
    """Refuse to resume a missing or completed run, one of another suite, or one whose owner is alive; return the
    run (then not None).

    ``--force`` takes over a run whose owner cannot be checked from here (another host, heartbeat under 5 minutes
    old); a live owner on this host is never taken over: two processes would write the same samples (the second
    failing on the unique constraint) and leave the run's owner pointing at whichever died last.

    Raises:
        DtbenchError: one line saying why the run cannot be resumed.
    """
    if run is None:
        raise DtbenchError(f"no run {resume} to resume")
    if run.status == "completed":
        raise DtbenchError(f"run {resume} is completed; nothing to resume")
    if run.suite_hash != suite_hash(suite_text):
        raise DtbenchError(
            f"run {resume} was made from a different suite text ({run.suite_name}); cannot resume it with this one"
        )
    alive = owner_alive(run)
    if alive and run.owner_host == socket.gethostname():
        raise DtbenchError(
            f"run {resume} is still being written: {alive}; wait for it or stop it (kill "
            f"{run.owner_pid}), then resume (--force takes over only an owner on another host)"
        )
    if alive and not force:
        raise DtbenchError(f"run {resume} is still being written: {alive}; wait for it, or take it over with --force")
    return run


def open_run(session, suite, suite_text, suite_path, resume, force, env: dict[str, Any]) -> Run:
    """A new run, or the run to resume (checked: same suite text, owner gone, same measuring environment).

    ``env``: the measuring worker's environment (versions, device, target/draft) plus the executor's description.
    """
    env = redact_json(env, by_value=False)  # dtbench's own record: URL credentials masked, nothing searched (issue 67)
    owner = dict(owner_host=socket.gethostname(), owner_pid=os.getpid(), heartbeat_at=utcnow())
    if resume is None:
        run = Run(
            suite_name=suite.name,
            suite_path=suite_path,
            suite_text=redact_yaml(suite_text),  # a server URL's password is never stored (issues 42, 50)
            suite_hash=suite_hash(suite_text),
            status="running",
            environment=env,
            **owner,
        )
        session.add(run)
        session.flush()
        return run
    run = check_resumable(session.get(Run, resume) if valid_id(resume) else None, resume, suite_text, force)
    # Samples of one run must come from one environment, or its comparisons mean nothing.
    changed = [k for k in MUST_MATCH if run.environment.get(k) != env.get(k)]
    if changed:
        k = changed[0]
        raise DtbenchError(
            f"run {resume} was measured with {k} = {run.environment.get(k)!r}, this machine has "
            f"{env.get(k)!r}; start a new run instead of resuming"
        )
    run.status, run.error = "running", None
    run.finished_at = None
    for key, value in owner.items():
        setattr(run, key, value)
    return run
