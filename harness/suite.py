"""The suite schema: validated, frozen suite objects (pydantic), checked before anything heavy is loaded.

A suite declares the target and draft models, the datasets (N prompts, W warmup, prompt cap ``L_max``), the
generation lengths T and the decoders with their params. ``prompt_cap`` is the deprecated old name of ``L_max``
(suites written before it, and the suite text stored with their runs, still validate); an entry setting both is an
error. Reading YAML files (``include:``, line numbers in errors, the note on old key names) is
:mod:`dtbench.harness.suitefile`'s.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from dtbench.core import StrictBools
from dtbench.harness.bounds import MAX_SECONDS, Seconds, Seed
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.safetext import control_character

Dtype = Literal["float32", "float16", "bfloat16", "float64"]

MAX_TOKENS = 1 << 20  # upper bound of T and L_max: beyond any model's context, and far below int overflow
SWEPT_BY_LIST = ("request_rate",)  # decoder params whose list of values is a sweep axis (server: issue 39 item 2)
MAX_GRID = 10_000  # cells a suite (or one sweep) may expand to
MAX_BATCH = 4096  # largest batch size B a suite may ask for

Execution = Literal["eager", "compiled"]
EXECUTIONS: tuple[str, ...] = ("eager", "compiled")
COMPILED_SUFFIX = " [compiled]"  # a compiled cell's label: its decoder's label + this (eager labels are unchanged)


def _executions(v):
    """``execution:`` as a list (one mode, or the axis), each mode once."""
    if v is None:
        return v
    v = [v] if isinstance(v, str) else v
    if isinstance(v, list) and len(set(map(str, v))) != len(v):
        raise ValueError(f"execution lists a mode twice: {clip(v)}")
    return v


def _one_load_axis(data):
    """``concurrency:`` is the load axis under its serving name: the requests in flight for a server decoder
    (``server``), the batch size B for dtbench's own decoders; stored as ``batch_sizes`` (the cells' ``batch_size``
    column, the reports' load column). Given both, they must be one list."""
    if isinstance(data, dict) and "concurrency" in data:
        data = dict(data)
        levels = data.pop("concurrency")
        if "batch_sizes" in data and data["batch_sizes"] != levels:
            raise ValueError(
                "batch_sizes and concurrency are one axis (the load level: the batch size of dtbench's "
                "decoders, the requests in flight of a server); give it once"
            )
        data["batch_sizes"] = levels
    return data


L_MAX = "L_max"  # the suite key of the prompt cap (datasets, and per-decoder restrictions)
OLD_L_MAX = "prompt_cap"  # its deprecated old name, still accepted


def _no_control(value: str) -> str:
    bad = control_character(value)
    if bad is not None:
        raise ValueError(
            f"holds a control character ({bad}); names and labels reach terminals, Markdown and CSV, so they may not"
        )
    return value


def _eager() -> list[Execution]:
    """The suite's default ``execution``: eager only."""
    return ["eager"]


# A name or label: 1..max_length characters (the database column's width), no control characters (an ESC sequence
# would restyle a terminal, a newline split a Markdown row). Written out: mypy takes only static type aliases.
Name = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_no_control)]
Label = Annotated[str, Field(min_length=1, max_length=300), AfterValidator(_no_control)]
ModelName = Annotated[str, Field(min_length=1, max_length=500), AfterValidator(_no_control)]


class _Frozen(StrictBools):
    # strict: a suite's values are taken as written ("8" is not 8, '42' is not a seed); ints still fill floats.
    # allow_inf_nan=False: no NaN or infinity in any float of a suite (harness/bounds.py says why).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class _Located(_Frozen):
    """A suite entry that knows where it was written (``file:line: key.i``), for one-line errors."""

    _where: str = PrivateAttr("")

    @property
    def where(self) -> str:
        """``file:line: key.i`` of the suite entry (empty if not parsed from a file)."""
        return self._where

    def locate(self, where: str) -> None:
        """Record where the entry was written (the suite loader calls it after validation)."""
        self._where = where


class _HasLMax(_Located):
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


class ModelSpec(_Frozen):
    """A model: the embedded default ``smollm2-135m``, a hub id or a local directory; its dtype and attention."""

    model: ModelName = Field(
        "smollm2-135m", description="the embedded default smollm2-135m, a hub id or a local model folder"
    )
    dtype: Dtype = Field("float32", description="weights and compute dtype")
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="transformers' attention kernel")
    revision: str | None = Field(None, description="hub revision to pin (branch, tag or commit sha)")
    trust_remote_code: bool = Field(
        False,
        description="let transformers import Python files that the model's config.json (auto_map) names; off "
        "by default: such a model is an error, and with it on `validate` names the files that will run",
    )


class SamplingSpec(_Frozen):
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


class DatasetSpec(_HasLMax):
    """A dataset cell axis: N prompts (the first W are warmup), capped at L_max tokens each."""

    name: Name = Field(description="a registered dataset: wikitext-2, pg19, text-files, spec-bench or a plugin's")
    label: Name | None = Field(
        None,
        description="the entry's name in the results (cells, reports, per-decoder `datasets:` restrictions); "
        "default: the dataset's name. Two entries of one dataset (Spec-Bench's questions beside a user's own question "
        "file, two text-files folders) run side by side under different labels",
    )
    prompts: int = Field(10, ge=1, le=MAX_GRID, description="N, prompts measured (warmup included)")
    warmup: int = Field(2, ge=0, description="W, first prompts flagged as warmup")
    l_max: int | list[int] = Field(
        800, alias=L_MAX, description="L_max, maximum prompt length in tokens (a list sweeps it)"
    )
    data_dir: str | None = Field(None, description="local data folder instead of the Hugging Face hub")
    path: str | None = Field(
        None,
        description="files for the text-files dataset (folder or glob); the jsonl "
        "question file of spec-bench (a user's own questions)",
    )
    hub_id: str | None = Field(
        None,
        description="Hugging Face dataset repo (or a local folder of the same parquet layout) to load from "
        "instead of the dataset's default (its class attribute ``hub``; wikitext-2: Salesforce/wikitext, pg19: "
        "emozilla/pg19)",
    )
    revision: str | None = Field(None, description="hub revision to pin (branch, tag or commit sha)")
    categories: list[Annotated[str, Field(min_length=1, max_length=100), AfterValidator(_no_control)]] | None = Field(
        None,
        min_length=1,
        description="question datasets (spec-bench): Spec-Bench groups (mt_bench, translation, "
        "summarization, qa, math_reasoning, rag) and/or raw categories to run, N prompts and W warmup each "
        "(default: the six groups); each named once",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="the dataset's own keys, validated by its Params model (e.g. jsonl-text's text_field)",
    )
    skip: int = Field(
        0,
        ge=0,
        description="held-out selection: leave out the first `skip` usable documents of the seeded "
        "document order, i.e. the documents a suite with the same seed and prompts <= skip draws its prompts from "
        "(tuning on other documents than the benchmark)",
    )

    @property
    def key(self) -> str:
        """The entry's identity in the results: its ``label``, else the dataset's name (stored as ``cells.dataset``)."""
        return self.label or self.name

    @field_validator("l_max")
    @classmethod
    def _caps_positive(cls, v):
        l_maxes = v if isinstance(v, list) else [v]
        if not l_maxes or any(c < 1 for c in l_maxes):
            raise ValueError(f"{L_MAX} must be a positive integer or a non-empty list of them")
        if any(c > MAX_TOKENS for c in l_maxes):
            raise ValueError(f"{L_MAX} must be at most {MAX_TOKENS} tokens")
        if len(set(l_maxes)) != len(l_maxes):
            raise ValueError(f"{L_MAX} lists a value twice: {clip(l_maxes)}")
        return v

    @field_validator("categories")
    @classmethod
    def _categories_once(cls, v):
        if v is not None:
            twice = sorted({c for c in v if v.count(c) > 1})
            if twice:  # two selections of one name would merge their questions in every report
                raise ValueError(f"categories lists {clip(', '.join(twice), 100)} twice; name each once")
        return v

    @model_validator(mode="after")
    def _warmup_below_prompts(self):
        if self.warmup >= self.prompts:
            raise ValueError(f"warmup ({self.warmup}) must be smaller than prompts ({self.prompts})")
        return self

    @property
    def l_maxes(self) -> list[int]:
        """Its L_max values (one, or the swept list)."""
        return self.l_max if isinstance(self.l_max, list) else [self.l_max]


class DecoderSpec(_HasLMax):
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
        return _executions(v)

    @model_validator(mode="before")
    @classmethod
    def _concurrency(cls, data):
        return _one_load_axis(data)

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
                _no_control(text)
            if not values:
                raise ValueError(f"sweep over '{clip(key, 60)}' has no values (a sweep needs at least one point)")
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
            suffix = ", ".join(f"{k}={v}" for k, v in point.items())
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


class Suite(_Frozen):
    """A whole benchmark: models x datasets x prompt caps (L_max) x generation lengths x decoders."""

    name: Name = Field(description="the suite's name (stored with the run)")
    description: str = Field("", description="free text, stored with the run")
    seed: Seed = Field(0, description="prompt selection seed (0 <= seed < 2^63, what torch accepts)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu")
    target: ModelSpec = Field(default_factory=ModelSpec, description="the target model")
    draft: ModelSpec | None = Field(None, description="the draft model, for decoders that need one")
    datasets: list[DatasetSpec] = Field(min_length=1, description="where prompts come from (one cell axis)")
    generation_lengths: list[int] = Field(min_length=1, description="T values, new tokens per prompt")
    decoders: list[DecoderSpec] = Field(min_length=1, description="the decoders measured, each with its params")
    batch_sizes: list[int] = Field(
        default_factory=lambda: [1],
        min_length=1,
        description="batch sizes B: at B a decoder decodes B prompts of "
        "the dataset together (grouped in order, the same groups for every decoder; a last group smaller than B is "
        "decoded as a smaller batch and marked); default [1]. `concurrency:` is the same axis under its serving "
        "name: a server decoder keeps that many requests in flight",
    )
    repeats: int = Field(
        1,
        ge=1,
        le=100,
        description="measure each prompt (each prompt group at B > 1) this many times, interleaved: every decoder "
        "on the prompt, then every decoder again (never one decoder's repeats back to back); warmup prompts once. "
        "Reports give each cell's median throughput and its coefficient of variation over repeats, and speedup "
        "intervals pair prompts on their median over repeats (docs/measurement.md); default 1",
    )
    execution: list[Execution] = Field(
        default_factory=_eager,
        min_length=1,
        description="how decoders' forwards run: eager (transformers as it is, the default) or compiled (a "
        "preallocated static KV cache, forwards padded to bucket sizes and compiled by torch.compile: CUDA graphs on "
        "CUDA, inductor on CPU; compile time is measured apart, before the warmup); a list makes it an axis, e.g. "
        "[eager, compiled]: every decoder both ways, a compiled cell labelled '<label> [compiled]'",
    )
    sampling: SamplingSpec | None = Field(None, description="sample instead of greedy decoding (absent: greedy)")
    isolation: Literal["auto", "process", "none"] = Field(
        "auto",
        description="where cells are measured: process (a child process that loads the models once; a native crash "
        "such as a segfault fails only the cell it hit, the run goes on in a fresh child), none (in the run's own "
        "process), auto (default: process on CUDA, none on CPU). The local executor's; Ray actors are processes "
        "already",
    )
    calibrate: bool = Field(
        False,
        description="measure the target's and draft's forward-latency curves before the first cell and store "
        "them with the run (the cost model of `dtbench report --cost-model`; `n_max: auto` calibrates regardless)",
    )
    lossless_check: Literal["exact", "tie_aware"] = Field(
        "tie_aware",
        description="the lossless verdict: tie_aware (every emitted token is the target's greedy choice "
        "given the decoder's own prefix, numeric near ties allowed; harness/lossless.py) or exact (token for token "
        "equal to the reference's output)",
    )
    chat_template: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="question datasets: 'auto' (the target tokenizer's own chat "
        "template), 'none' (the turns as plain text) or the path of a Jinja chat template file; default auto",
    )
    system_prompt: str | None = Field(None, max_length=100_000, description="a system message before the questions")
    stop_at_eos: bool | None = Field(
        None,
        description="stop each generation at the target's first EOS (T becomes max_new_tokens; no token after "
        "EOS emitted or counted); false: exactly T tokens, EOS ignored (the paper's fixed-T protocol); null (default): "
        "true for question (chat) datasets such as spec-bench, false for raw text",
    )
    timeout_s: Seconds | Literal["auto"] | None = Field(
        "auto",
        description="per-sample time limit in seconds; auto: 10x the reference decoder's time on the same "
        "prompt (at least 60 s; 1800 s for a reference itself); null: none",
    )

    @model_validator(mode="before")
    @classmethod
    def _concurrency(cls, data):
        return _one_load_axis(data)

    @field_validator("execution", mode="before")
    @classmethod
    def _execution_list(cls, v):
        return _executions(v)

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

    @field_validator("batch_sizes")
    @classmethod
    def _positive_batch_sizes(cls, v):
        if any(b < 1 or b > MAX_BATCH for b in v):
            raise ValueError(f"batch sizes must be between 1 and {MAX_BATCH}")
        if len(set(v)) != len(v):
            raise ValueError(f"batch_sizes lists a value twice: {clip(v)}")
        return v

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _positive_timeout(cls, v):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not 0 < v <= MAX_SECONDS:  # NaN fails too
            raise ValueError(
                f"timeout_s must be a positive number of seconds up to {MAX_SECONDS:.0f} (30 days), "
                f"auto, or null (no limit)"
            )
        return v

    @model_validator(mode="after")
    def _unique_dataset_caps(self) -> Suite:
        seen: set[tuple[str, int]] = set()
        for i, ds in enumerate(self.datasets):
            for l_max in ds.l_maxes:
                if (ds.key, l_max) in seen:
                    what = f"label '{clip(ds.key, 60)}'" if ds.label else f"dataset '{clip(ds.name, 60)}'"
                    raise ValueError(
                        f"datasets.{i}: {what} with {L_MAX} {l_max} is listed twice (its cells would "
                        f"collide; give the entries different label: keys)"
                    )
                seen.add((ds.key, l_max))
        cells = (
            len(seen)
            * len(self.generation_lengths)
            * len(self.batch_sizes)
            * len(self.execution)
            * sum(max(1, _product(len(v) for v in d.sweep.values())) for d in self.decoders)
        )
        if cells > MAX_GRID:
            raise ValueError(f"the suite expands to {cells} cells, more than the limit of {MAX_GRID}")
        return self

    def expanded_decoders(self) -> list[DecoderSpec]:
        """Decoder entries after sweep and execution expansion (every eager entry first, then the compiled ones),
        with unique labels.

        Raises:
            DtbenchError: a label used twice, or a decoder's ``execution`` naming a mode the suite does not run.
        """
        for spec in self.decoders:
            extra = sorted(set(spec.execution or []) - set(self.execution))
            if extra:
                where = f"{spec.where}: " if spec.where else ""
                raise DtbenchError(
                    f"{where}decoder '{clip(spec.display, 80)}': execution {extra} is not in the suite's "
                    f"execution {self.execution}"
                )
        out = [
            d.executed(mode)
            for mode in self.execution
            for spec in self.decoders
            if spec.execution is None or mode in spec.execution
            for d in spec.expand()
        ]
        seen: dict[str, DecoderSpec] = {}
        for d in out:
            if d.display in seen:
                raise DtbenchError(
                    f"{d.where or 'suite'}: decoder label '{clip(d.display, 80)}' is used twice "
                    f"(set a distinct `label:`)"
                )
            seen[d.display] = d
        return out


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out
