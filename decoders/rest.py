"""REST: retrieval-based speculative decoding (He et al. 2024, "REST: Retrieval-Based Speculative Decoding").

A datastore of token ids built from a text corpus is indexed with a suffix array; at each step the longest
suffix of the context (``max_suffix`` tokens down to ``min_suffix``) found in the datastore retrieves the
continuations of its occurrences, whose prefixes form a trie weighted by frequency; the ``n_max`` most frequent
trie nodes (a parent is never less frequent than its child, so they form a tree), cut as the reference cuts them
(``prune: reference``, :func:`cut_to_choices`), are verified as one token tree by the one tree loop
(:func:`~dtbench.decoders.tree.speculate_tree` with a feature-free :class:`~dtbench.decoders.tree.TreeDrafter`):
greedy, lossless. No draft model, no training.

Reference read: FasterDecoding/REST at commit 50a5fc1. ``rest/model/utils.py``
(``generate_candidates_and_draft_buffer``: ``max_num_draft=64``; the context suffixes ``token_spans`` = 16 down to
2, longest first, stopping at the first that occurs; the pending token is the tree's root and the last token of the
searched context) and ``DraftRetriever/src/lib.rs`` (``search``: the first ``k`` = 5000 occurrences of the suffix
in suffix-array order, continuations of ``long`` = 10 tokens, every prefix counted; a heap keeps the ``choices`` =
64 most frequent prefixes; ``cut_to_choices`` then drops the chosen prefixes with the most distinct tokens first
until the sum of their distinct-token counts is at most 64, and the tree is every prefix of the rest
(``get_draft_choices``)). Where dtbench differs, on purpose: ties at the heap's and the cut's thresholds are broken
deterministically (shallower, then more frequent first; the reference's follow a hash map's random order); documents
are separated in the datastore, so no match or continuation crosses from one document into the next (the
reference concatenates them); and a step whose context matches nowhere verifies the root alone (the reference
drafts the fixed token id 100 there, a placeholder almost never accepted). ``prune: frequency`` verifies the
``n_max`` most frequent nodes without the cut (a larger tree; its own name, measured beside the reference's).

The datastore (:mod:`dtbench.decoders.datastore`: the suffix array, built once per process per corpus and cached) is
built from a declared corpus whose documents the harness injects, the suite's prompt documents held out with the
suite's seed, or from a ``.npy`` tokens file; its size, token count and build time are the decoder's recorded state
(:meth:`Rest.state_stats`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from dtbench.core import DtbenchError
from dtbench.decoders.base import Step
from dtbench.decoders.datastore import CorpusDecoder, CorpusParams, Datastore, tokens_datastore
from dtbench.decoders.tree import TreeDrafter, speculate_tree
from dtbench.decoders.tree.structure import TokenTree


def frequent_trie(cont: np.ndarray, n_max: int) -> list[tuple[tuple[int, ...], int]]:
    """The ``n_max`` most frequent prefixes of the continuations, as (prefix, count) in BFS order (REST's pruned
    trie). Ties prefer shallower nodes, so every chosen prefix's parent is chosen too.

    Args:
        cont: (R, D) int64 continuations, -1 after a continuation's end.
    """
    nodes: list[tuple[int, int, tuple[int, ...]]] = []
    for d in range(1, cont.shape[1] + 1):
        rows = cont[cont[:, d - 1] >= 0, :d]
        if not len(rows):
            break
        uniq, counts = np.unique(rows, axis=0, return_counts=True)
        nodes.extend((-int(c), d, tuple(u.tolist())) for u, c in zip(uniq, counts))
    chosen = sorted(nodes)[:n_max]
    return [(prefix, -neg) for neg, _, prefix in sorted(chosen, key=lambda x: (x[1], x[0], x[2]))]


def cut_to_choices(trie: list[tuple[tuple[int, ...], int]], n_max: int) -> list[tuple[tuple[int, ...], int]]:
    """REST's cut of the chosen prefixes (``cut_to_choices`` and ``get_draft_choices`` in FasterDecoding/REST's
    ``DraftRetriever/src/lib.rs``): the prefixes with the most distinct tokens go first, until the sum of the
    survivors' distinct-token counts is at most ``n_max``; the tree is every prefix of the survivors.

    A depth-10 chain whose ten prefixes are all chosen already counts 1 + 2 + ... + 10 = 55, so the tree verified is
    usually well below ``n_max`` nodes and shallower than :func:`frequent_trie`'s.

    Args:
        trie: :func:`frequent_trie`'s (prefix, count) list (closed under prefixes).
        n_max: the reference's ``choices`` (64).

    Returns:
        The kept (prefix, count) pairs in :func:`frequent_trie`'s BFS order. Ties (equal distinct-token counts) drop
        the less frequent prefix, then the deeper one, first.
    """
    distinct = [len(set(t)) for t, _ in trie]
    total = sum(distinct)
    order = sorted(range(len(trie)), key=lambda i: (-distinct[i], trie[i][1], -len(trie[i][0]), trie[i][0]))
    dropped = set()
    for i in order:
        if total <= n_max:
            break
        total -= distinct[i]
        dropped.add(i)
    survivors = [t for i, (t, _) in enumerate(trie) if i not in dropped]
    keep = {t[:d] for t in survivors for d in range(1, len(t) + 1)}
    return [(t, c) for t, c in trie if t in keep]


class RestDrafter(TreeDrafter):
    """Drafts REST's retrieval tree below the pending token; needs no target features (``hidden_layers = ()``)."""

    hidden_layers = ()

    def __init__(self, store: Datastore, prompt: list[int], params: RestParams):
        self.store, self.p = store, params
        self.context = list(prompt)
        self.max_breadth = self.n_max = params.n_max
        self.depth_limit = params.depth
        self.retrievals = {"steps": 0, "matched": 0, "suffix_tokens": 0}
        self._started = False

    def feed_logits(self, tree: TokenTree, logits: torch.Tensor, side_logits) -> None:
        if not self._started:  # the first tree's root: the prefill's token, the context's last
            self.context.append(int(tree.tokens[0]))
            self._started = True

    def observe(self, step: Step) -> None:
        self.context.extend(step.tokens)  # accepted drafts and the bonus token (the next root)

    def draft(self, tree: TokenTree, root: int, depth_cap: int) -> None:
        p = self.p
        self.retrievals["steps"] += 1
        s, cont = self.store.retrieve(
            self.context, p.max_suffix, p.min_suffix, p.max_retrieved, min(p.depth, depth_cap)
        )
        if not s:
            return
        self.retrievals["matched"] += 1
        self.retrievals["suffix_tokens"] += s
        trie = frequent_trie(cont, min(p.n_max, tree.budget_left))
        if p.prune == "reference":
            trie = cut_to_choices(trie, min(p.n_max, tree.budget_left))
        total = float(len(cont))
        index: dict[tuple[int, ...], int] = {(): 0}
        for d in range(1, max((len(t) for t, _ in trie), default=0) + 1):
            level = [(t, c) for t, c in trie if len(t) == d]
            parents = torch.tensor([index[t[:-1]] for t, _ in level], device=tree.device)
            logp = torch.log(torch.tensor([c / total for _, c in level], device=tree.device))
            new = tree.add(
                parents,
                torch.tensor([t[-1] for t, _ in level], device=tree.device),
                logp - tree.cum_logp[parents],
                logp,
                d,
            )
            index.update(zip((t for t, _ in level), new))


class RestParams(CorpusParams):
    """Hyperparameters of ``rest`` (the corpus fields: :class:`CorpusParams`; exactly one of corpus, tokens).

    Attributes:
        n_max: the most frequent trie nodes chosen per step (REST's ``num_draft`` / ``choices``, 64).
        prune: ``reference``: those nodes cut as REST cuts them (:func:`cut_to_choices`; the sum of the kept
            prefixes' distinct-token counts at most ``n_max``); ``frequency``: all ``n_max`` verified.
        depth: longest retrieved continuation (drafted tokens on a path; REST's ``long``, 10).
        max_suffix, min_suffix: the context suffix lengths searched, longest first (REST's ``token_spans``: 16 down
            to 2).
        max_retrieved: occurrences whose continuations build the trie (REST's ``k``, 5000).
    """

    n_max: int = Field(64, ge=1, le=1024, description="trie nodes chosen per step (REST num_draft)")
    prune: Literal["reference", "frequency"] = Field(
        "reference", description="reference: REST's cut_to_choices of the chosen nodes; frequency: verify all n_max"
    )
    depth: int = Field(10, ge=1, le=64, description="longest retrieved continuation (tokens)")
    max_suffix: int = Field(16, ge=1, le=256, description="longest context suffix searched (tokens)")
    min_suffix: int = Field(2, ge=1, le=256, description="shortest context suffix searched (tokens)")
    max_retrieved: int = Field(5000, ge=1, le=1_000_000, description="occurrences used to build the trie")

    @model_validator(mode="after")
    def _one_source(self):
        if not self.has_corpus:
            raise ValueError("rest: give exactly one of `corpus` (a dataset entry) and `tokens` (a .npy file)")
        if self.min_suffix > self.max_suffix:
            raise ValueError(f"min_suffix ({self.min_suffix}) must not exceed max_suffix ({self.max_suffix})")
        return self


class Rest(CorpusDecoder[RestParams]):
    """REST on the one tree loop: retrieval tree from a suffix-array datastore, greedy verification; lossless.

    Capabilities: family ``tree``; verify sizes (0 chain tokens, root + n_max masked); no sampling (the tree
    loop's drafter path verifies greedily; a suite that samples is refused at validation).
    """

    Params = RestParams
    family = "tree"
    needs_draft = False
    lossless = True
    supports_sampling = False
    version = "2"  # 2: REST's cut_to_choices (prune: reference) and min_suffix 2 by default, as the reference

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """A datastore of the context's token file (its prompt and random tokens)."""
        return [{"tokens": ctx.token_file()}]

    def __init__(self, target, draft, params: RestParams):
        super().__init__(target, None, params)
        self.store: Datastore | None = tokens_datastore(params.tokens) if params.tokens is not None else None
        self._drafter: RestDrafter | None = None

    @classmethod
    def verify_sizes(cls, params: RestParams) -> tuple[int, int]:
        """(chain tokens, masked tokens) of one verification: (0, root + n_max trie nodes)."""
        return 0, params.n_max + 1

    def state_stats(self) -> dict[str, int] | None:
        """The datastore (tokens, documents, bytes, build milliseconds) and the last call's retrievals (steps that
        searched, steps that found a match, matched suffix tokens summed)."""
        s = self.store
        if s is None:
            return None
        info = {
            "datastore_tokens": int(len(s.tokens)),
            "datastore_documents": s.documents,
            "datastore_bytes": s.nbytes,
            "datastore_build_ms": round(s.build_s * 1000),
        }
        if self._drafter is not None:
            info.update({f"retrieval_{k}": v for k, v in self._drafter.retrievals.items()})
        return info

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Generate ``max_new_tokens`` tokens greedily; one Step per target forward (the tree loop's)."""
        if self.store is None:
            raise DtbenchError(
                "rest: no datastore: the corpus's documents were never given (the harness calls "
                "use_corpus; a direct caller passes the documents with use_corpus(Corpus(...)))"
            )
        self._drafter = RestDrafter(self.store, input_ids[0].tolist(), self.params)
        yield from speculate_tree(
            self.target,
            None,
            input_ids,
            max_new_tokens,
            self._drafter,
            "compact",
            tree_root="pending",
            eos_token_id=self.eos_token_id,
        )
