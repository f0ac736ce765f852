"""YAML suite files -> validated, frozen suite objects (pydantic), checked before anything heavy is loaded.

A suite declares the target and draft models, the datasets (N prompts, W warmup, prompt cap L_max), the
generation lengths T and the decoders with their params. Errors name the file, the line and the field.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from dtbench.decoders.base import StrictBools
from dtbench.harness.errors import DtbenchError, clip, error_location

Dtype = Literal["float32", "float16", "bfloat16", "float64"]

MAX_TOKENS = 1 << 20  # upper bound of T and L_max: beyond any model's context, and far below int overflow
MAX_GRID = 10_000  # cells a suite (or one sweep) may expand to
MAX_NODES = 100_000  # YAML values after alias expansion: a suite is a page of text, not a billion laughs


class _Frozen(StrictBools):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Frozen):
    """A model: the embedded default ``smollm2-135m``, a hub id or a local directory; its dtype and attention."""

    model: str = "smollm2-135m"
    dtype: Dtype = "float32"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    revision: str | None = None


class DatasetSpec(_Frozen):
    """A dataset cell axis: N prompts (the first W are warmup), capped at L_max tokens each."""

    name: str
    prompts: int = Field(10, ge=1, le=MAX_GRID, description="N, prompts measured (warmup included)")
    warmup: int = Field(2, ge=0, description="W, first prompts flagged as warmup")
    prompt_cap: int | list[int] = Field(800, description="L_max, maximum prompt length in tokens (a list sweeps it)")
    data_dir: str | None = Field(None, description="local data folder instead of the Hugging Face hub")
    path: str | None = Field(None, description="files for the text-files dataset (folder or glob)")

    @field_validator("prompt_cap")
    @classmethod
    def _caps_positive(cls, v):
        caps = v if isinstance(v, list) else [v]
        if not caps or any(c < 1 for c in caps):
            raise ValueError("prompt_cap must be a positive integer or a non-empty list of them")
        if any(c > MAX_TOKENS for c in caps):
            raise ValueError(f"prompt_cap must be at most {MAX_TOKENS} tokens")
        if len(set(caps)) != len(caps):
            raise ValueError(f"prompt_cap lists a value twice: {clip(caps)}")
        return v

    @model_validator(mode="after")
    def _warmup_below_prompts(self):
        if self.warmup >= self.prompts:
            raise ValueError(f"warmup ({self.warmup}) must be smaller than prompts ({self.prompts})")
        return self

    @property
    def caps(self) -> list[int]:
        return self.prompt_cap if isinstance(self.prompt_cap, list) else [self.prompt_cap]


class DecoderSpec(_Frozen):
    """A decoder to run: registered name, display label, params (validated by the decoder's own model).

    ``sweep`` maps param names to lists of values; the cartesian product expands into one decoder per point.
    ``datasets`` restricts it to some datasets (the paper uses K=8 on WikiText-2 and K=5 on PG-19).
    """

    name: str
    label: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    sweep: dict[str, list[Any]] = Field(default_factory=dict)
    datasets: list[str] | None = None
    optional: bool = Field(False, description="skip (with a note) when no such decoder is installed, e.g. a plugin")

    _where: str = PrivateAttr("")  # "file:line: decoders.i" of the suite entry, for one-line errors

    @field_validator("sweep")
    @classmethod
    def _sweep_bounded(cls, v):
        size = 1
        for key, values in v.items():
            if not values:
                raise ValueError(f"sweep over '{clip(key, 60)}' has no values (a sweep needs at least one point)")
            size *= len(values)
        if size > MAX_GRID:
            raise ValueError(f"sweep expands to {size} decoders, more than the limit of {MAX_GRID}")
        return v

    def expand(self) -> list["DecoderSpec"]:
        """The decoders this entry stands for: itself, or one per point of its sweep grid."""
        if not self.sweep:
            return [self]
        keys = list(self.sweep)
        out = []
        for values in itertools.product(*(self.sweep[k] for k in keys)):
            point = dict(zip(keys, values))
            suffix = ", ".join(f"{k}={v}" for k, v in point.items())
            spec = DecoderSpec(
                name=self.name, label=f"{self.display} ({suffix})", params={**self.params, **point},
                datasets=self.datasets, optional=self.optional,
            )
            spec._where = self._where
            out.append(spec)
        return out

    @property
    def where(self) -> str:
        """``file:line: decoders.i`` of the suite entry this decoder came from (empty if not parsed from a file)."""
        return self._where

    @property
    def display(self) -> str:
        return self.label or self.name


class Suite(_Frozen):
    """A whole benchmark: models x datasets x prompt caps x generation lengths x decoders."""

    name: str
    description: str = ""
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    target: ModelSpec = Field(default_factory=ModelSpec)
    draft: ModelSpec | None = None
    datasets: list[DatasetSpec] = Field(min_length=1)
    generation_lengths: list[int] = Field(min_length=1, description="T values, new tokens per prompt")
    decoders: list[DecoderSpec] = Field(min_length=1)
    timeout_s: float | Literal["auto"] | None = Field(
        "auto", description="per-sample time limit in seconds; auto: 10x the reference decoder's time on the same "
        "prompt (at least 60 s; 1800 s for a reference itself); null: none")

    @field_validator("generation_lengths")
    @classmethod
    def _positive_lengths(cls, v):
        if any(t < 1 for t in v):
            raise ValueError("generation lengths must be >= 1")
        if any(t > MAX_TOKENS for t in v):
            raise ValueError(f"generation lengths must be at most {MAX_TOKENS} tokens")
        if len(set(v)) != len(v):
            raise ValueError(f"generation_lengths lists a value twice: {clip(v)}")
        return v

    @field_validator("timeout_s")
    @classmethod
    def _positive_timeout(cls, v):
        if isinstance(v, (int, float)) and not v > 0:
            raise ValueError("timeout_s must be a positive number of seconds, auto, or null")
        return v

    @model_validator(mode="after")
    def _unique_dataset_caps(self):
        seen: set[tuple[str, int]] = set()
        for i, ds in enumerate(self.datasets):
            for cap in ds.caps:
                if (ds.name, cap) in seen:
                    raise ValueError(f"datasets.{i}: dataset '{clip(ds.name, 60)}' with prompt_cap {cap} is listed "
                                     f"twice (its cells would collide)")
                seen.add((ds.name, cap))
        cells = len(seen) * len(self.generation_lengths) * sum(
            max(1, _product(len(v) for v in d.sweep.values())) for d in self.decoders)
        if cells > MAX_GRID:
            raise ValueError(f"the suite expands to {cells} cells, more than the limit of {MAX_GRID}")
        return self

    def expanded_decoders(self) -> list[DecoderSpec]:
        """Decoder entries after sweep expansion, with unique labels."""
        out = [d for spec in self.decoders for d in spec.expand()]
        seen: dict[str, DecoderSpec] = {}
        for d in out:
            if d.display in seen:
                raise DtbenchError(f"{d.where or 'suite'}: decoder label '{clip(d.display, 80)}' is used twice "
                                   f"(set a distinct `label:`)")
            seen[d.display] = d
        return out


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _count_nodes(data: Any, limit: int) -> int:
    """Values in ``data`` counted as if YAML aliases were copied, stopping as soon as ``limit`` is passed."""
    count, stack = 0, [data]
    while stack:
        item = stack.pop()
        count += 1
        if count > limit:
            return count
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def _line_of(node: yaml.Node | None, loc: tuple) -> int | None:
    """The 1-based line of the YAML node at pydantic location ``loc``, as deep as the document goes."""
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            match = [v for k, v in node.value if k.value == key]
            if not match:
                break
            node = match[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            break
        line = node.start_mark.line + 1
    return line


def parse_suite(text: str, source: str = "<suite>") -> Suite:
    """Parse and validate suite YAML.

    Args:
        text: the YAML document.
        source: the file name used in error messages.

    Raises:
        DtbenchError: one line naming the file, line and field for malformed YAML, unknown keys or bad values.
    """
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise DtbenchError(f"{where}: malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise DtbenchError(f"{source}: a suite must be a YAML mapping (name:, datasets:, decoders:, ...)")
    if _count_nodes(data, MAX_NODES) > MAX_NODES:
        raise DtbenchError(f"{source}: the suite expands to more than {MAX_NODES} values (YAML aliases nested too "
                           f"deeply?); write the values out")
    try:
        suite = Suite.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field, msg = error_location(exc)
        loc = tuple(int(p) if p.isdigit() else p for p in field.split(".")) if field else ()
        line = _line_of(node, loc)
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise DtbenchError(f"{source}:{line}: {clip(field, 100) or 'suite'}: {msg}{more}") from None
    for i, spec in enumerate(suite.decoders):
        spec._where = f"{source}:{_line_of(node, ('decoders', i))}: decoders.{i}"
    return suite


def load_suite(path: str | Path) -> tuple[Suite, str]:
    """Read and validate a suite file.

    Returns:
        (suite, its text), the text being stored with the run for reproducibility.

    Raises:
        DtbenchError: if the file is missing or invalid.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DtbenchError(f"cannot read suite {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise DtbenchError(f"{path}:{line}: not UTF-8 text (byte {exc.start}); save the suite as UTF-8") from None
    return parse_suite(text, str(path)), text


def suite_hash(text: str) -> str:
    """sha256 of the suite text (hex), stored with each run."""
    return hashlib.sha256(text.encode()).hexdigest()
