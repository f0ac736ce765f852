"""A plugin's import tried first in a child process, under its time limit (issue 67 item 5): an import that does not
finish is killed with its process, never left running beside the caller.

Before, the limit was a daemon thread the caller joined with a timeout; Python cannot stop a thread, so an import
looping at ``while True: pass`` kept one core busy for the rest of the command (``dtbench run`` measured ``ar`` at
6.5 and 10.6 t/s against 19.8 and 14.3 without it). Now :func:`probe` imports the entry point in a child forked from
the conformance kit's fork server (:func:`dtbench.testing.process.context`: torch, transformers and the
plugin API imported once, so a probe costs a fork, ~0.1 s, after the server's start, a few seconds once per
process), with the caller's environment, folder and ``sys.path``:

- the child first imports the plugin API (``dtbench.api``) without a limit, so the limit times the plugin's own import
  only (issue 59), then loads the entry point;
- not done within the limit: the child and its process group are killed (:func:`dtbench.harness.execution.proctree.kill_tree`)
  and :class:`ProbeFailed` says so;
- an import that raises, exits (``sys.exit``, ``os._exit``) or crashes (a segfault) is :class:`ProbeFailed` with what
  happened; before, ``os._exit`` at import ended the caller itself;
- an import that finished is imported again in the caller, without a limit (the object must live in the caller).

The same idea as pluggy's and importlib's rule that nothing imports beside the caller, kept: the caller imports a
plugin only after a child showed that its import ends.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

from dtbench.harness.execution import proctree
from dtbench.harness.execution.proctree import signal_name

PLUGIN_API = "dtbench.api"  # imported in the child before the plugin, without a limit
READY_TIMEOUT_S = 300.0  # the child's start and the plugin API's import (torch, transformers), not timed by the limit


class ProbeFailed(Exception):  # noqa: N818 (what happened to the plugin's import, not an error of dtbench)
    """The plugin's import in the child did not finish within its limit, raised, or ended the child: ``str()`` says
    which, in words that follow "from distribution X 1.0 ..." (e.g. "failed to load: ImportError: no gpu lib")."""


class ProbeUnavailable(Exception):  # noqa: N818
    """The child could not be started or could not import the plugin API (a ``__main__`` read from standard input,
    which multiprocessing cannot start a child from): the plugin was not tried, and is imported by the caller."""


def _child(conn: Any, spec: tuple[str, str, str], environ: dict[str, str], cwd: str, path: list[str]) -> None:
    """The child: the plugin API, then the entry point ``spec`` (name, value, group); one message each."""
    os.setpgid(0, 0)  # a process group of its own, killed with it
    proctree.die_with_parent()
    os.environ.clear()
    os.environ.update(environ)
    with contextlib.suppress(OSError):
        os.chdir(cwd)
    sys.path[:] = path
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # what the import prints is the caller's to see when it imports it, once
    os.dup2(devnull, 2)
    import importlib
    from importlib.metadata import EntryPoint

    importlib.import_module(PLUGIN_API)  # the plugin API: not the plugin's time (named: this module imports no API)

    conn.send(("ready",))
    try:
        EntryPoint(name=spec[0], value=spec[1], group=spec[2]).load()
    except BaseException as exc:  # noqa: BLE001  (the plugin's failure, sent as one line)
        text = str(exc).strip()
        conn.send(("error", f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__))
        return
    conn.send(("ok",))


def bounded_import(name: str, value: str, group: str, timeout_s: float) -> None:
    """The registry's probe (:class:`dtbench.registry.ImportGuard`): :func:`probe`, its failure as the registry's
    :class:`~dtbench.registry.PluginImportFailed`; where no child can start (:class:`ProbeUnavailable`) it returns
    and the plugin is imported as it is, without a limit."""
    from dtbench.registry import PluginImportFailed

    try:
        probe(name, value, group, timeout_s)
    except ProbeFailed as exc:
        raise PluginImportFailed(str(exc)) from None
    except ProbeUnavailable:
        return


def preload_api() -> None:
    """Import the plugin API (``dtbench.api``: torch, transformers) in this process, without a limit, named here so
    that the registry names nothing above the core."""
    import importlib

    importlib.import_module(PLUGIN_API)


def install() -> None:
    """Install :func:`bounded_import` and :func:`preload_api` as every registry's :class:`~dtbench.registry.ImportGuard`
    (the harness's package does at its import)."""
    from dtbench.registry import ImportGuard, guard_imports

    guard_imports(ImportGuard(probe=bounded_import, preload=preload_api))


def probe(name: str, value: str, group: str, timeout_s: float) -> float:
    """Import the entry point ``name = value`` of ``group`` in a child process, within ``timeout_s`` seconds.

    Returns:
        The seconds the plugin's own import took in the child.

    Raises:
        ProbeFailed: the import did not finish within ``timeout_s`` (the child was killed), raised (its type and first
            line), or ended the child (its exit code or signal).
        ProbeUnavailable: the child did not reach the plugin (it did not start), or this process may not start one (a
            daemonic process: the kit's check child, whose own deadline bounds the import); nothing was tried.
    """
    import multiprocessing

    from dtbench.harness.execution.forkserver import context

    if multiprocessing.current_process().daemon:  # the kit's check child: its own deadline kills it with the import
        raise ProbeUnavailable("a daemonic process (the conformance kit's check child) cannot start one")
    ctx = context()
    conn, child = ctx.Pipe()
    proc = ctx.Process(
        target=_child, args=(child, (name, value, group), dict(os.environ), os.getcwd(), list(sys.path)), daemon=True
    )
    proc.start()
    child.close()
    try:
        reply = _receive(conn, proc, READY_TIMEOUT_S)
        if reply is None or reply[0] != "ready":
            raise ProbeUnavailable(f"the import process did not start ({'timeout' if reply is None else reply[1]})")
        began = time.monotonic()
        reply = _receive(conn, proc, timeout_s)
        took = time.monotonic() - began
        if reply is None:
            raise ProbeFailed(
                f"did not finish importing within {timeout_s:g} s (its import ran in a child process, killed; "
                "DTBENCH_PLUGIN_IMPORT_TIMEOUT sets the limit)"
            )
        if reply[0] == "error":
            raise ProbeFailed(f"failed to load: {reply[1]}")
        if reply[0] == "died":
            raise ProbeFailed(f"failed to load: its import ended the process ({reply[1]})")
        return took
    finally:
        if proc.is_alive():
            proctree.kill_tree(proc.pid or 0)
        proc.join(5)
        conn.close()


def _receive(conn: Any, proc: Any, timeout_s: float) -> tuple | None:
    """The child's next message; ("died", how) once it is gone without one; None past ``timeout_s`` (inf: none)."""
    limit = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(EOFError, OSError):
            if conn.poll(0.05):
                return conn.recv()
        if not proc.is_alive():
            with contextlib.suppress(EOFError, OSError):
                if conn.poll(0):
                    return conn.recv()
            proc.join(5)
            return ("died", signal_name(proc.exitcode))
        if time.monotonic() > limit:
            return None
