"""The public API for plugin authors: everything a third-party decoder, dataset or report format needs, and the only
dtbench module such a plugin should import (examples/dtbench-prompt-lookup imports nothing else; docs/plugins.md).

Names listed in ``__all__`` keep their meaning across minor versions; everything else in dtbench is internal and may
move. Importing this module imports torch (the decoder contract is torch's), unlike :mod:`dtbench.core`.

Decoders (entry-point group ``dtbench.decoders``): subclass :class:`Decoder` with a :class:`DecoderParams` model and
yield one :class:`Step` per target verification; reuse the one chain loop (:func:`speculate_chain` with a
:class:`Proposer`) or the one tree loop (:func:`speculate_tree` with a :class:`TreeDrafter`) rather than writing a
loop of your own. A decoder that retrieves from a corpus declares it (:class:`CorpusSpec`,
:meth:`Decoder.corpus_of`) and receives its documents (:class:`Corpus`, :meth:`Decoder.use_corpus`).

Datasets (entry-point group ``dtbench.datasets``): subclass :class:`Dataset` (its own suite keys a
:class:`DatasetParams`) and return (title, text) documents; prompt selection and the prompt cap are dtbench's.

Report formats (entry-point group ``dtbench.formats``): a function from a :class:`Document` (reports, each a
:class:`Report`) to text, registered under a ``--format`` name by its entry point (:func:`renderer` registers one in
the running process only, never under a built-in name).

Serving engines (entry-point group ``dtbench.engines``): the ``server`` decoder reads a server through the adapter
its ``engine:`` names; subclass :class:`OpenAICompatible` (or implement :class:`Engine`) and fill its hooks: request
fields, an event's own fields into a :class:`Chunk`, the speculation counters, a metrics endpoint, a schedule.
"""

from __future__ import annotations

from dtbench.core import Corpus, CorpusSpec, DtbenchError, StrictBools
from dtbench.decoders.base import (
    FAMILIES,
    Decoder,
    DecoderParams,
    Family,
    Step,
    cut_at_eos,
    eos_ids,
    greedy_token,
    next_token,
    verify_chain,
)
from dtbench.decoders.chain import (
    ChainTarget,
    DraftModelProposer,
    KVTarget,
    Proposer,
    speculate_chain,
    speculate_chain_batch,
)
from dtbench.decoders.engines import Chunk, Engine, OpenAICompatible
from dtbench.decoders.tree import (
    CacheStrategy,
    ExpansionPolicy,
    TokenTree,
    TreeDecoder,
    TreeDrafter,
    TreeParams,
    speculate_tree,
)
from dtbench.harness.data.datasets import Dataset, DatasetParams, Documents
from dtbench.harness.data.sources import HubSource
from dtbench.harness.suites.suite import DatasetSpec
from dtbench.reports.rendering.output import Document, Report, renderer

__all__ = [
    # errors and strict types
    "DtbenchError",
    "StrictBools",
    # the decoder contract
    "Decoder",
    "DecoderParams",
    "Step",
    "Family",
    "FAMILIES",
    "cut_at_eos",
    "eos_ids",
    "greedy_token",
    "next_token",
    "verify_chain",
    # corpora
    "CorpusSpec",
    "Corpus",
    # the one chain loop
    "speculate_chain",
    "speculate_chain_batch",  # B > 1 rows (a decoder declaring batching: generate_batch), one proposer per row
    "Proposer",
    "DraftModelProposer",
    "KVTarget",
    "ChainTarget",
    # the one tree loop and its toolkit
    "speculate_tree",
    "TreeDrafter",
    "TreeDecoder",
    "TreeParams",
    "ExpansionPolicy",
    "TokenTree",
    "CacheStrategy",
    # datasets
    "Dataset",
    "DatasetParams",
    "DatasetSpec",
    "Documents",
    "HubSource",
    # report formats
    "renderer",
    "Document",
    "Report",
    # serving engines (the server decoder's adapters)
    "Engine",
    "OpenAICompatible",
    "Chunk",
]
