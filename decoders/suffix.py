"""Suffix-automaton drafting (SAM-Decoding, Hu et al. 2024; SuffixDecoding, Oliaro et al. 2024): no training.

A suffix automaton over the committed text (prompt + output) is extended online, one token at a time, in amortised
O(1) (Blumer et al. 1985). After each extension the suffix link of the automaton's last state is the state of the
longest suffix of the text that occurs earlier too, and that state's first end position says where: the tokens
that followed that earlier occurrence are the draft (a chain). When the match is shorter than ``min_match`` tokens
the step falls back to the draft model's greedy chain (``fallback: draft``, SAM-Decoding's combination with an
auxiliary drafter) or drafts nothing (``fallback: none``). Verification is the one chain loop's
(:func:`~dtbench.decoders.chain.speculate_chain`), greedy or by speculative sampling; lossless either way.

References read (from memory of the public code): SAM-Decoding's ``samd/sam.py`` (dynamic automaton over the
generated text: ``add_tokens``, ``transfer``, and the draft copied after the matched state's end position) and
SuffixDecoding's per-request suffix tree (its frequency-weighted tree drafts are not built here: this is the chain
form; see the closing note of issue 22).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, Literal

import torch
from pydantic import Field

from dtbench.core import DtbenchError
from dtbench.decoders.base import Step
from dtbench.decoders.chain import DraftModelProposer, KVTarget, Proposer, decoder_rows, speculate_chain
from dtbench.decoders.datastore import CorpusDecoder, CorpusParams, Datastore, tokens_datastore


class SuffixAutomaton:
    """The suffix automaton (DAWG) of a growing token sequence, built online (Blumer et al. 1985).

    States are integers; state 0 is the initial state. Per state: ``length`` (the longest string it accepts),
    ``link`` (suffix link, -1 for state 0), ``next`` (token -> state) and ``first_end`` (the end index, in the
    sequence, of the first occurrence of its strings). At most 2n - 1 states and 3n - 4 transitions for n tokens.

    Attributes:
        tokens: the sequence so far (list of ints).
        last: the state of the whole sequence.
    """

    def __init__(self, tokens: list[int] | tuple[int, ...] = ()):
        self.tokens: list[int] = []
        self.length = [0]
        self.link = [-1]
        self.next: list[dict[int, int]] = [{}]
        self.first_end = [-1]
        self.last = 0
        self.extend(tokens)

    def _new_state(self, length: int, link: int, nxt: dict[int, int], first_end: int) -> int:
        self.length.append(length)
        self.link.append(link)
        self.next.append(nxt)
        self.first_end.append(first_end)
        return len(self.length) - 1

    def append(self, token: int) -> None:
        """Extend the automaton by one token (the standard online construction; amortised O(1))."""
        pos = len(self.tokens)
        self.tokens.append(token)
        cur = self._new_state(self.length[self.last] + 1, -1, {}, pos)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = self._new_state(self.length[p] + 1, self.link[q], dict(self.next[q]), self.first_end[q])
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def extend(self, tokens) -> None:
        """Append every token of ``tokens`` in order."""
        for t in tokens:
            self.append(int(t))

    def repeated_suffix(self) -> tuple[int, int]:
        """The longest suffix of the sequence that also occurs ending earlier, in O(1).

        Returns:
            (n, start): its length and the index of the token that followed its first occurrence
            (``start < len(tokens)``); (0, 0) when no suffix recurs (the empty suffix).
        """
        v = self.link[self.last] if self.last else 0
        if v <= 0:
            return 0, 0
        return self.length[v], self.first_end[v] + 1

    def state(self) -> dict[str, int]:
        """Size of the automaton: states, transitions and bytes (``sys.getsizeof`` of its lists and dicts)."""
        size = sum(sys.getsizeof(x) for x in (self.tokens, self.length, self.link, self.first_end, self.next))
        size += sum(sys.getsizeof(d) for d in self.next)
        return {
            "automaton_states": len(self.length),
            "automaton_transitions": sum(len(d) for d in self.next),
            "automaton_bytes": size,
        }


class SuffixProposer(Proposer):
    """Chain drafts from :class:`SuffixAutomaton` over the committed text, else from the fallback proposer.

    ``fallback`` (a :class:`DraftModelProposer`, or None) drafts when the match is shorter than ``min_match``. It
    sees every committed token: when the automaton drafted, the fallback's cache is left as it was and all the
    committed tokens join its backlog (fed with its next draft forward).
    """

    def __init__(
        self,
        min_match: int,
        fallback: DraftModelProposer | None,
        store: Datastore | None = None,
        max_corpus_match: int = 16,
    ):
        self.min_match = min_match
        self.fallback = fallback
        self.store, self.max_corpus_match = store, max_corpus_match
        self.counts = {"automaton": 0, "corpus": 0, "fallback": 0}
        self._from_fallback = False

    def begin(self, prompt: list[int], pending: int) -> None:
        self.sam = SuffixAutomaton([*prompt, pending])
        if self.fallback is not None:
            self.fallback.sampling, self.fallback.generator = self.sampling, self.generator
            self.fallback.begin(prompt, pending)

    def propose(self, max_tokens: int) -> list[int] | torch.Tensor:
        self.draft_probs, self._from_fallback = None, False
        if max_tokens <= 0:
            return []
        n, start = self.sam.repeated_suffix()
        if self.store is not None and n < self.max_corpus_match:  # the corpus, when its match is longer
            m, cont = self.store.retrieve(
                self.sam.tokens, self.max_corpus_match, max(n + 1, self.min_match), 1, max_tokens
            )
            drafts = [t for t in cont[0].tolist() if t >= 0] if m else []
            if drafts:
                self.counts["corpus"] += 1
                return drafts
        if n >= self.min_match:
            self.counts["automaton"] += 1
            return self.sam.tokens[start : start + max_tokens]
        if self.fallback is None:
            return []
        self.counts["fallback"] += 1
        self._from_fallback = True
        chain = self.fallback.propose(max_tokens)  # a draft model's chain: device-resident (issue 46)
        self.draft_probs = self.fallback.draft_probs
        return chain

    def accept(self, drafts: list[int], accepted: int, committed: tuple[int, ...]) -> None:
        self.sam.extend(committed)
        fb = self.fallback
        if fb is None:
            return
        if self._from_fallback:
            fb.accept(drafts, accepted, committed)
        else:  # nothing fed to the draft model this step: the committed tokens wait in its backlog
            fb.backlog = [*fb.backlog, *committed]
            fb.context += len(committed)


class SuffixParams(CorpusParams):
    """Hyperparameters of ``suffix`` (the optional corpus: :class:`~dtbench.decoders.datastore.CorpusParams`).

    Attributes:
        k: most draft tokens per iteration (the automaton's continuation or the fallback's chain).
        min_match: shortest match (tokens) whose continuation is drafted; shorter matches fall back. Our default
            (2), not a published one: a one-token match is too weak a signal on natural text.
        fallback: ``none`` (draft nothing on a short match) or ``draft`` (the draft model's greedy chain of k
            tokens, SAM-Decoding's auxiliary drafter).
        corpus, tokens, tokenizer: an optional static corpus (SAM-Decoding's static automaton; here REST's
            suffix-array datastore, :class:`~dtbench.decoders.datastore.Datastore`): when the context's suffix of up to
            ``max_corpus_match`` tokens matches the corpus longer than it matches the context, the continuation of
            its first occurrence there (by suffix-array order) is the draft.
        max_corpus_match: longest context suffix searched in the corpus (tokens).
    """

    k: int = Field(8, ge=1, le=128, description="most draft tokens per iteration")
    min_match: int = Field(2, ge=1, le=256, description="shortest automaton match drafted from (tokens)")
    fallback: Literal["none", "draft"] = Field(
        "none", description="on a short match: 'none' or 'draft' (the draft model's chain)"
    )
    max_corpus_match: int = Field(16, ge=1, le=256, description="longest context suffix searched in the corpus")


class SuffixDecoding(CorpusDecoder[SuffixParams]):
    """Suffix-automaton speculative decoding on the one chain loop; lossless (greedy and sampled).

    Capabilities: family ``chain``; verify sizes (k + 1 chain tokens, 0 masked); sampling: automaton drafts are
    deterministic, fallback drafts are sampled from the draft model, and speculative sampling is exact for both.
    ``needs_draft`` is True because the runner decides per class whether to load the draft model; with
    ``fallback: none`` it is never run.
    """

    Params = SuffixParams
    family = "chain"
    compiles = True
    needs_draft = True
    lossless = True
    supports_sampling = True
    batching = True
    batch_sampling = True
    version = "1"

    @classmethod
    def host_reads_bound(cls, params: SuffixParams, step: Step) -> int | None:
        """One read per iteration, the prefill's included (issue 46 item 1: the committed tokens come back in one
        read)."""
        return 1

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """Matches of one token and up, and the draft model as the fallback proposer."""
        return [{"k": 3, "min_match": 1}, {"k": 3, "fallback": "draft"}]

    def __init__(self, target, draft, params: SuffixParams):
        """Bind the models; the draft model is required only with ``fallback: draft``.

        Raises:
            ValueError: ``fallback: draft`` without a draft model.
        """
        if params.fallback == "draft" and draft is None:
            raise ValueError("suffix: fallback 'draft' needs a draft model, and the suite declares none")
        self.target, self.draft, self.params = target, draft if params.fallback == "draft" else None, params
        self.store: Datastore | None = tokens_datastore(params.tokens) if params.tokens is not None else None

    def _fallback(self) -> DraftModelProposer | None:
        """A proposer over the draft model with ``fallback: draft`` (``__init__`` made sure there is one), else None."""
        if self.params.fallback != "draft":
            return None
        assert self.draft is not None
        return DraftModelProposer(self.draft, max_feed=self.params.k + 1)  # within compiled_sizes (issue 59 item 6)

    @classmethod
    def verify_sizes(cls, params: SuffixParams) -> tuple[int, int]:
        """(chain tokens, masked tokens) of one verification: the pending token and up to k drafts."""
        return params.k + 1, 0

    @classmethod
    def compiled_sizes(cls, params: SuffixParams) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        """Target: every chain length up to k + 1. Draft: with ``fallback: draft`` every size up to k + 1 (its cache
        catches up on what the automaton drafted in pieces of at most k + 1 tokens: ``max_feed``), none without (the
        draft model is never run)."""
        return None, (None if params.fallback == "draft" else ())

    def state_stats(self) -> dict[str, int] | None:
        """The last generate() call's automaton size and how many steps each source drafted; None before one."""
        proposer = getattr(self, "_proposer", None)
        if proposer is None or not hasattr(proposer, "sam"):  # T = 1: the prefill only, nothing proposed (issue 56)
            return None
        info = {**proposer.sam.state(), **{f"{k}_draft_steps": v for k, v in proposer.counts.items()}}
        if self.store is not None:
            info.update(datastore_tokens=int(len(self.store.tokens)), datastore_bytes=self.store.nbytes)
        return info

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Generate ``max_new_tokens`` tokens (greedy, or sampled with ``self.sampling``); one Step per target
        forward (the chain loop's)."""
        p = self.params
        if p.corpus is not None and self.store is None:
            raise DtbenchError(
                "suffix: no datastore: the corpus's documents were never given (the harness calls use_corpus)"
            )
        self._proposer = SuffixProposer(p.min_match, self._fallback(), self.store, p.max_corpus_match)
        yield from speculate_chain(
            KVTarget(self.target),
            self._proposer,
            input_ids,
            max_new_tokens,
            p.k,
            self.sampling,
            self.generator,
            eos_token_id=self.eos_token_id,
        )

    @torch.inference_mode()
    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int) -> Iterator[dict[int, Step]]:
        """B prompts through the one chain loop, one suffix-automaton proposer per row (each over its own row's
        text; the corpus datastore, if any, is shared read-only)."""
        p = self.params
        if p.corpus is not None and self.store is None:
            raise DtbenchError(
                "suffix: no datastore: the corpus's documents were never given (the harness calls use_corpus)"
            )
        proposers = [
            SuffixProposer(
                p.min_match,
                self._fallback(),
                self.store,
                p.max_corpus_match,
            )
            for _ in prompts
        ]
        self._proposer = proposers[-1]
        yield from decoder_rows(self, proposers, prompts, max_new_tokens, p.k)
