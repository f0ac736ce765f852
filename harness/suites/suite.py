"""The suite schema: validated, frozen suite objects (pydantic), checked before anything heavy is loaded.

A suite declares the target and draft models, the datasets (N prompts, W warmup, prompt cap ``L_max``), the
generation lengths T and the decoders with their params. ``prompt_cap`` is the deprecated old name of ``L_max``
(suites written before it, and the suite text stored with their runs, still validate); an entry setting both is an
error. Reading YAML files (``include:``, line numbers in errors, the note on old key names) is
:mod:`dtbench.harness.suites.suitefile`'s. This module holds the suite itself, its models and its datasets; the decoder
entries are :mod:`dtbench.harness.suites.decoderspec`'s, the parts every entry shares :mod:`dtbench.harness.suites.suitebase`'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.suites.bounds import MAX_SECONDS, Seconds, Seed
from dtbench.harness.suites.decoderspec import DecoderSpec, SamplingSpec
from dtbench.harness.suites.suitebase import (
    L_MAX,
    MAX_GRID,
    MAX_LOAD,
    Execution,
    Frozen,
    HasLMax,
    ModelName,
    Name,
    executions,
    no_control,
    one_load_axis,
)

Dtype = Literal["float32", "float16", "bfloat16", "float64"]

MAX_TOKENS = 1 << 20  # upper bound of T and L_max: beyond any model's context, and far below int overflow
MAX_BATCH = MAX_LOAD  # largest batch size B a suite may ask for


def _eager() -> list[Execution]:
    """The suite's default ``execution``: eager only."""
    return ["eager"]


class ModelSpec(Frozen):
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


class DatasetSpec(HasLMax):
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
    categories: list[Annotated[str, Field(min_length=1, max_length=100), AfterValidator(no_control)]] | None = Field(
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


class Suite(Frozen):
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
    min_groups: int | None = Field(
        None,
        ge=1,
        le=100,
        description="measure each (dataset, L_max, T, B) point at least this many times: where it has fewer measured "
        "prompt groups (large B: 16 prompts are 1 group at B = 16), every group is repeated ceil(min_groups / "
        "groups) times (at least `repeats`), interleaved like `repeats`, so a cell of one group is a median of "
        "several measurements rather than one; reports take each group's median over its repeats "
        "(docs/measurement.md); default none",
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
        "process: for debugging; a decoder's child processes and a hang in native code are not contained), auto "
        "(default: process on every device). The local executor's; Ray actors are processes already",
    )
    calibrate: bool = Field(
        False,
        description="measure the target's and draft's forward-latency curves before the first cell and store "
        "them with the run (the cost model of `dtbench report --cost-model`; `n_max: auto` calibrates regardless)",
    )
    lossless_check: Literal["exact", "tie_aware"] = Field(
        "tie_aware",
        description="the lossless verdict: tie_aware (every emitted token is the target's greedy choice "
        "given the decoder's own prefix, numeric near ties allowed; harness/measurement/lossless.py) or exact (token for token "
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
        return one_load_axis(data)

    @field_validator("execution", mode="before")
    @classmethod
    def _execution_list(cls, v):
        return executions(v)

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
