"""A retrieval datastore: token ids of a corpus and their suffix array (REST section 3.1), shared by ``rest`` and
``suffix``'s optional corpus, and the params that declare where its text comes from.

Its text is a declared corpus (:class:`~dtbench.core.CorpusSpec`): the harness loads the documents, leaves out the
suite's prompt documents by the one selection rule and the suite's seed, tokenizes them and hands them to the decoder
(:meth:`~dtbench.decoders.base.Decoder.use_corpus`); or a ``.npy`` file of token ids (``tokens:``), read here.
The suffix array comes from ``pydivsufsort`` (maintained PyPI bindings of Yuta Mori's libdivsufsort, C,
O(n log n); it sorts integer arrays, so token ids need no byte encoding), the binary search from numpy. A datastore
is built once per process per corpus (its :attr:`~dtbench.core.Corpus.key`) or tokens file, then cached.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from dtbench.core import Corpus, CorpusSpec, DtbenchError
from dtbench.decoders.base import DecoderParams

SEPARATOR = np.iinfo(np.uint32).max  # between documents: never a token id, so no match or draft crosses it


@dataclass
class Datastore:
    """Token ids of a corpus and their suffix array (REST section 3.1).

    Attributes:
        tokens: (n,) uint32 token ids, documents separated by :data:`SEPARATOR`.
        sa: (n,) int64 suffix array of ``tokens`` (``tokens[sa[i]:]`` sorted lexicographically).
        documents: documents in the datastore.
        build_s: seconds spent tokenizing and sorting (wall clock).
    """

    tokens: np.ndarray
    sa: np.ndarray
    documents: int
    build_s: float

    @classmethod
    def from_documents(cls, docs: list[list[int]]) -> Datastore:
        """Build from token-id documents (suffix array by ``pydivsufsort.divsufsort``).

        Raises:
            DtbenchError: no non-empty document, or pydivsufsort not installed.
        """
        start = time.perf_counter()
        docs = [d for d in docs if len(d)]
        if not docs:
            raise DtbenchError("rest: the corpus holds no tokens")
        try:
            from pydivsufsort import divsufsort
        except ImportError:
            raise DtbenchError("rest: the datastore needs pydivsufsort (pip install pydivsufsort)") from None
        parts = []
        for d in docs:
            parts.extend((np.asarray(d, dtype=np.uint32), np.array([SEPARATOR], dtype=np.uint32)))
        tokens = np.concatenate(parts)
        sa = np.asarray(divsufsort(tokens), dtype=np.int64)
        return cls(tokens, sa, len(docs), time.perf_counter() - start)

    @property
    def nbytes(self) -> int:
        """Bytes held: the tokens and the suffix array."""
        return int(self.tokens.nbytes + self.sa.nbytes)

    def _key(self, i: int, m: int) -> list[int]:
        p = int(self.sa[i])
        return self.tokens[p:p + m].tolist()

    def find(self, pattern: list[int]) -> tuple[int, int]:
        """The suffix-array range [lo, hi) of the suffixes starting with ``pattern`` (binary search, O(m log n))."""
        m = len(pattern)
        lo = bisect.bisect_left(range(len(self.sa)), pattern, key=lambda i: self._key(i, m))
        hi = bisect.bisect_right(range(lo, len(self.sa)), pattern, key=lambda i: self._key(i, m)) + lo
        return lo, hi

    def retrieve(self, context: list[int], max_suffix: int, min_suffix: int, max_retrieved: int,
                 depth: int) -> tuple[int, np.ndarray]:
        """Continuations of the longest context suffix found (REST's exact-match retrieval, longest first).

        Returns:
            (suffix length matched, (R, depth) int64 continuations, -1 past a document's end); (0, empty) when no
            suffix of ``min_suffix`` tokens or more occurs.
        """
        for s in range(min(max_suffix, len(context)), min_suffix - 1, -1):
            lo, hi = self.find(context[-s:])
            if hi > lo:
                starts = self.sa[lo:min(hi, lo + max_retrieved)] + s
                idx = starts[:, None] + np.arange(depth)[None, :]
                cont = self.tokens[np.minimum(idx, len(self.tokens) - 1)].astype(np.int64)
                bad = (idx >= len(self.tokens)) | (cont == SEPARATOR)
                cont[np.logical_or.accumulate(bad, axis=1)] = -1
                return s, cont
        return 0, np.zeros((0, depth), dtype=np.int64)


class CorpusParams(DecoderParams):
    """Where a datastore's text comes from (``rest``; ``suffix``'s optional corpus).

    Attributes:
        corpus: the datastore's text, a dataset entry (:class:`~dtbench.core.CorpusSpec`: ``name`` and its
            ``data_dir`` / ``path`` / ``hub_id``, ``skip``); the harness injects its documents, the suite's prompt
            documents left out with the suite's seed.
        tokens: instead of ``corpus``, a ``.npy`` file of token ids (a pre-tokenized datastore; -1 separates
            documents).
        tokenizer: tokenizer of ``corpus`` (a model id or folder); default: the target's ``name_or_path``.
    """

    corpus: CorpusSpec | None = Field(None, description="the datastore's text: a dataset entry (held out from the "
                                      "suite's prompts with the suite's seed)")
    tokens: str | None = Field(None, description="or a .npy file of token ids (-1 separates documents)")
    tokenizer: str | None = Field(None, description="tokenizer for corpus (default: the target's name_or_path)")

    @model_validator(mode="before")
    @classmethod
    def _no_own_seed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "seed" in data:
            raise ValueError("seed: the corpus is held out with the suite's seed (the order its prompts are drawn "
                             "in); remove `seed:` from the decoder's params")
        return data

    @model_validator(mode="after")
    def _corpus_or_tokens(self) -> CorpusParams:
        if self.corpus is not None and self.tokens is not None:
            raise ValueError("give at most one of `corpus` (a dataset entry) and `tokens` (a .npy file)")
        if self.tokens is not None and not Path(self.tokens).expanduser().is_file():
            raise ValueError(f"tokens file {self.tokens} does not exist")
        return self

    @property
    def has_corpus(self) -> bool:
        return self.corpus is not None or self.tokens is not None

    def corpus_spec(self) -> CorpusSpec | None:
        """The declared corpus with this params' ``tokenizer`` (what :meth:`Decoder.corpus_of` returns), or None."""
        if self.corpus is None:
            return None
        return self.corpus.model_copy(update={"tokenizer": self.tokenizer}) if self.tokenizer else self.corpus


_STORES: dict[str, Datastore] = {}


def corpus_datastore(corpus: Corpus) -> Datastore:
    """The datastore of the injected ``corpus`` (built on first use, then cached for the process by its key).

    Raises:
        DtbenchError: the corpus holds no tokens, or pydivsufsort is not installed.
    """
    if corpus.key not in _STORES:
        _STORES[corpus.key] = Datastore.from_documents([list(d) for d in corpus.documents])
    return _STORES[corpus.key]


def tokens_datastore(path: str) -> Datastore:
    """The datastore of a ``.npy`` file of token ids (-1 separates documents), cached for the process by path.

    Raises:
        DtbenchError: an unreadable tokens file, or one holding no tokens.
    """
    key = "tokens:" + str(Path(path).expanduser().resolve())
    if key in _STORES:
        return _STORES[key]
    start = time.perf_counter()
    try:
        flat = np.load(Path(path).expanduser(), allow_pickle=False).astype(np.int64).ravel()
    except (OSError, ValueError) as exc:
        raise DtbenchError(f"rest: cannot read tokens file {path}: {exc}") from None
    cuts = np.flatnonzero(flat < 0)
    docs = [d.tolist() for d in np.split(flat, cuts) if len(d)]
    docs = [[t for t in d if t >= 0] for d in docs]
    store = Datastore.from_documents(docs)
    store.build_s = time.perf_counter() - start
    _STORES[key] = store
    return store
