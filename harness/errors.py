"""The one exception type the CLI turns into a one-line error and a non-zero exit (never a traceback)."""

from __future__ import annotations

from typing import Any

MAX_ECHO = 200  # characters of a user's value echoed in an error message


class DtbenchError(Exception):
    """A user-facing error: bad suite, missing data, unknown model or decoder, unusable database.

    The message is one line that says what is wrong and, where possible, how to fix it.
    """


def clip(value: Any, limit: int = MAX_ECHO) -> str:
    """``str(value)`` on one line, cut to ``limit`` characters with an ellipsis (a suite can hold huge values)."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
