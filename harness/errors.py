"""The one exception type the CLI turns into a one-line error and a non-zero exit (never a traceback).

:class:`DtbenchError` and :func:`clip` are defined in the torch-free :mod:`dtbench.core` (decoders raise it too) and
re-exported here for the harness; :func:`error_location` reads pydantic's errors.
"""

from __future__ import annotations

from typing import Any

from dtbench.core import DtbenchError, clip

__all__ = ["DtbenchError", "clip", "error_location"]


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
