"""Joining a Ray cluster (``dtbench run --executor ray --address``) without Ray's endless retry: a TCP probe, then
``ray.init`` in a thread waited on in slices (:func:`join`; :mod:`dtbench.harness.execution.ray_executor` calls it)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from dtbench.harness.errors import DtbenchError


def tcp_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT`` or ``ray://HOST:PORT``; None for ``auto``, ``local`` and anything else."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def join(ray, address: str, kwargs: dict[str, Any], timeout_s: float) -> None:
    """``ray.init(address=...)`` that gives up after ``timeout_s`` seconds and stops at Ctrl-C.

    Ray retries an unreachable GCS forever inside C++ (a log line every few seconds, SIGINT deferred), so a
    ``HOST:PORT`` is first probed with a TCP connection, then ``ray.init`` runs in a daemon thread while this
    thread waits in short slices (Ctrl-C reaches it between them); a daemon thread left waiting does not keep the
    process alive.

    Raises:
        DtbenchError: nothing answers at the address, or Ray does not connect within ``timeout_s``.
        KeyboardInterrupt: Ctrl-C while waiting.
    """
    endpoint = tcp_endpoint(address)
    deadline = time.monotonic() + timeout_s
    if endpoint is not None:
        try:
            socket.create_connection(endpoint, timeout=timeout_s).close()
        except OSError as exc:
            raise DtbenchError(
                f"cannot join Ray at {address}: nothing answers there ({exc.strerror or exc}); "
                f"start the cluster (ray start --head) or check --address"
            ) from None
    outcome: dict[str, BaseException | None] = {}

    def connect() -> None:
        try:
            ray.init(address=address, **kwargs)
            outcome["error"] = None
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc

    thread = threading.Thread(target=connect, daemon=True, name="dtbench-ray-connect")
    thread.start()
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(0.1)
    if "error" not in outcome:
        raise DtbenchError(
            f"cannot join Ray at {address}: no answer from a Ray cluster within {timeout_s:g} s "
            f"(--connect-timeout); is it a Ray head node's port?"
        )
    if outcome["error"] is not None:
        raise outcome["error"]
