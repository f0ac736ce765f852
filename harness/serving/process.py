"""The servers a worker launches (issue 30): their processes, logs, health and stop (:class:`ServerPool`).

A cell's server given as ``launch:`` is started for the cell in its own process group and session (``setsid``; on
Linux it is also told to die with dtbench, ``PR_SET_PDEATHSIG``), its output kept in a log file, its health endpoint
polled until 200 within ``startup_timeout_s``; stopped (SIGTERM to its group, SIGKILL after 10 s) when the run moves
past its cell, and all of them when the worker closes (end of run, Ctrl-C, SIGTERM, failure). A fixed ``port`` that is
taken, a server that exits before it is healthy or during a cell, an HTTP error: one line naming the server and its
log (:class:`ServerError`); the cell fails and nothing of it is stored as done.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dtbench.decoders.engines import llama_cpp
from dtbench.decoders.engines.llama_cpp import LLAMA_SERVER_ENV as LLAMA_SERVER_ENV  # the names before issue 49
from dtbench.decoders.engines.llama_cpp import MAKE_ENGINE as MAKE_ENGINE
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.serving.params import ServerParams, auth_headers, engine_placeholders, launch_argv, tls_context
from dtbench.harness.suites.grouping import CellKey

HOST = "127.0.0.1"
STOP_GRACE_S = 10.0
LOG_DIR_ENV = "DTBENCH_SERVER_LOG_DIR"


class ServerError(DtbenchError):
    """A server that did not start, exited, or answered with an error: one line naming it and its log."""


def _embedded_model() -> str:
    """``{model}``: the embedded SmolLM2 GGUF's path."""
    from dtbench.harness.models.loading import embedded_gguf

    folder, name = embedded_gguf()
    return str(folder / name)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def port_taken(port: int) -> bool:
    """Whether something already listens on ``port`` of 127.0.0.1 (or the port cannot be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


def llama_server_binary() -> str:
    """The llama-server binary ``{llama_server}`` stands for: the llama.cpp adapter's
    (:func:`dtbench.decoders.engines.llama_cpp.llama_server_binary`, which owns that placeholder since issue 49).

    Raises:
        ServerError: none found, or ``$DTBENCH_LLAMA_SERVER`` names no executable file (one line naming ``make
            engine``).
    """
    try:
        return llama_cpp.llama_server_binary()
    except DtbenchError as exc:
        raise ServerError(str(exc)) from None


def launches_llama_server(params: object) -> bool:
    """Whether a decoder's params hold a ``launch:`` command (the server decoder's) that uses ``{llama_server}``
    (kept for the preflight: :func:`check_launch` checks every engine's placeholders)."""
    return any(llama_cpp.LLAMA_SERVER in str(arg) for arg in getattr(params, "launch", None) or [])


def check_launch(params: ServerParams) -> None:
    """Resolve every engine placeholder a ``launch:`` command uses (validation: a missing binary stops the run
    before any model loads).

    Raises:
        DtbenchError: one that cannot be resolved (one line), or an unregistered engine.
    """
    for name, resolve in engine_placeholders(params).items():
        if any(name in arg for arg in params.launch or []):
            resolve()


try:  # loaded here, not in the forked child (no import or loader lock taken between fork and exec)
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def readiness(params: ServerParams) -> Callable[[int, str], bool]:
    """How the launch's readiness wait reads the answer of ``params.health_path`` (HTTP status, body): the engine
    adapter's :meth:`~dtbench.decoders.engines.OpenAICompatible.ready` (issue 59 item 7), an HTTP 200 for an adapter
    without one.

    Raises:
        DtbenchError: ``params.engine`` is not a registered engine.
    """
    from dtbench.decoders.engines import engine_for

    ready = getattr(engine_for(params.engine), "ready", None)
    return ready if callable(ready) else lambda status, body: status == 200


def _die_with_parent() -> None:
    """In the child before exec: a new session (its own process group), and SIGTERM when dtbench's launching thread
    dies (Linux ``PR_SET_PDEATHSIG``), so even a killed dtbench leaves no server behind."""
    os.setsid()
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:60] or "server"


@dataclass
class Launched:
    """A server process the pool started: its command, address, log and cell."""

    label: str
    argv: list[str]
    base_url: str
    log_path: Path
    proc: subprocess.Popen
    cell: CellKey

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after :data:`STOP_GRACE_S`; never raises."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                self.proc.wait()
        try:  # children the server left in its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class ServerPool:
    """The servers a worker launched, one per cell (see the module docstring).

    Args:
        log_dir: where server logs go (default ``$DTBENCH_SERVER_LOG_DIR`` or ``./dtbench-server-logs``).
    """

    def __init__(self, log_dir: str | Path | None = None):
        self.log_dir = Path(log_dir or os.environ.get(LOG_DIR_ENV) or "dtbench-server-logs")
        self.servers: dict[tuple[CellKey, str], Launched] = {}  # by (cell, label)

    def endpoint(
        self, label: str, params: ServerParams, cell: CellKey, concurrency: int
    ) -> tuple[str, Launched | None]:
        """The base URL of the cell's server: ``base_url``, or the cell's launched server (started now if needed;
        servers of other cells are stopped first, so at most the current cell's servers run).

        Raises:
            ServerError: a port taken, a server that exits before it is healthy or is not healthy in time.
        """
        if params.base_url is not None:
            return params.base_url.rstrip("/"), None
        key = (cell, label)
        for other in [k for k in self.servers if k[0] != cell]:
            self.servers.pop(other).stop()
        server = self.servers.get(key)
        if server is not None:
            if (code := server.exited()) is not None:
                self.servers.pop(key)
                raise ServerError(
                    f"server '{label}' exited with code {code} between prompt groups; see its log {server.log_path}"
                )
            return server.base_url, server
        server = self._launch(label, params, cell, concurrency)
        self.servers[key] = server
        return server.base_url, server

    def _launch(self, label: str, params: ServerParams, cell: CellKey, concurrency: int) -> Launched:
        import httpx

        if params.port == "auto":
            port = free_port()
        else:
            port = int(params.port)
            if port_taken(port):
                raise ServerError(
                    f"server '{label}': port {port} is taken (another process listens on it); free it or set port: auto"
                )
        values = {"port": str(port), "host": HOST, "concurrency": str(concurrency)}
        try:
            argv = launch_argv(params, values, _embedded_model)
            ready = readiness(params)
        except ServerError:
            raise
        except DtbenchError as exc:  # an engine placeholder that cannot be resolved (no llama-server)
            raise ServerError(str(exc)) from None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log_path = (self.log_dir / f"{stamp}-{_slug(label)}-c{concurrency}-{port}.log").resolve()
        with open(log_path, "ab") as log:
            log.write(f"# dtbench: {json.dumps(argv)}\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
                )
            except OSError as exc:
                raise ServerError(
                    f"server '{label}' could not be started ({clip(exc, 200)}); see its log {log_path}"
                ) from None
        base_url = f"http://{HOST}:{port}"
        server = Launched(label, argv, base_url, log_path, proc, cell)
        deadline = time.monotonic() + params.startup_timeout_s
        headers = auth_headers(params)
        try:
            while True:
                if (code := proc.poll()) is not None:
                    raise ServerError(
                        f"server '{label}' exited with code {code} before it was ready; see its log {log_path}"
                    )
                try:
                    answer = httpx.get(
                        base_url + params.health_path, timeout=2.0, headers=headers, verify=tls_context()
                    )
                    if ready(answer.status_code, answer.text):  # the engine adapter says (issue 59 item 7)
                        return server
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"server '{label}' was not healthy ({params.health_path}) after "
                        f"{params.startup_timeout_s:g} s; see its log {log_path}"
                    )
                time.sleep(0.2)
        except BaseException:  # not ready, or Ctrl-C during the wait: the process is not left behind
            server.stop()
            raise

    def close(self) -> None:
        """Stop every launched server (never raises)."""
        while self.servers:
            _, server = self.servers.popitem()
            server.stop()
