"""YAML suite files -> validated, frozen suite objects (pydantic), checked before anything heavy is loaded.

A suite declares the target and draft models, the datasets (N prompts, W warmup, prompt cap ``L_max``), the
generation lengths T and the decoders with their params. Errors name the file, the line and the field.
``prompt_cap`` is the deprecated old name of ``L_max`` (suites written before it, and the suite text stored with
their runs, still load; a note on stderr says so); an entry setting both is an error.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
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


L_MAX = "L_max"  # the suite key of the prompt cap (datasets, and per-decoder restrictions)
OLD_L_MAX = "prompt_cap"  # its deprecated old name, still accepted


class _Frozen(StrictBools):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _HasLMax(_Frozen):
    """A suite entry with an ``L_max:`` key, also accepted under its deprecated old name ``prompt_cap:``."""

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data):
        if isinstance(data, dict) and OLD_L_MAX in data:
            if L_MAX in data:
                raise ValueError(f"{L_MAX}: given twice, as {L_MAX} and as {OLD_L_MAX} (its deprecated old name); "
                                 f"keep {L_MAX} only")
            data = {(L_MAX if k == OLD_L_MAX else k): v for k, v in data.items()}
        return data


class ModelSpec(_Frozen):
    """A model: the embedded default ``smollm2-135m``, a hub id or a local directory; its dtype and attention."""

    model: str = "smollm2-135m"
    dtype: Dtype = "float32"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    revision: str | None = None


class SamplingSpec(_Frozen):
    """Sampling instead of greedy decoding (transformers' order: temperature, then top-k, then top-p).

    Every sample draws from its own generator seeded by ``seed`` (default: the suite's ``seed``) and the prompt
    index, so a seeded run is identical run to run.
    """

    temperature: float = Field(1.0, gt=0, le=100, description="logits are divided by it")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0: all)")
    top_p: float = Field(1.0, gt=0, le=1, description="keep the smallest set reaching this probability (1: all)")
    seed: int | None = Field(None, description="base seed of the per-sample generators (default: the suite's seed)")


class DatasetSpec(_HasLMax):
    """A dataset cell axis: N prompts (the first W are warmup), capped at L_max tokens each."""

    name: str
    prompts: int = Field(10, ge=1, le=MAX_GRID, description="N, prompts measured (warmup included)")
    warmup: int = Field(2, ge=0, description="W, first prompts flagged as warmup")
    l_max: int | list[int] = Field(800, alias=L_MAX,
                                   description="L_max, maximum prompt length in tokens (a list sweeps it)")
    data_dir: str | None = Field(None, description="local data folder instead of the Hugging Face hub")
    path: str | None = Field(None, description="files for the text-files dataset (folder or glob)")
    hub_id: str | None = Field(
        None, description="Hugging Face dataset repo (or a local folder of the same parquet layout) to load from "
        "instead of the dataset's default (wikitext-2: Salesforce/wikitext, pg19: emozilla/pg19)")
    revision: str | None = Field(None, description="hub revision to pin (branch, tag or commit sha)")
    skip: int = Field(
        0, ge=0, description="held-out selection: leave out the first `skip` usable documents of the seeded "
        "document order, i.e. the documents a suite with the same seed and prompts <= skip draws its prompts from "
        "(tuning on other documents than the benchmark)")

    _where: str = PrivateAttr("")  # "file:line: datasets.i" of the suite entry, for one-line errors

    @property
    def where(self) -> str:
        return self._where

    @field_validator("l_max")
    @classmethod
    def _caps_positive(cls, v):
        caps = v if isinstance(v, list) else [v]
        if not caps or any(c < 1 for c in caps):
            raise ValueError(f"{L_MAX} must be a positive integer or a non-empty list of them")
        if any(c > MAX_TOKENS for c in caps):
            raise ValueError(f"{L_MAX} must be at most {MAX_TOKENS} tokens")
        if len(set(caps)) != len(caps):
            raise ValueError(f"{L_MAX} lists a value twice: {clip(caps)}")
        return v

    @model_validator(mode="after")
    def _warmup_below_prompts(self):
        if self.warmup >= self.prompts:
            raise ValueError(f"warmup ({self.warmup}) must be smaller than prompts ({self.prompts})")
        return self

    @property
    def caps(self) -> list[int]:
        """Its L_max values (one, or the swept list)."""
        return self.l_max if isinstance(self.l_max, list) else [self.l_max]


class DecoderSpec(_HasLMax):
    """A decoder to run: registered name, display label, params (validated by the decoder's own model).

    ``sweep`` maps param names to lists of values; the cartesian product expands into one decoder per point.
    ``datasets`` restricts it to some datasets (the paper uses K=8 on WikiText-2 and K=5 on PG-19),
    ``generation_lengths`` and ``L_max`` to some of the suite's T and L_max.
    """

    name: str
    label: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    sweep: dict[str, list[Any]] = Field(default_factory=dict)
    datasets: list[str] | None = None
    generation_lengths: list[int] | None = Field(
        None, description="run only at these T (a subset of the suite's generation_lengths)")
    l_max: int | list[int] | None = Field(
        None, alias=L_MAX, description="run only at these L_max (a subset of the datasets' L_max)")
    optional: bool = Field(False, description="skip (with a note) when no such decoder is installed, e.g. a plugin")
    sampling: SamplingSpec | Literal["greedy"] | None = Field(
        None, description="this decoder's sampling settings (default: the suite's); greedy forces greedy decoding")

    _where: str = PrivateAttr("")  # "file:line: decoders.i" of the suite entry, for one-line errors
    _group: str | None = PrivateAttr(None)  # the sweep entry's label this decoder was expanded from
    _swept: dict[str, Any] = PrivateAttr(default_factory=dict)  # its point of the sweep grid

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
                datasets=self.datasets, generation_lengths=self.generation_lengths, **{L_MAX: self.l_max},
                optional=self.optional, sampling=self.sampling,
            )
            spec._where, spec._group, spec._swept = self._where, self.display, point
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
    def caps(self) -> list[int] | None:
        """The L_max values it is restricted to (None: every dataset's)."""
        return None if self.l_max is None else (self.l_max if isinstance(self.l_max, list) else [self.l_max])

    @property
    def where(self) -> str:
        """``file:line: decoders.i`` of the suite entry this decoder came from (empty if not parsed from a file)."""
        return self._where

    @property
    def display(self) -> str:
        return self.label or self.name


class Suite(_Frozen):
    """A whole benchmark: models x datasets x prompt caps (L_max) x generation lengths x decoders."""

    name: str
    description: str = ""
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    target: ModelSpec = Field(default_factory=ModelSpec)
    draft: ModelSpec | None = None
    datasets: list[DatasetSpec] = Field(min_length=1)
    generation_lengths: list[int] = Field(min_length=1, description="T values, new tokens per prompt")
    decoders: list[DecoderSpec] = Field(min_length=1)
    sampling: SamplingSpec | None = Field(None, description="sample instead of greedy decoding (absent: greedy)")
    calibrate: bool = Field(
        False, description="measure the target's and draft's forward-latency curves before the first cell and store "
        "them with the run (the cost model of `dtbench report --cost-model`; `n_max: auto` calibrates regardless)")
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
                    raise ValueError(f"datasets.{i}: dataset '{clip(ds.name, 60)}' with {L_MAX} {cap} is listed "
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


MAX_INCLUDE_DEPTH = 8


def _compose(text: str, source: str) -> tuple[dict, yaml.Node]:
    """(data, node) of one YAML document that must be a mapping.

    Raises:
        DtbenchError: malformed YAML, not a mapping, or more than MAX_NODES values after alias expansion.
    """
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise DtbenchError(f"{where}: malformed YAML: {clip(problem)}") from None
    if not isinstance(data, dict):
        raise DtbenchError(f"{source}: a suite must be a YAML mapping (name:, datasets:, decoders:, ...)")
    if _count_nodes(data, MAX_NODES) > MAX_NODES:
        raise DtbenchError(f"{source}: the suite expands to more than {MAX_NODES} values (YAML aliases nested too "
                           f"deeply?); write the values out")
    return data, node


def _note_old_names(data: dict, where_of) -> None:
    """One line on stderr when datasets or decoders entries use ``prompt_cap:`` (the old name of ``L_max:``)."""
    old = [(key, i, L_MAX in entry) for key in ("datasets", "decoders") if isinstance(data.get(key), list)
           for i, entry in enumerate(data[key]) if isinstance(entry, dict) and OLD_L_MAX in entry]
    if old and not any(both for *_, both in old):  # both keys in one entry: the validation error says it all
        key, i, _ = old[0]
        more = f" (and {len(old) - 1} more entries)" if len(old) > 1 else ""
        print(f"note: {where_of((key, i, OLD_L_MAX))}: {key}.{i}: {OLD_L_MAX} is the deprecated name of {L_MAX}"
              f"{more}; write {L_MAX}", file=sys.stderr, flush=True)


def _validate(data: dict, where_of) -> Suite:
    """Validate merged suite data; ``where_of(loc)`` gives ``file:line`` of a pydantic location."""
    _note_old_names(data, where_of)
    try:
        suite = Suite.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field, msg = error_location(exc)
        loc = tuple(int(p) if p.isdigit() else p for p in field.split(".")) if field else ()
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise DtbenchError(f"{where_of(loc)}: {clip(field, 100) or 'suite'}: {msg}{more}") from None
    for i, spec in enumerate(suite.decoders):
        spec._where = f"{where_of(('decoders', i))}: decoders.{i}"
    for i, ds in enumerate(suite.datasets):
        ds._where = f"{where_of(('datasets', i))}: datasets.{i}"
    return suite


def parse_suite(text: str, source: str = "<suite>") -> Suite:
    """Parse and validate suite YAML (without ``include:``; :func:`load_suite` resolves includes).

    Args:
        text: the YAML document.
        source: the file name used in error messages.

    Raises:
        DtbenchError: one line naming the file, line and field for malformed YAML, unknown keys or bad values.
    """
    data, node = _compose(text, source)
    if "include" in data:
        raise DtbenchError(f"{source}: include: needs a suite file (load it with load_suite)")
    return _validate(data, lambda loc: f"{source}:{_line_of(node, loc)}")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DtbenchError(f"cannot read suite {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise DtbenchError(f"{path}:{line}: not UTF-8 text (byte {exc.start}); save the suite as UTF-8") from None


def _load_tree(path: Path, chain: tuple[Path, ...], texts: list[tuple[Path, str]]) -> tuple[dict, dict]:
    """Merged data of ``path`` and its includes, and for each top-level key the (file, node) that set it.

    ``include:`` names one file or a list, relative to the including file; they are merged in order, then the
    including file's own keys override theirs (top-level keys are replaced whole, lm-evaluation-harness style).
    """
    if len(chain) > MAX_INCLUDE_DEPTH:
        raise DtbenchError(f"{path}: include: nested more than {MAX_INCLUDE_DEPTH} levels")
    text = _read(path)
    texts.append((path, text))
    data, node = _compose(text, str(path))
    merged: dict = {}
    origin: dict = {}
    includes = data.pop("include", None)
    if includes is not None:
        names = includes if isinstance(includes, list) else [includes]
        for name in names:
            if not isinstance(name, str) or not name:
                raise DtbenchError(f"{path}:{_line_of(node, ('include',))}: include: must be a file name or a list "
                                   f"of them")
            child = (path.parent / name).resolve()
            if child in chain or child == path.resolve():
                raise DtbenchError(f"{path}: include: {clip(name, 100)} includes itself (directly or not)")
            if not child.is_file():
                raise DtbenchError(f"{path}:{_line_of(node, ('include',))}: include: {clip(name, 100)} not found")
            sub, sub_origin = _load_tree(child, chain + (path.resolve(),), texts)
            merged.update(sub)
            origin.update(sub_origin)
    merged.update(data)
    origin.update({k: (path, node) for k in data})
    return merged, origin


def load_suite(path: str | Path) -> tuple[Suite, str]:
    """Read and validate a suite file, resolving ``include:`` (files merged in order, this file's keys last).

    Returns:
        (suite, its text): the text stored with the run (and hashed to match a resumed run) is the file's own
        text followed by every included file's, so changing an included file makes a new suite.

    Raises:
        DtbenchError: if a file is missing or invalid, an include cycles or nests too deeply.
    """
    path = Path(path)
    texts: list[tuple[Path, str]] = []
    data, origin = _load_tree(path, (), texts)

    def where_of(loc: tuple) -> str:
        src, node = origin.get(loc[0], (path, None)) if loc else (path, None)
        if node is None:
            return str(src)
        return f"{src}:{_line_of(node, loc)}"

    suite = _validate(data, where_of)
    text = texts[0][1] + "".join(f"\n# --- include: {p} ---\n{t}" for p, t in texts[1:])
    return suite, text


def suite_hash(text: str) -> str:
    """sha256 of the suite text (hex), stored with each run."""
    return hashlib.sha256(text.encode()).hexdigest()
