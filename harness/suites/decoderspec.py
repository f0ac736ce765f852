"""The suite's decoder entries (split from :mod:`dtbench.harness.suites.suite`): :class:`DecoderSpec` (a registered decoder,
its params, sweep grid, restrictions and execution modes; its expansion into one entry per point and mode) and
:class:`SamplingSpec` (sampling instead of greedy decoding, per decoder or for the whole suite).
"""

from __future__ import annotations

import itertools
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from dtbench.core import mask_urls
from dtbench.harness.errors import clip
from dtbench.harness.suites.bounds import Seed
from dtbench.harness.suites.suitebase import (
    L_MAX,
    MAX_GRID,
    Execution,
    Frozen,
    HasLMax,
    Label,
    Name,
    equal_values,
    executions,
    no_control,
    one_load_axis,
)

SWEPT_BY_LIST = ("request_rate",)  # decoder params whose list of values is a sweep axis (server: issue 39 item 2)
COMPILED_SUFFIX = " [compiled]"  # a compiled cell's label: its decoder's label + this (eager labels are unchanged)


class SamplingSpec(Frozen):
    """Sampling instead of greedy decoding (transformers' order: temperature, then top-k, then top-p).

    Every sample draws from its own generator seeded by ``seed`` (default: the suite's ``seed``) and the prompt
    index, so a seeded run is identical run to run.
    """

    temperature: float = Field(1.0, gt=0, le=100, description="logits are divided by it")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0: all)")
    top_p: float = Field(1.0, gt=0, le=1, description="keep the smallest set reaching this probability (1: all)")
    seed: Seed | None = Field(
        None, description="base seed of the per-sample generators (default: the suite's seed; 0 <= seed < 2^63)"
    )


class DecoderSpec(HasLMax):
    """A decoder to run: registered name, display label, params (validated by the decoder's own model).

    ``sweep`` maps param names to lists of values; the cartesian product expands into one decoder per point.
    ``datasets`` restricts it to some datasets (the paper uses K=8 on WikiText-2 and K=5 on PG-19),
    ``generation_lengths`` and ``L_max`` to some of the suite's T and L_max.
    """

    name: Name = Field(description="a registered decoder (dtbench decoders lists them)")
    label: Label | None = Field(None, description="its name in reports (default: made from name and params)")
    params: dict[str, Any] = Field(default_factory=dict, description="the decoder's own keys (below)")
    sweep: dict[str, list[Any]] = Field(
        default_factory=dict, description="param -> values: one cell per point of the grid"
    )
    datasets: list[Name] | None = Field(None, description="run only on these datasets (default: all)")
    generation_lengths: list[int] | None = Field(
        None, description="run only at these T (a subset of the suite's generation_lengths)"
    )
    l_max: int | list[int] | None = Field(
        None, alias=L_MAX, description="run only at these L_max (a subset of the datasets' L_max)"
    )
    batch_sizes: list[int] | None = Field(
        None,
        description="run only at these batch sizes B (a subset of the suite's batch_sizes; `concurrency:` is "
        "the same key under its serving name)",
    )
    optional: bool = Field(False, description="skip (with a note) when no such decoder is installed, e.g. a plugin")
    sampling: SamplingSpec | Literal["greedy"] | None = Field(
        None, description="this decoder's sampling settings (default: the suite's); greedy forces greedy decoding"
    )
    execution: list[Execution] | None = Field(
        None,
        description="run only in these execution modes (a subset of the suite's execution; eager or compiled)",
    )

    _group: str | None = PrivateAttr(None)  # the sweep entry's label this decoder was expanded from
    _execution: str = PrivateAttr("eager")  # the execution mode of this expanded entry (Suite.expanded_decoders)

    @field_validator("execution", mode="before")
    @classmethod
    def _execution_list(cls, v):
        return executions(v)

    @model_validator(mode="before")
    @classmethod
    def _concurrency(cls, data):
        return one_load_axis(data)

    @model_validator(mode="before")
    @classmethod
    def _list_axes(cls, data):
        """A list of values of a :data:`SWEPT_BY_LIST` param (``request_rate: [1, 2, 4]``) is a sweep axis (issue
        39 item 2): moved into ``sweep``, one cell per value, labelled ``label (request_rate=R)``."""
        if not isinstance(data, dict) or not isinstance(data.get("params"), dict):
            return data
        params, sweep = dict(data["params"]), data.get("sweep")
        for key in SWEPT_BY_LIST:
            if isinstance(params.get(key), list):
                if isinstance(sweep, dict) and key in sweep:
                    raise ValueError(f"{key} is both a list in params and a sweep: give it once")
                sweep = {**(sweep if isinstance(sweep, dict) else {}), key: params.pop(key)}
        if sweep is not data.get("sweep"):
            data = {**data, "params": params, "sweep": sweep}
        return data

    _swept: dict[str, Any] = PrivateAttr(default_factory=dict)  # its point of the sweep grid

    @field_validator("sweep")
    @classmethod
    def _sweep_bounded(cls, v):
        size = 1
        for key, values in v.items():
            for text in (key, *(x for x in values if isinstance(x, str))):  # both become part of the labels
                no_control(text)
            if not values:
                raise ValueError(f"sweep over '{clip(key, 60)}' has no values (a sweep needs at least one point)")
            if (twice := equal_values(values)) is not None:
                raise ValueError(
                    f"sweep over '{clip(key, 60)}' lists one value twice ({clip(twice[0], 40)} and "
                    f"{clip(twice[1], 40)}): they would be two identical cells"
                )
            size *= len(values)
        if size > MAX_GRID:
            raise ValueError(f"sweep expands to {size} decoders, more than the limit of {MAX_GRID}")
        return v

    def expand(self) -> list[DecoderSpec]:
        """The decoders this entry stands for: itself, or one per point of its sweep grid.

        Each point is a ``model_copy`` of this entry (every field carried over, new ones included) with the point's
        values merged into ``params``, a label naming the point and no ``sweep`` of its own.
        """
        if not self.sweep:
            return [self]
        keys = list(self.sweep)
        out = []
        for values in itertools.product(*(self.sweep[k] for k in keys)):
            point = dict(zip(keys, values))
            suffix = mask_urls(", ".join(f"{k}={v}" for k, v in point.items()))  # a swept base_url (issue 50)
            spec = self.model_copy(
                update={"label": f"{self.display} ({suffix})", "params": {**self.params, **point}, "sweep": {}}
            )
            spec._group, spec._swept = self.display, point
            out.append(spec)
        return out

    @property
    def sweep_group(self) -> str | None:
        """Label of the sweep entry this decoder is one point of (None when it was not swept)."""
        return self._group

    @property
    def swept(self) -> dict[str, Any]:
        """This decoder's point of its sweep grid ({} when it was not swept)."""
        return dict(self._swept)

    @property
    def l_maxes(self) -> list[int] | None:
        """The L_max values it is restricted to (None: every dataset's)."""
        return None if self.l_max is None else (self.l_max if isinstance(self.l_max, list) else [self.l_max])

    @property
    def display(self) -> str:
        return self.label or self.name

    @property
    def mode(self) -> str:
        """The execution mode of this expanded entry: ``eager`` or ``compiled`` (issue 37)."""
        return self._execution

    def executed(self, mode: str) -> DecoderSpec:
        """This entry in execution ``mode``: itself for eager, a copy labelled ``<label> [compiled]`` otherwise."""
        if mode == "eager":
            return self
        spec = self.model_copy(update={"label": self.display + COMPILED_SUFFIX})
        spec._group, spec._swept, spec._execution = self._group, dict(self._swept), mode
        if self._group is not None:
            spec._group = self._group + COMPILED_SUFFIX
        return spec
