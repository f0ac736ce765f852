"""Datasets -> prompts: documents from the hub or a local folder, deterministic selection, prompt cap.

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
  - ``spec-bench``: Spec-Bench's questions (a chat workload; :mod:`dtbench.harness.questions`).

Source precedence: a local folder (the dataset's ``data_dir:``, the ``--data-dir`` option or
``DTBENCH_DATA_DIR``) wins; otherwise the hub, at the entry's ``hub_id:`` / ``revision:`` if given (``hub_id``
may also name a local folder with the hub repo's parquet layout: the same ``datasets.load_dataset`` call reads
it, which is how the tests exercise the hub path offline). :func:`provenance` says where each loaded dataset
came from (hub id, config, split, revision; or local files and their sha256): :func:`load_documents` returns it
with the documents (:attr:`Documents.provenance`), for the run's environment. A dataset's hub source is its class
attribute :attr:`Dataset.hub`; its own suite keys (``params:``) are its pydantic :attr:`Dataset.Params` model,
validated by the same code path as decoders' params (:func:`dtbench.harness.registry.validate_model`).

Held-out prompts: a dataset entry's ``skip: K`` leaves out the first K usable documents of the seeded order,
so with the same seed and tokenizer its prompts come from other documents than those of any entry with
``prompts <= K`` (how ``suites/dynatree-tuning.yaml`` tunes on documents the benchmarks never use).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, Field

from dtbench.core import Corpus, CorpusSpec, StrictBools
from dtbench.harness import hub
from dtbench.harness.bounds import MAX_DOCUMENT_BYTES, read_regular_file
from dtbench.harness.errors import DtbenchError
from dtbench.harness.prompt import Prompt
from dtbench.harness.registry import Registry, validate_model
from dtbench.harness.safetext import printable
from dtbench.harness.suite import DatasetSpec

DATA_DIR_ENV = "DTBENCH_DATA_DIR"
MIN_PROMPT_TOKENS = 16


def _read(path: Path) -> str:
    raw = read_regular_file(path, MAX_DOCUMENT_BYTES, what="dataset file")
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n")


def _split_wikitext(text: str) -> list[tuple[str, str]]:
    """Articles of WikiText raw text: a top-level heading `` = Title = `` starts each one."""
    docs: list[tuple[str, str]] = []
    title: str | None = None
    lines: list[str] = []
    for line in text.split("\n"):
        m = re.fullmatch(r" = ([^=].*[^=]) = ", line)
        if m:
            if title is not None and lines:
                docs.append((title, "\n".join(lines).strip()))
            title, lines = m.group(1).strip(), []
        elif title is not None:
            lines.append(line)
    if title is not None and lines:
        docs.append((title, "\n".join(lines).strip()))
    return docs


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg file, between the ``*** START OF`` and ``*** END OF`` markers."""
    start = re.search(r"\*\*\* ?START OF[^\n]*\n", text)
    end = re.search(r"\*\*\* ?END OF", text)
    body = text[start.end() if start else 0 : end.start() if end else len(text)]
    return body.strip()


@dataclass(frozen=True)
class HubSource:
    """Where a registered dataset lives on the Hugging Face hub, as parquet (no loading script).

    Attributes:
        hub_id: dataset repo id (overridable per suite entry with ``hub_id:``).
        config: config name (a ``configs:`` entry of the repo card), or None for the default.
        split: split to read.
        streaming: stream rows instead of downloading the split (PG-19's test split is tens of MB; only the first
            books are read).
    """

    hub_id: str
    config: str | None
    split: str
    streaming: bool


class DatasetParams(StrictBools):
    """Base of every dataset's own suite keys (an entry's ``params:``): frozen, unknown keys rejected, booleans never
    taken as numbers (as :class:`dtbench.decoders.base.DecoderParams`). The built-ins declare none."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Documents(list):
    """The (title, text) documents of one dataset entry, in source order, carrying the entry's ``skip`` (so
    :func:`select_prompts` honours it whoever calls the pair) and where they came from (``source``)."""

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


def _local_dir(spec: DatasetSpec, data_dir: str | None) -> Path | None:
    chosen = spec.data_dir or data_dir or os.environ.get(DATA_DIR_ENV)
    if chosen and (spec.hub_id or spec.revision):  # the local folder wins: say that the hub keys are not used
        keys = " and ".join(k for k in ("hub_id", "revision") if getattr(spec, k))
        print(
            f"note: {spec.name}: {keys} ignored: the local data folder {printable(chosen)} is used instead (unset --data-dir, "
            f"{DATA_DIR_ENV} and data_dir: to load from the hub)",
            file=sys.stderr,
            flush=True,
        )
    return Path(chosen).expanduser() if chosen else None


def _local_files(files: list[Path]) -> dict[str, Any]:
    """Provenance of local files: their paths and one sha256 over their bytes (in the given order)."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(read_regular_file(f, MAX_DOCUMENT_BYTES, what="dataset file"))
    return {"source": "local", "files": [str(f.resolve()) for f in files], "sha256": digest.hexdigest()}


def _wikitext(spec: DatasetSpec, data_dir: str | None) -> Documents:
    local = _local_dir(spec, data_dir)
    if local is not None:
        path = local / "wikitext-2-raw" / "wiki.test.raw"
        if not path.is_file():
            raise DtbenchError(f"wikitext-2: {path} not found (data dir {local})")
        return Documents(_split_wikitext(_read(path)), source=_local_files([path]))
    rows, source = hub_rows(spec, WikiText2.hub)
    # One row per line of the raw file (blank lines included), each ending in a newline.
    return Documents(
        _split_wikitext("\n".join(r["text"].rstrip("\n") for r in rows if r["text"].strip())), source=source
    )


def _pg19(spec: DatasetSpec, data_dir: str | None) -> Documents:
    local = _local_dir(spec, data_dir)
    if local is not None:
        files = sorted((local / "pg19-test").glob("*.txt"))
        if not files:
            raise DtbenchError(f"pg19: no books (*.txt) in {local / 'pg19-test'}")
        return Documents([(f.stem, strip_gutenberg(_read(f))) for f in files], source=_local_files(files))
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
    return Documents([(str(f), _read_text_file(f)) for f in files], source=_local_files(files))


def _read_text_file(path: Path) -> str:
    """A user's document as text: UTF-8 without NUL bytes, else a one-line error naming the file.

    Raises:
        DtbenchError: for an unreadable file, or one that is binary (a NUL byte) or not UTF-8 text.
    """
    try:
        raw = read_regular_file(path, MAX_DOCUMENT_BYTES, what="document")
    except DtbenchError as exc:
        raise DtbenchError(f"text-files: {exc}") from None
    if b"\0" in raw:
        raise DtbenchError(f"text-files: {path} is not a text document (it holds NUL bytes)")
    try:
        return raw.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as exc:
        raise DtbenchError(f"text-files: {path} is not UTF-8 text (byte {exc.start})") from None


def hub_rows(spec: DatasetSpec, base: HubSource) -> tuple[Iterable[dict[str, Any]], dict[str, Any]]:
    """The rows of a registered dataset from its parquet source on the hub (no loading script).

    Calls ``datasets.load_dataset(hub_id, config, split=..., revision=..., streaming=...)`` with the
    dataset's hub source ``base`` (its class attribute :attr:`Dataset.hub`), ``hub_id`` and ``revision``
    overridden by the suite entry's keys.

    Returns:
        (rows: an iterable of dicts with at least a ``text`` column, provenance dict).

    Raises:
        DtbenchError: the hub (or the given folder) cannot be read, naming the offline alternative.
    """
    hub_id = spec.hub_id or base.hub_id
    source = {"source": "hub", "hub_id": hub_id, "config": base.config, "split": base.split, "revision": spec.revision}
    try:
        import datasets

        source["datasets"] = datasets.__version__
        if not Path(hub_id).expanduser().is_dir():
            hub.prepare()  # an unreachable hub: one short probe, then the cache only (no half minute of retries)
        with hub.quiet():
            rows = datasets.load_dataset(
                hub_id, base.config, split=base.split, revision=spec.revision, streaming=base.streaming
            )
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise DtbenchError(
            f"{spec.name}: cannot load {hub_id} from the Hugging Face hub ({first}); "
            f"offline, point --data-dir or {DATA_DIR_ENV} at a local copy (e.g. ../shared/data)"
        ) from None
    return rows, source


class Dataset(ABC):
    """A source of documents for prompts, registered under the ``dtbench.datasets`` entry-point group.

    Subclasses implement :meth:`documents`; the suite's dataset entry (:class:`~dtbench.harness.suite.DatasetSpec`:
    ``path``, ``data_dir``, ...) is passed in. Prompt selection and the prompt cap are dtbench's, the same for
    every dataset (:func:`select_prompts`).

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
        """A question dataset's samples in prompt-index order (:class:`dtbench.harness.questions.Slot`: turn, group,
        warmup), known before any model loads; None for raw text (``prompts`` samples, the first ``warmup`` warm)."""
        return None


class SpecBench(Dataset):
    """Spec-Bench's 480 questions (six task groups; MT-bench's two turns), or a user's jsonl of the same fields
    (:mod:`dtbench.harness.questions`). A chat workload: stop at EOS and the target's chat template by default."""

    chat = True

    def documents(self, spec, data_dir):
        from dtbench.harness import questions

        found, source = questions.load_questions(spec, data_dir)
        return Documents([(q.question_id, q.turns[0]) for q in found], source=source)

    def slots(self, spec, seed, data_dir):
        from dtbench.harness import questions

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
    local = _local_dir(spec, data_dir)
    rows: Iterable[dict[str, Any]]
    if local is not None:
        path = local / "humaneval" / "HumanEval.jsonl"
        if not path.is_file():
            raise DtbenchError(f"humaneval: {path} not found (data dir {local})")
        read: list[dict[str, Any]] = []
        rows, source = read, _local_files([path])
        for n, line in enumerate(_read(path).splitlines(), 1):
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
    dataset's (:func:`select_prompts`: the first L_max tokens; the longest prompt is 395 SmolLM2 tokens, so
    ``L_max >= 400`` keeps every problem whole). Local file ``humaneval/HumanEval.jsonl`` (sha256 in the run's
    provenance), else the hub's ``openai/openai_humaneval`` test split."""

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


SMOKE_TEST = "smoke test: random tokens say nothing about acceptance"  # the note every report shows (reports/render)


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
    its ids separated by spaces, which a random model's :class:`~dtbench.harness.models.IdTokenizer` reads back; a
    real tokenizer would re-tokenize the digits, so use it with ``random:`` models only. Every report labels its cells
    a smoke test (:data:`SMOKE_TEST`): random tokens say nothing about acceptance."""

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


REGISTRY: Registry[Dataset] = Registry("dtbench.datasets", "dataset", Dataset)


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


def seeded_order(n_documents: int, seed: int) -> list[int]:
    """The document order of ``seed``: indices 0..n-1 shuffled by ``random.Random(seed)`` (the one order prompts are
    drawn in and corpora are held out by)."""
    order = list(range(n_documents))
    random.Random(seed).shuffle(order)
    return order


def usable(n_tokens: int, l_max: int) -> bool:
    """Whether a document of ``n_tokens`` tokens yields a prompt at cap ``l_max``: a full chunk of ``l_max`` tokens,
    or at least :data:`MIN_PROMPT_TOKENS` (the one usable-document rule of :func:`select_prompts`)."""
    return n_tokens >= min(l_max, MIN_PROMPT_TOKENS)


def select_prompts(
    documents: list[tuple[str, str]], tokenizer, n: int, l_max: int, seed: int, skip: int | None = None
) -> list[Prompt]:
    """Choose N prompts deterministically and cap each at ``l_max`` tokens.

    Documents are shuffled with ``seed``; the first ``skip`` usable documents of that order (those with at
    least one prompt, i.e. 16 tokens) are left out; prompt i is the i-th chunk of ``l_max`` tokens taken
    round-robin over the rest (first chunk of every document, then second chunks, ...), so a long book yields
    several prompts and every prompt is exactly ``l_max`` tokens unless a document is shorter (then the
    whole document, if it has at least 16 tokens). Only as many documents are tokenized as needed. With
    N <= (usable documents), the N prompts come from the first N usable documents, one each: so entries with
    the same seed and tokenizer, one with ``prompts <= K`` and one with ``skip >= K``, share no document.

    Args:
        documents: (title, text) pairs (a :class:`Documents` carries its entry's ``skip``).
        tokenizer: a transformers tokenizer (its ``encode`` with special tokens as the model expects).
        n: N prompts.
        l_max: L_max in tokens.
        seed: selection seed.
        skip: usable documents to leave out; None = the documents' own ``skip`` (0 for a plain list).

    Returns:
        N prompts (token ids as int tuples).

    Raises:
        DtbenchError: if the documents hold fewer than N usable prompts.
    """
    if skip is None:
        skip = getattr(documents, "skip", 0)
    chunks: list[list[tuple[str, list[int]]]] = []
    skipped = 0
    for i in seeded_order(len(documents), seed):
        title, text = documents[i]
        # Tokenizing only a prefix keeps long books cheap: about 6 characters per token is generous.
        ids = tokenizer.encode(text[: l_max * 12 * max(1, n)])
        pieces = [ids[j : j + l_max] for j in range(0, len(ids), l_max)]
        pieces = [p for k, p in enumerate(pieces) if len(p) == l_max or (k == 0 and usable(len(p), l_max))]
        if pieces and skipped < skip:
            skipped += 1
            continue
        if pieces:
            chunks.append([(title, p) for p in pieces])
        if sum(len(c) for c in chunks) >= n and len(chunks) >= min(n, len(documents) - skip):
            break
    picked: list[tuple[str, list[int]]] = []
    depth = 0
    while len(picked) < n and any(depth < len(c) for c in chunks):
        picked.extend(c[depth] for c in chunks if depth < len(c))
        depth += 1
    if len(picked) < n:
        after = f" after skipping {skip} documents" if skip else ""
        raise DtbenchError(f"only {len(picked)} prompts of up to {l_max} tokens available{after}, {n} asked for")
    return [Prompt(index=i, document=t, token_ids=tuple(ids)) for i, (t, ids) in enumerate(picked[:n])]


def held_out_documents(documents: list[tuple[str, str]], tokenizer, skip: int, seed: int) -> list[list[int]]:
    """Token ids of the documents a corpus may hold: in ``seed``'s order (:func:`seeded_order`), every document up to
    and including the ``skip``-th usable one left out (:func:`usable` at any L_max of 16 or more), the rest kept.

    With the suite's seed this leaves out every document :func:`select_prompts` draws ``prompts <= skip`` prompts
    from, at every L_max (a document usable at an L_max below 16 lies before the ``skip``-th usable one at 16).

    Args:
        documents: (title, text) pairs; tokenizer: a transformers tokenizer (its ``encode``); skip: usable documents
            left out; seed: the suite's seed.

    Returns:
        Token ids of each kept non-empty document, in the seeded order.
    """
    kept: list[list[int]] = []
    skipped = 0
    for i in seeded_order(len(documents), seed):
        ids = list(tokenizer.encode(documents[i][1]))
        if skipped < skip:
            if usable(len(ids), MIN_PROMPT_TOKENS):
                skipped += 1
            continue
        if ids:
            kept.append(ids)
    return kept


def corpus_documents(spec: CorpusSpec, tokenizer_name: str, seed: int, data_dir: str | None = None) -> Corpus:
    """A decoder's declared corpus as token ids (:class:`~dtbench.core.Corpus`), held out from the suite's prompts
    by :func:`held_out_documents` with the suite's ``seed``; cached for the process (equal key, equal documents).

    Args:
        spec: the declared corpus (:meth:`dtbench.decoders.base.Decoder.corpus_of`).
        tokenizer_name: the tokenizer to load when the spec names none (the target's ``name_or_path``).
        seed: the suite's seed (the order its prompts are drawn in).
        data_dir: the run's data folder (``--data-dir``), as for the suite's datasets.

    Raises:
        DtbenchError: an unknown dataset, unreadable documents, or a tokenizer that cannot be loaded.
    """
    name = spec.tokenizer or tokenizer_name
    key = json.dumps([spec.model_dump(mode="json"), name, seed, data_dir], sort_keys=True)
    if key not in _CORPORA:
        if not name:
            raise DtbenchError(f"corpus {spec.name}: set the decoder's `tokenizer:` (the target names no tokenizer)")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
        except Exception as exc:  # transformers raises OSError, ValueError, ... for a bad id
            raise DtbenchError(
                f"corpus {spec.name}: cannot load tokenizer {name!r}: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from None
        docs = load_documents(corpus_entry(spec), data_dir)
        held = held_out_documents(docs, tokenizer, spec.skip, seed)
        _CORPORA[key] = Corpus(key, tuple(tuple(d) for d in held))
    return _CORPORA[key]


_CORPORA: dict[str, Corpus] = {}


def corpus_entry(spec: CorpusSpec) -> DatasetSpec:
    """The suite dataset entry a declared corpus reads (validated as the suite's ``datasets:`` entries are).

    Raises:
        DtbenchError: a key the entry refuses (e.g. a control character in the name), as one line.
    """
    from pydantic import ValidationError

    from dtbench.harness.errors import error_location

    try:
        return DatasetSpec.model_validate(spec.dataset_entry())
    except ValidationError as exc:
        loc, msg = error_location(exc)
        raise DtbenchError(f"corpus.{loc}: {msg}" if loc else f"corpus: {msg}") from None


def check_corpus(spec: CorpusSpec, datasets: Iterable[DatasetSpec], *, files: bool = False) -> None:
    """Refuse a declared corpus before any model loads: an unknown dataset (with ``files``, unreadable documents), or
    one that would hold the documents of the suite's own prompts: a raw-text entry of the same dataset and source
    whose ``skip + prompts`` exceeds the corpus's ``skip`` (those prompts come from the first ``skip + prompts``
    usable documents of the suite seed's order, :func:`select_prompts`; the corpus leaves out its first ``skip``).

    Raises:
        DtbenchError: one line naming the dataset and the fix.
    """
    entry = corpus_entry(spec)
    try:
        check_dataset(entry, files=files)
    except DtbenchError as exc:
        raise DtbenchError(f"corpus: {exc}") from None
    source = ("name", "data_dir", "path", "hub_id", "revision", "params")
    for ds in datasets:
        if all(getattr(ds, k) == getattr(entry, k) for k in source) and not is_chat(ds):
            need = ds.skip + ds.prompts
            if spec.skip < need:
                raise DtbenchError(
                    f"corpus: {spec.name} with skip: {spec.skip} would hold the documents of the suite's {ds.prompts} "
                    f"{ds.name} prompts (the first {need} usable documents of the suite seed's order); set the "
                    f"corpus's skip: {need} or more"
                )
