"""Documents -> prompts and corpora: the one seeded document order, deterministic prompt selection with the prompt
cap, and the held-out corpora decoders declare (split from :mod:`dtbench.harness.data.datasets`, which owns the datasets).

Held-out prompts: a dataset entry's ``skip: K`` leaves out the first K usable documents of the seeded order,
so with the same seed and tokenizer its prompts come from other documents than those of any entry with
``prompts <= K`` (how ``suites/dynatree-tuning.yaml`` tunes on documents the benchmarks never use); a declared corpus
leaves out its ``skip`` by the same rule (:func:`held_out_documents`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable

from dtbench.core import Corpus, CorpusSpec
from dtbench.harness.data.datasets import check_dataset, is_chat, load_documents
from dtbench.harness.data.prompt import Prompt
from dtbench.harness.errors import DtbenchError
from dtbench.harness.suites.suite import DatasetSpec

MIN_PROMPT_TOKENS = 16


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
