"""Output paths checked before any work (issue 59 item 8): a folder or file a command will write is tried first, so
``--figures /proc/x``, a folder under a regular file or ``calibrate --export`` to an unwritable path is one line
before the database is read or a model is loaded (a calibration on a GPU lease takes minutes), never an internal
error after the work.

The check writes: it creates the folder (as the command would) or opens the file for appending, and removes what it
made (a file that did not exist; folders it created for the check). Permission bits alone cannot answer (root
passes ``os.access`` on ``/proc``), so nothing short of trying does.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dtbench.harness.errors import DtbenchError


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def writable_dir(path: str | Path, what: str) -> Path:
    """Check that the folder ``path`` can be created (with its parents) and written; leaves nothing behind.

    Args:
        what: the folder's words in the message ("figures", "tables").

    Raises:
        DtbenchError: ``path`` is a file, lies under a regular file, or cannot be created or written (one line).
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise DtbenchError(f"cannot write {what} to {p}: it is a file, not a folder")
    made: list[Path] = []
    q = p
    while not q.exists() and q.parent != q:
        made.append(q)
        q = q.parent
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=p, prefix=".dtbench-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise DtbenchError(f"cannot write {what} to {p}: {_reason(exc)}") from None
    finally:
        for d in made:  # innermost first
            try:
                d.rmdir()
            except OSError:
                pass
    return p


def writable_file(path: str | Path, what: str) -> Path:
    """Check that the file ``path`` can be written (its folder must exist, as for the write itself); a file this
    check creates is removed, an existing one is left as it is (opened for appending, nothing written).

    Args:
        what: the file's words in the message ("the curves file").

    Raises:
        DtbenchError: ``path`` is a folder, or cannot be opened for writing (no such folder, read-only, a FIFO
            without a reader, ``/proc``), in one line.
    """
    p = Path(path)
    if p.is_dir():
        raise DtbenchError(f"cannot write {what} {p}: it is a folder")
    existed = p.exists()
    try:
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0), 0o644)
        os.close(fd)
    except OSError as exc:
        raise DtbenchError(f"cannot write {what} {p}: {_reason(exc)}") from None
    if not existed:
        try:
            p.unlink()
        except OSError:
            pass
    return p
