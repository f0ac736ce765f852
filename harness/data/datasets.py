"""Datasets: the dataset plugin contract, the built-in datasets, the registry and loading an entry's documents.

Reading local files and the hub belongs to :mod:`dtbench.harness.data.sources`; choosing prompts from the documents (the
seeded order, the prompt cap, held-out corpora) to :mod:`dtbench.harness.data.selection`.

Datasets are plugins like decoders: a :class:`Dataset` subclass registered under the entry-point group
``dtbench.datasets`` (the built-ins register the same way, and their names are reserved). Built-in datasets:
  - ``wikitext-2``: WikiText-2 raw, test split, one document per article (`` = Title = `` headings). Hub:
    ``Salesforce/wikitext`` config ``wikitext-2-raw-v1`` (the dataset formerly named ``wikitext``, whose repo is
    itself parquet since its conversion: ``wikitext-2-raw-v1/test-*.parquet``); local:
    ``<data_dir>/wikitext-2-raw/wiki.test.raw``.
  - ``pg19``: PG-19 test books, Project Gutenberg header and footer stripped as PG-19 does. Hub:
    ``emozilla/pg19`` (``data/test-*.parquet``; columns short_book_title, publication_date, url, text), a
    parquet copy of DeepMind's splits. The canonical ``deepmind/pg19`` is a loading-script dataset (pg19.py
    downloading from Google Cloud Storage), which ``datasets`` >= 4 refuses ("Dataset scripts are no longer
    supported"), and the hub's automatic parquet export (revision ``refs/convert/parquet``) is not guaranteed
    for script datasets, so the maintained parquet copy is the default; a suite can point ``hub_id:`` and
    ``revision:`` at another parquet source (for example ``deepmind/pg19`` at ``refs/convert/parquet`` where
    that export exists). Local: ``<data_dir>/pg19-test/*.txt``.
  - ``text-files``: a user's own corpus, one document per file (``path:`` a folder or a glob).
  - ``spec-bench``: Spec-Bench's questions (a chat workload; :mod:`dtbench.harness.data.questions`).

Source precedence: a local folder (the dataset's ``data_dir:``, the ``--data-dir`` option or
``DTBENCH_DATA_DIR``) wins; otherwise the hub, at the entry's ``hub_id:`` / ``revision:`` if given (``hub_id``
may also name a local folder with the hub repo's parquet layout: the same ``datasets.load_dataset`` call reads
it, which is how the tests exercise the hub path offline). :func:`provenance` says where each loaded dataset
came from (hub id, config, split, revision; or local files and their sha256): :func:`load_documents` returns it
with the documents (:attr:`Documents.provenance`), for the run's environment. A dataset's hub source is its class
attribute :attr:`Dataset.hub`; its own suite keys (``params:``) are its pydantic :attr:`Dataset.Params` model,
validated by the same code path as decoders' params (:func:`dtbench.harness.registry.validate_model`).
"""

from __future__ import annotations

import glob
import json
import random
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, Field

from dtbench.core import StrictBools
from dtbench.harness.data.sources import (
    HubSource,
    hub_rows,
    local_dir,
    local_files,
    read_document,
    read_text_file,
    split_wikitext,
    strip_gutenberg,
)
from dtbench.harness.errors import DtbenchError
from dtbench.harness.registry import validate_model
from dtbench.harness.suites.suite import DatasetSpec
from dtbench.registry import Registry, subclass_of


class DatasetParams(StrictBools):
    """Base of every dataset's own suite keys (an entry's ``params:``): frozen, unknown keys rejected, booleans never
    taken as numbers (as :class:`dtbench.decoders.base.DecoderParams`). The built-ins declare none."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Documents(list):
    """The (title, text) documents of one dataset entry, in source order, carrying the entry's ``skip`` (so
    :func:`~dtbench.harness.data.selection.select_prompts` honours it whoever calls the pair) and where they came from
    (``source``)."""

    def __init__(
        self,
        docs: Iterable[tuple[str, str]],
        skip: int = 0,
        source: dict[str, Any] | None = None,
        name: str | None = None,
    ):
        super().__init__(docs)
        self.skip = skip
        self.source = source or {}
        self.name = name

    @property
    def provenance(self) -> dict[str, Any]:
        """Where these documents came from, JSON-serialisable, for the run's environment (``env["datasets"]``):
        ``{"name", "source": "hub", "hub_id", "config", "split", "revision", "datasets", "skip"}`` or
        ``{"name", "source": "local", "files", "sha256", "skip"}`` (a plugin's own source dict otherwise)."""
        return {"name": self.name, **self.source, "skip": self.skip}


def _wikitext(spec: DatasetSpec, data_dir: str | None) -> Documents:
    local = local_dir(spec, data_dir)
    if local is not None:
        path = local / "wikitext-2-raw" / "wiki.test.raw"
        if not path.is_file():
            raise DtbenchError(f"wikitext-2: {path} not found (data dir {local})")
        return Documents(split_wikitext(read_document(path)), source=local_files([path]))
    rows, source = hub_rows(spec, WikiText2.hub)
    # One row per line of the raw file (blank lines included), each ending in a newline.
    return Documents(
        split_wikitext("\n".join(r["text"].rstrip("\n") for r in rows if r["text"].strip())), source=source
    )


def _pg19(spec: DatasetSpec, data_dir: str | None) -> Documents:
    local = local_dir(spec, data_dir)
    if local is not None:
        files = sorted((local / "pg19-test").glob("*.txt"))
        if not files:
            raise DtbenchError(f"pg19: no books (*.txt) in {local / 'pg19-test'}")
        return Documents([(f.stem, strip_gutenberg(read_document(f))) for f in files], source=local_files(files))
    rows, source = hub_rows(spec, PG19.hub)
    books: list[tuple[str, str]] = []
    for row in rows:  # streamed: read only as many books as the selection can use
        books.append((row.get("short_book_title") or str(len(books)), strip_gutenberg(row["text"])))
        if len(books) >= spec.prompts + spec.skip:
            break
    source["rows_read"] = len(books)
    return Documents(books, source=source)


def _text_files(spec: DatasetSpec, data_dir: str | None) -> Documents:
    if not spec.path:
        raise DtbenchError("text-files: set `path:` to a folder or glob of .txt files")
    p = Path(spec.path).expanduser()
    files = sorted(p.rglob("*.txt")) if p.is_dir() else sorted(Path(f) for f in glob.glob(str(p)))
    if not files:
        raise DtbenchError(f"text-files: no files match {spec.path}")
    return Documents([(str(f), read_text_file(f)) for f in files], source=local_files(files))


class Dataset(ABC):
    """A source of documents for prompts, registered under the ``dtbench.datasets`` entry-point group.

    Subclasses implement :meth:`documents`; the suite's dataset entry (:class:`~dtbench.harness.suites.suite.DatasetSpec`:
    ``path``, ``data_dir``, ...) is passed in. Prompt selection and the prompt cap are dtbench's, the same for
    every dataset (:func:`~dtbench.harness.data.selection.select_prompts`).

    Class attributes:
        Params: the pydantic model of the entry's ``params:`` (a :class:`DatasetParams`; validated before any model
            loads, by :func:`dataset`); the instance's ``self.params``.
        hub: where the dataset lives on the Hugging Face hub (:class:`HubSource`), or None (local or plugin data).
        chat: True for question datasets (a chat workload: the suite's ``stop_at_eos`` defaults to true, and its
            ``chat_template`` to ``auto``); False for raw text continued as it is (the paper's protocol).
        stop_at_eos: the suite's ``stop_at_eos`` default for this dataset; None follows ``chat`` (a code-completion
            workload such as ``humaneval`` is not chat but stops at EOS).
    """

    Params: ClassVar[type[DatasetParams]] = DatasetParams
    hub: ClassVar[HubSource | None] = None
    chat: bool = False
    stop_at_eos: ClassVar[bool | None] = None

    def __init__(self, params: DatasetParams | None = None):
        """Bind the validated params (an instance of ``self.Params``; its defaults when None)."""
        self.params = params if params is not None else self.Params()

    @abstractmethod
    def documents(self, spec: DatasetSpec, data_dir: str | None) -> list[tuple[str, str]]:
        """(title, text) documents in source order.

        Raises:
            DtbenchError: missing files or an unreachable source, as one line.
        """

    def check(self, spec: DatasetSpec) -> None:
        """Cheap checks before any model loads (``dtbench validate``); reading a local corpus is fine here."""

    def slots(self, spec: DatasetSpec, seed: int, data_dir: str | None) -> list | None:
        """A question dataset's samples in prompt-index order (:class:`dtbench.harness.data.questions.Slot`: turn, group,
        warmup), known before any model loads; None for raw text (``prompts`` samples, the first ``warmup`` warm)."""
        return None


class SpecBench(Dataset):
    """Spec-Bench's 480 questions (six task groups; MT-bench's two turns), or a user's jsonl of the same fields
    (:mod:`dtbench.harness.data.questions`). A chat workload: stop at EOS and the target's chat template by default."""

    chat = True

    def documents(self, spec, data_dir):
        from dtbench.harness.data import questions

        found, source = questions.load_questions(spec, data_dir)
        return Documents([(q.question_id, q.turns[0]) for q in found], source=source)

    def slots(self, spec, seed, data_dir):
        from dtbench.harness.data import questions

        return questions.layout(spec, seed, data_dir)


class WikiText2(Dataset):
    """WikiText-2 raw, test split, one document per article."""

    hub = HubSource("Salesforce/wikitext", "wikitext-2-raw-v1", "test", streaming=False)

    def documents(self, spec, data_dir):
        return _wikitext(spec, data_dir)


class PG19(Dataset):
    """PG-19 test books, Project Gutenberg header and footer stripped."""

    hub = HubSource("emozilla/pg19", None, "test", streaming=True)

    def documents(self, spec, data_dir):
        return _pg19(spec, data_dir)


def _humaneval(spec: DatasetSpec, data_dir: str | None) -> Documents:
    local = local_dir(spec, data_dir)
    rows: Iterable[dict[str, Any]]
    if local is not None:
        path = local / "humaneval" / "HumanEval.jsonl"
        if not path.is_file():
            raise DtbenchError(f"humaneval: {path} not found (data dir {local})")
        read: list[dict[str, Any]] = []
        rows, source = read, local_files([path])
        for n, line in enumerate(read_document(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DtbenchError(f"humaneval: {path} line {n} is not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise DtbenchError(f"humaneval: {path} line {n} has no string 'prompt'")
            read.append(row)
    else:
        rows, source = hub_rows(spec, HumanEval.hub)
    return Documents([(str(r.get("task_id", i)), r["prompt"]) for i, r in enumerate(rows)], source=source)


class HumanEval(Dataset):
    """OpenAI HumanEval (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"; 164 problems): code
    completion as a workload. Each problem's ``prompt`` field (imports, a function signature and its docstring) is
    one document, continued as it is: no chat template (not a question dataset), and generation stops at EOS by
    default (:attr:`Dataset.stop_at_eos`), as a completion would. Prompts are chosen and capped like every raw-text
    dataset's (:func:`~dtbench.harness.data.selection.select_prompts`: the first L_max tokens; the longest prompt is 395
    SmolLM2 tokens, so ``L_max >= 400`` keeps every problem whole). Local file ``humaneval/HumanEval.jsonl`` (sha256
    in the run's provenance), else the hub's ``openai/openai_humaneval`` test split."""

    hub = HubSource("openai/openai_humaneval", "openai_humaneval", "test", streaming=False)
    stop_at_eos = True

    def documents(self, spec, data_dir):
        return _humaneval(spec, data_dir)


class TextFiles(Dataset):
    """A user's own corpus: one document per UTF-8 text file (``path:`` a folder or a glob)."""

    def documents(self, spec, data_dir):
        return _text_files(spec, data_dir)

    def check(self, spec):
        _text_files(spec, None)


# the note every report shows (reports/rendering/render.py)
SMOKE_TEST = "smoke test: random tokens say nothing about acceptance"


class RandomTokensParams(DatasetParams):
    """The ``random-tokens`` dataset's keys.

    Attributes:
        vocab: ids are drawn uniformly from [1, vocab) (at most the model's vocabulary: Pythia's tokenizer has
            50,277 tokens; ``random:tiny`` 512).
        documents: how many documents (each yields prompts of up to L_max tokens).
        length: tokens per document.
        seed: the generator's seed (Python's ``random.Random``: the same documents on every machine).
    """

    vocab: int = Field(50277, ge=2, le=1_000_000, description="ids drawn from [1, vocab)")
    documents: int = Field(64, ge=1, le=10_000, description="documents generated")
    length: int = Field(2048, ge=16, le=100_000, description="tokens per document")
    seed: int = Field(0, ge=0, lt=2**63, description="the generator's seed")


class RandomTokens(Dataset):
    """Seeded uniformly random token ids as documents (issue 38 item 4): a workload that needs no download and no
    tokenizer, for the GPU smoke suite (suites/gpu-smoke.yaml) over ``random:<shape>`` models. Each document's text is
    its ids separated by spaces, which a random model's :class:`~dtbench.harness.models.random_models.IdTokenizer` reads
    back; a real tokenizer would re-tokenize the digits, so use it with ``random:`` models only. Every report labels
    its cells a smoke test (:data:`SMOKE_TEST`): random tokens say nothing about acceptance."""

    Params = RandomTokensParams

    def documents(self, spec, data_dir):
        p = self.params
        assert isinstance(p, RandomTokensParams)
        rng = random.Random(p.seed)
        docs = [
            (f"random-{i}", " ".join(str(rng.randrange(1, p.vocab)) for _ in range(p.length)))
            for i in range(p.documents)
        ]
        source = {"source": "random", "smoke_test": True, **p.model_dump()}
        return Documents(docs, skip=spec.skip, source=source, name=spec.name)


REGISTRY: Registry[type[Dataset]] = Registry("dtbench.datasets", "dataset", subclass_of(Dataset))


def dataset(spec: DatasetSpec) -> Dataset:
    """The registered dataset of the entry ``spec``, instantiated with its ``params:`` validated against the
    dataset's own :attr:`Dataset.Params` (the same code path as decoders' params).

    Raises:
        DtbenchError: unknown (with the closest names) or ambiguous name, a broken plugin, or invalid params (one
            line naming the dataset, the key and the problem).
    """
    cls = REGISTRY.get(spec.name)
    return cls(validate_model("dataset", spec.name, cls.Params, spec.params))


def check_dataset(spec: DatasetSpec, *, files: bool = False) -> None:
    """Fail early on an unknown dataset name; with ``files``, also run the dataset's own cheap checks (e.g. read a
    ``text-files`` corpus).

    Raises:
        DtbenchError: with the registered names, or naming a missing or non-text file.
    """
    ds = dataset(spec)
    if files:
        ds.check(spec)


def sample_slots(spec: DatasetSpec, seed: int, data_dir: str | None = None) -> list | None:
    """The entry's samples when its dataset lays them out itself (question datasets; :meth:`Dataset.slots`), else
    None. An unknown dataset name is None here (the plan reports it)."""
    try:
        ds = dataset(spec)
    except DtbenchError:
        return None
    return ds.slots(spec, seed, data_dir)


def stops_at_eos(stop_at_eos: bool | None, spec: DatasetSpec) -> bool:
    """Whether generation stops at EOS for this dataset entry: the suite's ``stop_at_eos`` when given, otherwise the
    dataset's own default (:attr:`Dataset.stop_at_eos`, else :attr:`Dataset.chat`; an unknown dataset name is left
    to the plan's check: False)."""
    if stop_at_eos is not None:
        return stop_at_eos
    try:
        own = getattr(REGISTRY.get(spec.name), "stop_at_eos", None)
    except Exception:  # noqa: BLE001  (an unknown or broken dataset plugin is reported where it is loaded)
        own = None
    return own if own is not None else is_chat(spec)


def is_chat(spec: DatasetSpec) -> bool:
    """Whether the entry's dataset is a question (chat) dataset (:attr:`Dataset.chat`); False for an unknown name
    (the plan reports it)."""
    try:
        return bool(getattr(REGISTRY.get(spec.name), "chat", False))
    except Exception:  # noqa: BLE001  (an unknown or broken dataset plugin is reported where it is loaded)
        return False


def load_documents(spec: DatasetSpec, data_dir: str | None = None) -> Documents:
    """(title, text) documents of a dataset, in source order, with the entry's ``skip`` and their provenance
    (:attr:`Documents.provenance`: returned, not kept in this process).

    Raises:
        DtbenchError: unknown dataset, invalid params, missing local files, or the hub unreachable.
    """
    ds = dataset(spec)
    loaded = ds.documents(spec, data_dir)
    source = getattr(loaded, "source", None) or {
        "source": "plugin",
        "class": f"{type(ds).__module__}.{type(ds).__qualname__}",
    }
    docs = Documents(((t, x) for t, x in loaded if x.strip()), skip=spec.skip, source=source, name=spec.name)
    if not docs:
        raise DtbenchError(f"{spec.name}: no non-empty documents")
    return docs
