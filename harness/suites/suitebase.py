"""The suite schema's shared parts (split from :mod:`dtbench.harness.suites.suite`): the frozen, strict base of every suite
entry, the located entry (``file:line: key.i`` for one-line errors) and the ``L_max`` key with its old name, the
name and label field types (no control characters), the execution modes and the load axis (``concurrency:`` is
``batch_sizes``), and the grid limit.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, PrivateAttr, model_validator

from dtbench.core import StrictBools
from dtbench.harness.errors import clip
from dtbench.harness.safetext import control_character

MAX_GRID = 10_000  # cells a suite (or one sweep) may expand to

Execution = Literal["eager", "compiled"]
EXECUTIONS: tuple[str, ...] = ("eager", "compiled")


def executions(v):
    """``execution:`` as a list (one mode, or the axis), each mode once."""
    if v is None:
        return v
    v = [v] if isinstance(v, str) else v
    if isinstance(v, list) and len(set(map(str, v))) != len(v):
        raise ValueError(f"execution lists a mode twice: {clip(v)}")
    return v


MAX_LOAD = 4096  # the largest load level: batch size B or requests in flight


def equal_values(values: list[Any]) -> tuple[Any, Any] | None:
    """The first two values of a list axis that are one value, or None: numbers compared as numbers (``2`` and
    ``2.0``: two identical cells, issue 50 item 5g), booleans as booleans, anything else by its JSON text."""
    seen: dict[Any, Any] = {}
    for v in values:
        if isinstance(v, bool):
            key: Any = ("bool", v)
        elif isinstance(v, (int, float)):
            key = ("number", float(v))
        else:
            key = ("json", json.dumps(v, sort_keys=True, default=str))
        if key in seen:
            return seen[key], v
        seen[key] = v
    return None


def one_load_axis(data):
    """``concurrency:`` is the load axis under its serving name: the requests in flight for a server decoder
    (``server``), the batch size B for dtbench's own decoders; stored as ``batch_sizes`` (the cells' ``batch_size``
    column, the reports' load column). Given both, they must be one list."""
    if isinstance(data, dict) and "concurrency" in data:
        data = dict(data)
        levels = data.pop("concurrency")
        if isinstance(levels, list):  # its own name in its errors, not batch_sizes' (issue 50 item 5h)
            bad = [
                x for x in levels if isinstance(x, (int, float)) and not isinstance(x, bool) and not 1 <= x <= MAX_LOAD
            ]
            if bad:
                raise ValueError(
                    f"concurrency: levels (requests in flight) must be between 1 and {MAX_LOAD}, got {clip(bad[0])}"
                )
            if len({x for x in levels if isinstance(x, (int, float))}) != len(levels):
                raise ValueError(f"concurrency: lists a value twice: {clip(levels)}")
        if "batch_sizes" in data and data["batch_sizes"] != levels:
            raise ValueError(
                "batch_sizes and concurrency are one axis (the load level: the batch size of dtbench's "
                "decoders, the requests in flight of a server); give it once"
            )
        data["batch_sizes"] = levels
    return data


L_MAX = "L_max"  # the suite key of the prompt cap (datasets, and per-decoder restrictions)
OLD_L_MAX = "prompt_cap"  # its deprecated old name, still accepted


def no_control(value: str) -> str:
    """A name or label as given, refused when it holds a control character."""
    bad = control_character(value)
    if bad is not None:
        raise ValueError(
            f"holds a control character ({bad}); names and labels reach terminals, Markdown and CSV, so they may not"
        )
    return value


# A name or label: 1..max_length characters (the database column's width), no control characters (an ESC sequence
# would restyle a terminal, a newline split a Markdown row). Written out: mypy takes only static type aliases.
Name = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(no_control)]
Label = Annotated[str, Field(min_length=1, max_length=300), AfterValidator(no_control)]
ModelName = Annotated[str, Field(min_length=1, max_length=500), AfterValidator(no_control)]


class Frozen(StrictBools):
    # strict: a suite's values are taken as written ("8" is not 8, '42' is not a seed); ints still fill floats.
    # allow_inf_nan=False: no NaN or infinity in any float of a suite (harness/suites/bounds.py says why).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Located(Frozen):
    """A suite entry that knows where it was written (``file:line: key.i``), for one-line errors."""

    _where: str = PrivateAttr("")

    @property
    def where(self) -> str:
        """``file:line: key.i`` of the suite entry (empty if not parsed from a file)."""
        return self._where

    def locate(self, where: str) -> None:
        """Record where the entry was written (the suite loader calls it after validation)."""
        self._where = where


class HasLMax(Located):
    """A suite entry with an ``L_max:`` key, also accepted under its deprecated old name ``prompt_cap:``."""

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data):
        if isinstance(data, dict) and OLD_L_MAX in data:
            if L_MAX in data:
                raise ValueError(
                    f"{L_MAX}: given twice, as {L_MAX} and as {OLD_L_MAX} (its deprecated old name); keep {L_MAX} only"
                )
            data = {(L_MAX if k == OLD_L_MAX else k): v for k, v in data.items()}
        return data
