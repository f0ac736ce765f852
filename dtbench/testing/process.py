"""The conformance kit's checks in a child process under deadlines (issue 65 item 1): the kit trusts nothing it checks.

A decoder under check may hang (a ``generate`` sleeping in a loop), exit (``sys.exit(0)``, ``os._exit(3)``), crash
natively (a segfault), raise ``KeyboardInterrupt``, print a million lines or fail to import. None of that may hang
``dtbench check`` or a plugin's pytest, end it, or read as a pass. So a decoder's checks run in a child process
(forked from a fork server that imported torch, transformers and the kit once and ran nothing else: :func:`context`;
``dtbench run``'s ``isolation: process`` is the same idea, :mod:`dtbench.harness.execution.isolation`), and the parent holds the
deadlines:

- **A check past its deadline** (:data:`DEFAULT_TIMEOUTS`, sized for a 2-core CPU; ``--timeout S`` for every check)
  is that check's failure ("exceeded 300 s in greedy_equals_reference"): the child is killed with its process group
  and every descendant (:func:`dtbench.harness.execution.proctree.kill_tree`), and the decoder's remaining checks go on in a
  fresh child (pytest-xdist's "worker crashed ... replacing it").
- **A child that exits or dies** while a check runs (any exit code, 0 included; a signal; a native crash) is that
  check's failure, naming the exit code or signal, with the last lines the child printed (faulthandler's trace of a
  native crash among them).
- **A decoder that fails to load** (an ImportError at import, a plugin that kills its importer) is its own row.
- **Its output is captured**: the child's stdout and stderr (file descriptors 1 and 2) go to a log file, never the
  terminal; each check's last lines come back with its outcome (:attr:`Outcome.output`), escaped.
- **Nothing is written into the current folder**: hypothesis' directory is a temporary one, deleted with the child.
- **Ctrl-C** reaches the parent only (the child is in a process group of its own and ignores SIGINT); the parent
  kills the child and its descendants before the interrupt goes on.

The checks themselves are :mod:`dtbench.testing.checks`'s, the same functions ``isolation="none"`` runs in
the caller's process.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.execution import proctree
from dtbench.harness.execution.isolation import fault_trace
from dtbench.harness.execution.proctree import signal_name
from dtbench.harness.safetext import printable

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_TIMEOUTS: dict[str, float] = {"compiled_equals_eager": 900.0, "sampling": 900.0}
"""Seconds a check may run before it is failed and its child killed (every other check: :data:`DEFAULT_TIMEOUT_S`).
Sized for a 2-core CPU: the slowest built-in's check ran in at most a tenth of its limit there (docs/plugins.md)."""
LOAD_TIMEOUT_S = 300.0  # a child's start and the decoder's import (torch, transformers, the plugin)
TAIL_LINES = 5  # lines of a check's output shown with its outcome
TAIL_CHARS = 600  # ... at most this many characters of them
LOG_CAP_BYTES = 64 << 20  # a log holding more than this after a check is emptied (a decoder printing without end)
ENV_PASSED = ("DTBENCH_HYPOTHESIS_EXAMPLES", "DTBENCH_CHECK_SHRINK")  # read at each check: sent with each request


def timeout_of(check: str, timeout: float | None) -> float:
    """The deadline of ``check`` in seconds: ``timeout`` when given, else its default."""
    return float(timeout) if timeout is not None else DEFAULT_TIMEOUTS.get(check, DEFAULT_TIMEOUT_S)


from dtbench.harness.execution.forkserver import PRELOAD, context  # noqa: E402,F401  (the children's start: one fork server)

# --- the child ----------------------------------------------------------------------------------------------------------


def _serve(conn: Any, log_path: str, storage: str) -> None:
    """The child: load a decoder, run the checks the parent asks for, one outcome each."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it kills this process
    os.setpgid(0, 0)  # a process group of its own, killed with it
    proctree.become_subreaper()  # what a decoder starts stays a descendant, killed with it
    proctree.die_with_parent()
    log = open(log_path, "a", buffering=1)  # noqa: SIM115  (for the process's whole life)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.enable(file=log, all_threads=True)
    os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = storage  # hypothesis writes here, never into the cwd
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(storage)  # (hypothesis may have been imported already, and read the variable)
    from dtbench.testing.common import scratch_root

    scratch_root(storage)  # the heads and datastores a decoder's declared settings write: removed by the parent
    cls: Any = None
    name = ""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        kind = message[0]
        if kind == "close":
            break
        if kind == "load":
            _, _, environ, cwd = message
            os.environ.clear()  # the caller's environment and folder now, not the fork server's at its start
            os.environ.update(environ)
            os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = storage
            with contextlib.suppress(OSError):
                os.chdir(cwd)
            try:
                from dtbench.testing.common import resolve

                name, cls = resolve(message[1])
                conn.send(("loaded", name, dict(getattr(cls, "xfail_checks", {}) or {})))
            except Exception as exc:  # noqa: BLE001  (a plugin's import failure is its row, one line)
                conn.send(("load_error", _one_line(exc)))
        elif kind == "run":
            _, check_name, precision_name, examples, env, threads = message
            _begin(log_path)
            conn.send(("start", check_name, precision_name))
            conn.send(("outcome", asdict(_run(cls, name, check_name, precision_name, examples, env, threads))))
            proctree.sweep()  # what the decoder started ends with its check
    proctree.sweep()


def _run(cls: Any, name: str, check_name: str, precision_name: str, examples: Any, env: dict, threads: Any) -> Any:
    from dtbench.testing.checks import CHECKS, run_check
    from dtbench.testing.common import PRECISIONS

    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    check = next(c for c in CHECKS if c.name == check_name)
    return run_check(check, cls, name, PRECISIONS[precision_name], examples)


def _begin(log_path: str) -> None:
    """Empty the log as a check starts (or once it outgrew :data:`LOG_CAP_BYTES`): its tail is this check's output."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    with contextlib.suppress(OSError):
        os.truncate(log_path, 0)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, DtbenchError):
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


# --- the parent ---------------------------------------------------------------------------------------------------------


class ChildDied(Exception):  # noqa: N818 (what happened, not an error of the kit)
    """The child exited, died of a signal or was killed past a deadline: ``reason`` says which, with its output."""

    def __init__(self, reason: str, output: str = "", printed: int = 0):
        super().__init__(reason)
        self.reason, self.output, self.printed = reason, output, printed


class CheckProcess:
    """One child process checking one decoder: :meth:`load` it, :meth:`run` checks one at a time under deadlines.

    Raises (from :meth:`load` and :meth:`run`):
        ChildDied: the child died (exit code or signal named), or ran past the deadline and was killed.
    """

    def __init__(self) -> None:
        ctx = context()
        self.conn, child = ctx.Pipe()
        fd, self.log_path = tempfile.mkstemp(prefix="dtbench-check-", suffix=".log")
        os.close(fd)
        self.storage = tempfile.mkdtemp(prefix="dtbench-check-hypothesis-")
        self.proc = ctx.Process(target=_serve, args=(child, self.log_path, self.storage), daemon=True)
        self.proc.start()
        child.close()
        self.decoder: Any = None
        self.busy = False  # a request sent and not answered: close() kills rather than asks
        self.name = ""
        self.xfail_checks: dict[str, str] = {}

    def load(self, decoder: Any) -> str | None:
        """Load ``decoder`` (a registered name or a class) in the child: None, or the one-line reason it failed."""
        try:
            self.busy = True
            self.conn.send(("load", decoder, dict(os.environ), os.getcwd()))
        except Exception as exc:  # noqa: BLE001  (pickling a class defined inside a function)
            raise DtbenchError(
                f"cannot check {clip(printable(decoder), 80)} in a child process ({_one_line(exc)}): define the class "
                "at module level, or check it in this process (isolation='none')"
            ) from None
        reply = self._receive(time.monotonic() + LOAD_TIMEOUT_S, "while loading the decoder")
        self.busy = False
        if reply[0] == "load_error":
            return str(reply[1])
        self.decoder, self.name, self.xfail_checks = decoder, reply[1], reply[2]
        return None

    def run(self, check: str, precision: str, examples: int | None, timeout: float) -> dict[str, Any]:
        """Run one check in the child: its outcome (a dict of :class:`~dtbench.testing.checks.Outcome`'s
        fields, with the output it printed)."""
        threads = None
        if "torch" in sys.modules:
            threads = sys.modules["torch"].get_num_threads()
        env = {key: os.environ.get(key) for key in ENV_PASSED}
        self.busy = True
        self.conn.send(("run", check, precision, examples, env, threads))
        limit = time.monotonic() + timeout
        words = f"in {check}" + ("" if precision == "cpu" else f" on {precision}")
        reply = self._receive(limit, words, timeout)
        if reply[0] == "start":
            reply = self._receive(limit, words, timeout)
        self.busy = False
        outcome = dict(reply[1])
        outcome["output"], outcome["printed"] = self._tail()
        self._trim()
        return outcome

    def _receive(self, limit: float, words: str, timeout: float | None = None) -> tuple:
        while True:
            try:
                if self.conn.poll(0.1):
                    return self.conn.recv()
            except (EOFError, OSError):
                pass  # the pipe closed: the child is gone
            if not self.proc.is_alive():
                with contextlib.suppress(EOFError, OSError):
                    if self.conn.poll(0):
                        return self.conn.recv()
                self.proc.join(5)
                output, printed = self._tail(crashed=True)
                raise ChildDied(f"the check process died of {signal_name(self.proc.exitcode)} {words}", output, printed)
            if time.monotonic() > limit:
                proctree.kill_tree(self.proc.pid or 0)
                self.proc.join(5)
                output, printed = self._tail()
                what = f"exceeded {timeout:g} s {words}" if timeout else f"took over {LOAD_TIMEOUT_S:g} s {words}"
                raise ChildDied(f"{what}: the check process and its process group were killed", output, printed)

    def _tail(self, crashed: bool = False) -> tuple[str, int]:
        """(the log's last :data:`TAIL_LINES` non-empty lines, escaped and clipped; how many lines it holds). After
        a native crash (``crashed``), faulthandler's "Fatal Python error" line and the innermost frames instead."""
        try:
            size = os.path.getsize(self.log_path)
            with open(self.log_path, "rb") as f:
                printed = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
                f.seek(max(0, size - 16384))
                text = f.read().decode(errors="replace")
        except OSError:
            return "", 0
        lines = [line.rstrip() for line in text.splitlines() if line.strip()]
        if not lines:
            return "", 0
        trace = fault_trace([line.strip() for line in lines], TAIL_LINES - 1) if crashed else []
        tail = "\n".join(clip(printable(line), 200) for line in (trace or lines[-TAIL_LINES:]))  # clip: by value too
        return (tail[:TAIL_CHARS] if trace else tail[-TAIL_CHARS:]), max(printed, 1)

    def _trim(self) -> None:
        with contextlib.suppress(OSError):
            if os.path.getsize(self.log_path) > LOG_CAP_BYTES:
                os.truncate(self.log_path, 0)

    def close(self) -> None:
        """Stop the child, kill whatever it left and delete its log and hypothesis folder; never raises."""
        try:
            if self.proc.is_alive() and not self.busy:
                with contextlib.suppress(OSError, EOFError, ValueError):
                    self.conn.send(("close",))
                self.proc.join(5)
            if self.proc.pid is not None:
                proctree.kill_tree(self.proc.pid)
                proctree.kill_group(self.proc.pid)
                self.proc.join(5)
        except Exception:  # noqa: BLE001
            pass
        finally:
            with contextlib.suppress(OSError):
                self.conn.close()
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
            shutil.rmtree(self.storage, ignore_errors=True)

    def __enter__(self) -> CheckProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
