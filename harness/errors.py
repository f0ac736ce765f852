"""The one exception type the CLI turns into a one-line error and a non-zero exit (never a traceback).

:class:`DtbenchError` and :func:`clip` are defined in the torch-free :mod:`dtbench.core` (decoders raise it too) and
re-exported here for the harness; :func:`error_location` reads pydantic's errors.
"""

from __future__ import annotations

from typing import Any

from dtbench.core import DtbenchError, clip

__all__ = ["DtbenchError", "clip", "error_location", "first_error", "error_line"]


def first_error(exc: BaseException) -> BaseException:
    """The first real error inside an exception group (asyncio's TaskGroup raises ``ExceptionGroup: unhandled errors
    in a TaskGroup (1 sub-exception)``, which names nothing): its first leaf, ``exc`` itself when it is no group."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def error_line(exc: BaseException, limit: int = 1500) -> str:
    """One line for a cell's error: a :class:`DtbenchError`'s message, else ``Type: message`` of
    :func:`first_error` (an exception group is never shown as such), clipped to ``limit`` characters."""
    exc = first_error(exc)
    return clip(exc if isinstance(exc, DtbenchError) else f"{type(exc).__name__}: {exc}", limit)


def error_location(exc: Any) -> tuple[str, str]:
    """(dotted field path, message) of a pydantic ``ValidationError``'s first item.

    A model-level validator may name the field itself, as ``"field.path: message"``.
    """
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    head, sep, rest = msg.partition(": ")
    if sep and head and " " not in head:
        loc, msg = f"{loc}.{head}" if loc else head, rest
    return loc, clip(msg)
