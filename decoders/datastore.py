"""A retrieval datastore: token ids of a corpus and their suffix array (REST section 3.1), shared by ``rest`` and
``suffix``'s optional corpus, and the params that declare where its text comes from.

Its text is a declared corpus (:class:`~dtbench.core.CorpusSpec`): the harness loads the documents, leaves out the
suite's prompt documents by the one selection rule and the suite's seed, tokenizes them and hands them to the decoder
(:meth:`~dtbench.decoders.base.Decoder.use_corpus`); or a ``.npy`` file of token ids (``tokens:``), read here
(:func:`read_tokens`: a regular ``.npy`` file of at most :data:`MAX_TOKENS_FILE_BYTES`, a non-empty array of integers,
-1 between documents and no other negative id; checked by ``dtbench validate`` through the decoders'
``check_files``, memory-mapped, and kept in numpy: :meth:`Datastore.from_flat`). Every token id must be below the
target's vocabulary size (:func:`check_vocabulary`: a tokens file when the models load, before any sample; an
injected corpus when it is handed over), so a bad id is one line instead of an IndexError mid-generation.
The suffix array comes from ``pydivsufsort`` (maintained PyPI bindings of Yuta Mori's libdivsufsort, C,
O(n log n); it sorts integer arrays, so token ids need no byte encoding), the binary search from numpy. A datastore
is built once per process per corpus (its :attr:`~dtbench.core.Corpus.key`) or tokens file, then cached.
"""

from __future__ import annotations

import bisect
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
from pydantic import Field, model_validator

from dtbench.core import Corpus, CorpusSpec, DtbenchError, clip
from dtbench.decoders.base import Decoder, DecoderParams

SEPARATOR = np.iinfo(np.uint32).max  # between documents: never a token id, so no match or draft crosses it
MAX_TOKENS_FILE_BYTES = (
    256 << 20
)  # a tokens file, bounded like one dataset file (harness.suites.bounds.MAX_DOCUMENT_BYTES)


@dataclass
class Datastore:
    """Token ids of a corpus and their suffix array (REST section 3.1).

    Attributes:
        tokens: (n,) uint32 token ids, documents separated by :data:`SEPARATOR`.
        sa: (n,) suffix array of ``tokens`` (``tokens[sa[i]:]`` sorted lexicographically): int32 below 2^31 tokens
            (pydivsufsort's own output, 4 bytes a token), int64 above.
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
        parts: list[np.ndarray] = []
        for d in docs:
            parts.extend((np.asarray(d, dtype=np.uint32), np.array([SEPARATOR], dtype=np.uint32)))
        tokens = np.concatenate(parts)
        sa = np.asarray(divsufsort(tokens))  # int32 below 2^31 tokens (no int64 copy), else int64
        return cls(tokens, sa, len(docs), time.perf_counter() - start)

    @classmethod
    def from_flat(cls, flat: np.ndarray) -> Datastore:
        """Build from one array of token ids with -1 between documents (a tokens file), in numpy throughout: the
        same datastore as :meth:`from_documents` of its non-empty documents (4 bytes a token, not a Python int's 28
        and a list slot's 8).

        Args:
            flat: (n,) integer token ids >= 0, -1 separating documents (:func:`read_tokens`).

        Raises:
            DtbenchError: no token, or pydivsufsort not installed.
        """
        start = time.perf_counter()
        sep = np.asarray(flat) < 0
        if sep.all():
            raise DtbenchError("rest: the corpus holds no tokens")
        # a separator is kept only right after a token (empty documents vanish), and the last document gets one
        keep = ~sep
        keep[1:] |= sep[1:] & ~sep[:-1]
        tokens = np.asarray(flat)[keep].astype(np.uint32)  # 4 bytes a token; the kept -1s set just below
        tokens[sep[keep]] = SEPARATOR
        if tokens[-1] != SEPARATOR:
            tokens = np.append(tokens, np.uint32(SEPARATOR))
        try:
            from pydivsufsort import divsufsort
        except ImportError:
            raise DtbenchError("rest: the datastore needs pydivsufsort (pip install pydivsufsort)") from None
        sa = np.asarray(divsufsort(tokens))  # int32 below 2^31 tokens (no int64 copy), else int64
        return cls(tokens, sa, int((tokens == SEPARATOR).sum()), time.perf_counter() - start)

    @property
    def max_token(self) -> int:
        """The largest token id held (-1 for none)."""
        ids = self.tokens[self.tokens != SEPARATOR]
        return int(ids.max()) if len(ids) else -1

    @property
    def nbytes(self) -> int:
        """Bytes held: the tokens and the suffix array."""
        return int(self.tokens.nbytes + self.sa.nbytes)

    def _key(self, i: int, m: int) -> list[int]:
        p = int(self.sa[i])
        return cast(list[int], self.tokens[p : p + m].tolist())

    def find(self, pattern: list[int]) -> tuple[int, int]:
        """The suffix-array range [lo, hi) of the suffixes starting with ``pattern`` (binary search, O(m log n))."""
        m = len(pattern)
        lo = bisect.bisect_left(range(len(self.sa)), pattern, key=lambda i: self._key(i, m))
        hi = bisect.bisect_right(range(lo, len(self.sa)), pattern, key=lambda i: self._key(i, m)) + lo
        return lo, hi

    def retrieve(
        self, context: list[int], max_suffix: int, min_suffix: int, max_retrieved: int, depth: int
    ) -> tuple[int, np.ndarray]:
        """Continuations of the longest context suffix found (REST's exact-match retrieval, longest first).

        Returns:
            (suffix length matched, (R, depth) int64 continuations, -1 past a document's end); (0, empty) when no
            suffix of ``min_suffix`` tokens or more occurs.
        """
        for s in range(min(max_suffix, len(context)), min_suffix - 1, -1):
            lo, hi = self.find(context[-s:])
            if hi > lo:
                starts = self.sa[lo : min(hi, lo + max_retrieved)] + s
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

    corpus: CorpusSpec | None = Field(
        None,
        description="the datastore's text: a dataset entry (held out from the suite's prompts with the suite's seed)",
    )
    tokens: str | None = Field(None, description="or a .npy file of token ids (-1 separates documents)")
    tokenizer: str | None = Field(None, description="tokenizer for corpus (default: the target's name_or_path)")

    @model_validator(mode="before")
    @classmethod
    def _no_own_seed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "seed" in data:
            raise ValueError(
                "seed: the corpus is held out with the suite's seed (the order its prompts are drawn "
                "in); remove `seed:` from the decoder's params"
            )
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


def read_tokens(path: str) -> np.ndarray:
    """The token ids of a ``tokens:`` file, memory-mapped (nothing is copied until used).

    Args:
        path: a ``.npy`` file (``numpy.save`` of an integer array; -1 separates documents).

    Returns:
        (n,) integer array (the file's own integer dtype), n >= 1.

    Raises:
        DtbenchError: not a ``.npy`` file, not a regular file, larger than :data:`MAX_TOKENS_FILE_BYTES`,
            unreadable, an object/float/bool/empty array, a negative id other than -1, or an id that cannot be a
            datastore token (>= 2^32 - 1). One line naming the file.
    """
    where = f"tokens file {clip(path, 200)}"
    file = Path(path).expanduser()
    if file.suffix.lower() != ".npy":
        raise DtbenchError(f"{where}: not a .npy file (numpy.save of an integer array; -1 separates documents)")
    try:
        info = os.stat(file)
    except OSError as exc:
        raise DtbenchError(f"cannot read {where}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise DtbenchError(f"{where} is not a regular file (a device, pipe or folder)")
    if info.st_size > MAX_TOKENS_FILE_BYTES:
        raise DtbenchError(f"{where} is larger than {MAX_TOKENS_FILE_BYTES:,} bytes (the limit for a tokens file)")
    try:
        with open(file, "rb") as f:  # the header first: the dtype is known before any data is mapped
            major, _ = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            dtype = header(f)[2]
        if dtype.kind not in "iu":
            raise DtbenchError(
                f"{where} holds {dtype.name} values, not integer token ids"
                + (" (a float array is not truncated)" if dtype.kind == "f" else "")
            )
        array = np.load(file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DtbenchError(f"cannot read {where}: {clip(exc, 160)}") from None
    flat: np.ndarray = array.reshape(-1)
    if flat.size == 0:
        raise DtbenchError(f"{where} is empty (no token ids)")
    low, high = int(flat.min()), int(flat.max())
    if low < -1:
        raise DtbenchError(f"{where} holds the negative id {low}; only -1 (between documents) may be negative")
    if high >= SEPARATOR:
        raise DtbenchError(f"{where} holds the id {high}, too large for a token id (at most {SEPARATOR - 1})")
    if high < 0:
        raise DtbenchError(f"{where} holds only document separators (-1), no token ids")
    return flat


def check_tokens_file(params: CorpusParams) -> None:
    """``check_files`` of the decoders with a :class:`CorpusParams`: their ``tokens:`` file is a valid one
    (:func:`read_tokens`); nothing to check for a corpus (the harness checks its dataset entry).

    Raises:
        DtbenchError: as :func:`read_tokens`.
    """
    if params.tokens is not None:
        read_tokens(params.tokens)


def vocabulary_size(target: Any) -> int:
    """The target's vocabulary size: its LM head's rows (the ids it can score), else ``config.vocab_size``."""
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(target.config.vocab_size)


def check_vocabulary(store: Datastore, target: Any, where: str) -> None:
    """Every token of ``store`` is an id of ``target``'s vocabulary (a draft of it must be scoreable).

    Raises:
        ValueError: the largest id and the vocabulary size, naming ``where`` (one line).
    """
    vocab = vocabulary_size(target)
    if store.max_token >= vocab:
        raise ValueError(
            f"{where} holds token id {store.max_token}, outside the target's vocabulary (0..{vocab - 1}); "
            f"was it tokenized with another tokenizer?"
        )


def tokens_datastore(path: str) -> Datastore:
    """The datastore of a ``.npy`` file of token ids (-1 separates documents), cached for the process by path.

    Raises:
        DtbenchError: as :func:`read_tokens`, or a file holding no tokens.
    """
    key = "tokens:" + str(Path(path).expanduser().resolve())
    if key in _STORES:
        return _STORES[key]
    start = time.perf_counter()
    store = Datastore.from_flat(read_tokens(path))
    store.build_s = time.perf_counter() - start
    _STORES[key] = store
    return store


CP = TypeVar("CP", bound=CorpusParams)


class CorpusDecoder(Decoder[CP]):
    """Base of the decoders whose params are a :class:`CorpusParams` (``rest``, ``suffix``): the corpus they declare,
    the datastore built from the documents the harness injects, and the checks of a ``tokens:`` file.

    Subclasses set ``self.store`` in ``__init__`` (``tokens_datastore`` of a tokens file, else None until
    :meth:`use_corpus`) and implement ``generate``.
    """

    store: Datastore | None = None

    @classmethod
    def corpus_of(cls, params: CP) -> CorpusSpec | None:
        """The declared corpus (``corpus:`` with ``tokenizer:``), or None (no corpus, or a tokens file)."""
        return params.corpus_spec()

    def use_corpus(self, corpus: Corpus) -> None:
        """Build (or take from the process's cache) the datastore of the injected corpus.

        Raises:
            ValueError: a token id outside the target's vocabulary (a corpus tokenized with another tokenizer).
        """
        super().use_corpus(corpus)
        self.store = corpus_datastore(corpus)
        check_vocabulary(self.store, self.target, "the corpus")

    @classmethod
    def check_files(cls, params: CP) -> None:
        """``dtbench validate`` and the run's preflight: the ``tokens:`` file is a valid one (before any model loads).

        Raises:
            DtbenchError: see :func:`read_tokens`.
        """
        check_tokens_file(params)

    @classmethod
    def check_target(cls, params: CP, target: Any) -> None:
        """When the models are loaded, before any sample: the ``tokens:`` file's ids are in the target's vocabulary.

        Raises:
            ValueError: an id outside it (one line); DtbenchError: an unreadable tokens file.
        """
        if params.tokens is not None:
            check_vocabulary(tokens_datastore(params.tokens), target, f"tokens file {params.tokens}")
