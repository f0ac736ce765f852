"""The bounds of numbers a user gives dtbench, defined once for suite fields (pydantic) and options (click).

A NaN compares false with everything, so a stop condition ``elapsed >= max_time`` never holds and a check
``not value > 0`` that forgets it lets it through; an infinite or astronomically large number of seconds overflows
the platform's timers (``threading.Timer``: "timestamp out of range for platform time_t"); a seed at or above 2^63
overflows torch's generator ("Overflow when unpacking long long"). Each type below says what a value may be, and
:class:`Checked` makes a click option out of the same type, so ``--alpha nan``, ``--min-time inf`` and
``timeout_s: .inf`` are one-line errors from one definition.
"""

from __future__ import annotations

from typing import Annotated, Any

import click
from pydantic import Field, TypeAdapter, ValidationError

from dtbench.core import read_regular_file as read_regular_file  # defined in the core (decoders read files too)

MAX_SECONDS = 30 * 24 * 3600.0  # 30 days: longer than any benchmark, far below timer overflow
MAX_CALIBRATION_S = 3600.0  # one calibration point is timed for at most an hour
SEED_LIMIT = 1 << 63  # torch.manual_seed and torch.Generator take 0 <= seed < 2^63 (a signed 64-bit integer)
MAX_SUITE_BYTES = 1 << 20  # a suite file, all of a suite's include: files together, a chat template file
MAX_DOCUMENT_BYTES = 256 << 20  # one corpus file (text-files, or a local dataset file): 256 MiB
ID_LIMIT = 1 << 63  # SQLite INTEGER and PostgreSQL BIGINT hold ids below 2^63

Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
"""A positive, finite duration in seconds, at most 30 days."""

CalibrationSeconds = Annotated[float, Field(gt=0, le=MAX_CALIBRATION_S, allow_inf_nan=False)]
"""Seconds a calibration point is timed: positive, finite, at most an hour."""

OpenProbability = Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)]
"""A probability strictly between 0 and 1 (a significance level alpha)."""

Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
"""A random seed torch accepts: 0 <= seed < 2^63."""


def first_error(exc: ValidationError) -> str:
    """The message of a pydantic error's first item, without pydantic's prefixes."""
    return exc.errors()[0]["msg"].removeprefix("Value error, ")


class Checked(click.ParamType):
    """A click option type accepting exactly the values of a pydantic type of this module (``Checked(Seconds,
    "SECONDS")``): options and suite fields share one definition of their bounds."""

    def __init__(self, annotated: Any, name: str):
        self.adapter, self.name = TypeAdapter(annotated), name

    def convert(self, value, param, ctx):
        try:
            if isinstance(value, str):
                return self.adapter.validate_strings(value.strip())
            return self.adapter.validate_python(value)
        except ValidationError as exc:
            self.fail(f"{value!r}: {first_error(exc)}", param, ctx)


def valid_id(value: int) -> bool:
    """Whether ``value`` can be a row id (0 < id < 2^63); a larger number is no such row, not an overflow."""
    return 0 < value < ID_LIMIT
