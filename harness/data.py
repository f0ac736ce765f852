"""Datasets -> prompts: documents from the hub or a local folder, deterministic selection, prompt cap.

Registered datasets:
  - ``wikitext-2``: WikiText-2 raw, test split (hub ``wikitext``/``wikitext-2-raw-v1``; local
    ``<data_dir>/wikitext-2-raw/wiki.test.raw``), one document per article (`` = Title = `` headings).
  - ``pg19``: PG-19 test books (hub ``deepmind/pg19``; local ``<data_dir>/pg19-test/*.txt``), Project
    Gutenberg header and footer stripped as PG-19 does.
  - ``text-files``: a user's own corpus, one document per file (``path:`` a folder or a glob).

The local folder comes from the dataset's ``data_dir:``, the ``--data-dir`` option or ``DTBENCH_DATA_DIR``.
"""

from __future__ import annotations

import glob
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dtbench.harness.errors import DtbenchError
from dtbench.harness.suite import DatasetSpec

DATA_DIR_ENV = "DTBENCH_DATA_DIR"
_MIN_PROMPT_TOKENS = 16


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: its index in the selection, source document, and token ids (at most L_max)."""

    index: int
    document: str
    token_ids: tuple[int, ...]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
    except OSError as exc:
        raise DtbenchError(f"cannot read {path}: {exc.strerror}") from None


def _split_wikitext(text: str) -> list[tuple[str, str]]:
    """Articles of WikiText raw text: a top-level heading `` = Title = `` starts each one."""
    docs: list[tuple[str, str]] = []
    title, lines = None, []
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


def _local_dir(spec: DatasetSpec, data_dir: str | None) -> Path | None:
    chosen = spec.data_dir or data_dir or os.environ.get(DATA_DIR_ENV)
    return Path(chosen).expanduser() if chosen else None


def _wikitext(spec: DatasetSpec, data_dir: str | None) -> list[tuple[str, str]]:
    local = _local_dir(spec, data_dir)
    if local is not None:
        path = local / "wikitext-2-raw" / "wiki.test.raw"
        if not path.is_file():
            raise DtbenchError(f"wikitext-2: {path} not found (data dir {local})")
        return _split_wikitext(_read(path))
    rows = _hub(lambda ds: ds.load_dataset("wikitext", "wikitext-2-raw-v1", split="test"), "wikitext-2")
    return _split_wikitext("\n".join(r["text"].rstrip("\n") for r in rows if r["text"].strip()))


def _pg19(spec: DatasetSpec, data_dir: str | None) -> list[tuple[str, str]]:
    local = _local_dir(spec, data_dir)
    if local is not None:
        files = sorted((local / "pg19-test").glob("*.txt"))
        if not files:
            raise DtbenchError(f"pg19: no books (*.txt) in {local / 'pg19-test'}")
        return [(f.stem, strip_gutenberg(_read(f))) for f in files]
    # PG-19's own copies are already stripped; streaming avoids downloading the whole test split.
    rows = _hub(lambda ds: ds.load_dataset("deepmind/pg19", split="test", streaming=True), "pg19")
    books = []
    for row in rows:
        books.append((row.get("short_book_title") or str(len(books)), row["text"]))
        if len(books) >= spec.prompts:
            break
    return books


def _text_files(spec: DatasetSpec, data_dir: str | None) -> list[tuple[str, str]]:
    if not spec.path:
        raise DtbenchError("text-files: set `path:` to a folder or glob of .txt files")
    p = Path(spec.path).expanduser()
    files = sorted(p.rglob("*.txt")) if p.is_dir() else sorted(Path(f) for f in glob.glob(str(p)))
    if not files:
        raise DtbenchError(f"text-files: no files match {spec.path}")
    return [(str(f), _read_text_file(f)) for f in files]


def _read_text_file(path: Path) -> str:
    """A user's document as text: UTF-8 without NUL bytes, else a one-line error naming the file.

    Raises:
        DtbenchError: for an unreadable file, or one that is binary (a NUL byte) or not UTF-8 text.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DtbenchError(f"text-files: cannot read {path}: {exc.strerror}") from None
    if b"\0" in raw:
        raise DtbenchError(f"text-files: {path} is not a text document (it holds NUL bytes)")
    try:
        return raw.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as exc:
        raise DtbenchError(f"text-files: {path} is not UTF-8 text (byte {exc.start})") from None


def _hub(load: Callable, name: str):
    try:
        import datasets

        return load(datasets)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise DtbenchError(
            f"{name}: cannot load from the Hugging Face hub ({first}); "
            f"offline, point --data-dir or {DATA_DIR_ENV} at a local copy (e.g. ../shared/data)"
        ) from None


DATASETS: dict[str, Callable[[DatasetSpec, str | None], list[tuple[str, str]]]] = {
    "wikitext-2": _wikitext,
    "pg19": _pg19,
    "text-files": _text_files,
}


def check_dataset(spec: DatasetSpec, *, files: bool = False) -> None:
    """Fail early on an unknown dataset name; with ``files``, also read a ``text-files`` corpus (cheap, local).

    Raises:
        DtbenchError: with the registered names, or naming a missing or non-text file.
    """
    if spec.name not in DATASETS:
        raise DtbenchError(f"unknown dataset '{spec.name}' (registered: {', '.join(DATASETS)})")
    if files and spec.name == "text-files":
        _text_files(spec, None)


def load_documents(spec: DatasetSpec, data_dir: str | None = None) -> list[tuple[str, str]]:
    """(title, text) documents of a dataset, in source order.

    Raises:
        DtbenchError: unknown dataset, missing local files, or the hub unreachable.
    """
    check_dataset(spec)
    docs = [(t, x) for t, x in DATASETS[spec.name](spec, data_dir) if x.strip()]
    if not docs:
        raise DtbenchError(f"{spec.name}: no non-empty documents")
    return docs


def select_prompts(
    documents: list[tuple[str, str]], tokenizer, n: int, prompt_cap: int, seed: int
) -> list[Prompt]:
    """Choose N prompts deterministically and cap each at ``prompt_cap`` tokens.

    Documents are shuffled with ``seed``; prompt i is the i-th chunk of ``prompt_cap`` tokens taken round-robin
    (first chunk of every document, then second chunks, ...), so a long book yields several prompts and every
    prompt is exactly ``prompt_cap`` tokens unless a document is shorter (then the whole document, if it has at
    least 16 tokens). Only as many documents are tokenized as needed.

    Args:
        documents: (title, text) pairs.
        tokenizer: a transformers tokenizer (its ``encode`` with special tokens as the model expects).
        n: N prompts.
        prompt_cap: L_max in tokens.
        seed: selection seed.

    Returns:
        N prompts (token ids as int tuples).

    Raises:
        DtbenchError: if the documents hold fewer than N usable prompts.
    """
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    chunks: list[list[tuple[str, list[int]]]] = []
    for i in order:
        title, text = documents[i]
        # Tokenizing only a prefix keeps long books cheap: about 6 characters per token is generous.
        ids = tokenizer.encode(text[: prompt_cap * 12 * max(1, n)])
        pieces = [ids[j : j + prompt_cap] for j in range(0, len(ids), prompt_cap)]
        pieces = [p for k, p in enumerate(pieces) if len(p) == prompt_cap or (k == 0 and len(p) >= _MIN_PROMPT_TOKENS)]
        if pieces:
            chunks.append([(title, p) for p in pieces])
        if sum(len(c) for c in chunks) >= n and len(chunks) >= min(n, len(documents)):
            break
    picked: list[tuple[str, list[int]]] = []
    depth = 0
    while len(picked) < n and any(depth < len(c) for c in chunks):
        picked.extend(c[depth] for c in chunks if depth < len(c))
        depth += 1
    if len(picked) < n:
        raise DtbenchError(f"only {len(picked)} prompts of up to {prompt_cap} tokens available, {n} asked for")
    return [Prompt(index=i, document=t, token_ids=tuple(ids)) for i, (t, ids) in enumerate(picked[:n])]
