"""Where datasets' documents are read from (split from :mod:`dtbench.harness.data.datasets`, which owns the dataset plugins):
the local data folder and its precedence over the hub (:func:`local_dir`), bounded reads of local files and their
provenance (:func:`local_files`: paths and one sha256), a user's text files (:func:`read_text_file`), a registered
dataset's parquet rows on the Hugging Face hub (:class:`HubSource`, :func:`hub_rows`), and the raw formats' parsing
(WikiText articles, Project Gutenberg bodies).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtbench.harness.errors import DtbenchError
from dtbench.harness.models import hub
from dtbench.harness.safetext import printable
from dtbench.harness.suites.bounds import MAX_DOCUMENT_BYTES, read_regular_file
from dtbench.harness.suites.suite import DatasetSpec

DATA_DIR_ENV = "DTBENCH_DATA_DIR"


def read_document(path: Path) -> str:
    """A local dataset file as text (a bounded read; undecodable bytes replaced, CRLF as LF)."""
    raw = read_regular_file(path, MAX_DOCUMENT_BYTES, what="dataset file")
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n")


def split_wikitext(text: str) -> list[tuple[str, str]]:
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


def local_dir(spec: DatasetSpec, data_dir: str | None) -> Path | None:
    """The entry's local data folder (its ``data_dir:``, else ``data_dir``, else :data:`DATA_DIR_ENV`), or None for
    the hub; a note on stderr when the folder makes the entry's ``hub_id:`` / ``revision:`` unused."""
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


def local_files(files: list[Path]) -> dict[str, Any]:
    """Provenance of local files: their paths and one sha256 over their bytes (in the given order)."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(read_regular_file(f, MAX_DOCUMENT_BYTES, what="dataset file"))
    return {"source": "local", "files": [str(f.resolve()) for f in files], "sha256": digest.hexdigest()}


def read_text_file(path: Path) -> str:
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
