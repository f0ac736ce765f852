"""One loop for every chain speculative decoder: :func:`speculate_chain` + a :class:`Proposer` per method.

``linear`` (a draft model), ``streaming_spec`` (a draft model over StreamingLLM caches) and the prompt-lookup
example plugin differ only in where draft tokens come from and how the target's cache is kept; the outer loop
(prefill, propose, verify greedily, roll back, commit) is this module's, once, as ``speculate_tree`` is for trees.

The contract for third parties: subclass :class:`Proposer` (``begin``, ``propose``, ``accept``) and, when the
target's cache is not a plain ``DynamicCache``, :class:`ChainTarget`; then ``generate`` is one line:
``yield from speculate_chain(KVTarget(self.target), MyProposer(...), input_ids, max_new_tokens, k)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

from typing import cast

import torch

from dtbench.decoders import kv
from dtbench.decoders.base import Step, cut_at_eos, eos_ids, greedy_token, next_token, verify_chain
from dtbench.decoders.sampling import SamplingSettings, sample, verify_chain_sampled


class Proposer(ABC):
    """Proposes draft chains continuing the committed text (the public proposer interface).

    The committed text always ends with the *pending* token: the newest committed token, which the target has
    not been fed yet and which is the first input of the next verification.

    When the decoder samples, :func:`speculate_chain` sets ``sampling`` and ``generator`` before ``begin``; a
    proposer that draws its drafts at random records the distribution of each in ``draft_probs`` (shape (vocab,)
    each); a deterministic one leaves it None (verification then treats each draft as drawn with probability 1).
    """

    sampling = None  # SamplingSettings | None, set by speculate_chain
    generator: torch.Generator | None = None
    draft_probs: list[torch.Tensor] | None = None

    def begin(self, prompt: list[int], pending: int) -> None:
        """Called once after the prefill: the prompt's token ids and the first committed (pending) token."""

    @abstractmethod
    def propose(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft token ids continuing the committed text (fewer, or none, is allowed).

        ``max_tokens`` is already capped so that the drafts plus the bonus token never pass T (it may be 0).
        """

    def accept(self, drafts: list[int], accepted: int, committed: tuple[int, ...]) -> None:
        """The verification's result: the first ``accepted`` drafts were committed, then the target's bonus token
        ``committed[-1]``, which becomes the new pending token."""


class ChainTarget(ABC):
    """The target model's side of a chain verification: its cache and how a rejected tail is rolled back."""

    @abstractmethod
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed the prompt, shape (1, prompt_len) int64; return the last position's logits, shape (vocab,)."""

    @abstractmethod
    def verify(self, tokens: list[int]) -> torch.Tensor:
        """Feed ``[pending, *drafts]`` in one forward; logits of shape (len(tokens), vocab), row i predicting the
        token after input i."""

    @abstractmethod
    def keep(self, n: int) -> None:
        """Keep the first ``n`` tokens of the last ``verify`` (pending + accepted drafts), drop the rest."""


class KVTarget(ChainTarget):
    """A target over a transformers ``DynamicCache``: rejected drafts sit at the cache's tail, a crop drops them."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache = kv.new_cache()
        self._prefix = 0

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.cache, logits = kv.prefill(self.model, input_ids)
        return cast(torch.Tensor, logits)

    def verify(self, tokens: list[int]) -> torch.Tensor:
        self._prefix = kv.cache_len(self.cache)
        return cast(torch.Tensor, kv.forward(self.model, tokens, self.cache))  # no hidden_layers: logits only

    def keep(self, n: int) -> None:
        kv.crop(self.cache, self._prefix + n)


class DraftModelProposer(Proposer):
    """Greedy drafts from a draft model with its own ``DynamicCache`` (Leviathan et al. 2023).

    Invariant between iterations: the draft cache holds every committed token except ``backlog`` (the pending
    token, and the last draft when all drafts were accepted, since it was never fed); rejected drafts sit at the
    cache's tail, so a crop rolls them back. One draft forward per drafted token, the first feeding the backlog.
    """

    def __init__(self, draft: torch.nn.Module):
        self.draft = draft

    def begin(self, prompt: list[int], pending: int) -> None:
        self.cache = kv.new_cache()
        self.backlog = [*prompt, pending]
        self.context = len(prompt)  # committed tokens before the pending one

    def forward(self, feed: list[int], exact: bool) -> torch.Tensor:
        """Feed tokens to the draft; logits of the last one, shape (vocab,). ``exact``: committed tokens."""
        return kv.forward(self.draft, feed, self.cache, last_only=True)[-1]

    def rollback(self, length: int) -> None:
        """Drop the draft cache's entries beyond ``length`` tokens."""
        kv.crop(self.cache, length)

    def cached(self) -> int:
        return kv.cache_len(self.cache)

    def propose(self, max_tokens: int) -> list[int]:
        drafts: list[int] = []
        self.draft_probs = [] if self.sampling is not None else None
        feed, exact = self.backlog, True
        for _ in range(max_tokens):
            logits = self.forward(feed, exact)
            if self.sampling is None:
                drafts.append(greedy_token(logits))
            else:
                q = self.sampling.probs(logits)
                self.draft_probs.append(q)
                drafts.append(sample(q, self.generator))
            feed, exact = [drafts[-1]], False
        return drafts

    def accept(self, drafts: list[int], accepted: int, committed: tuple[int, ...]) -> None:
        self.rollback(min(self.cached(), self.context + 1 + accepted))
        if drafts:
            self.backlog = ([drafts[-1]] if accepted == len(drafts) else []) + [committed[-1]]
        else:  # nothing was fed this round
            self.backlog = [*self.backlog, committed[-1]]
        self.context += len(committed)


def speculate_chain(target: ChainTarget, proposer: Proposer, input_ids: torch.Tensor, max_new_tokens: int,
                    k: int, sampling: SamplingSettings | None = None, generator: torch.Generator | None = None,
                    eos_token_id: int | tuple[int, ...] | None = None) -> Iterator[Step]:
    """Chain speculative decoding (Leviathan et al. 2023; paper section 4.3): greedy verification, or speculative
    sampling (:func:`~dtbench.decoders.sampling.verify_chain_sampled`) when ``sampling`` is given.

    Each iteration proposes at most ``min(k, T - produced - 1)`` drafts (so with the bonus token it never
    commits past T), verifies ``[pending, *drafts]`` in one target forward, keeps the longest matching prefix
    plus the target's bonus token and rolls both sides back.

    Args:
        target: the target's cache policy (:class:`KVTarget` for a plain cache).
        proposer: where drafts come from.
        input_ids: prompt ids, shape (1, prompt_len), int64, on the target's device.
        max_new_tokens: T (>= 1).
        k: the largest draft chain per iteration (K).
        sampling, generator: :class:`~dtbench.decoders.sampling.SamplingSettings` and the sample's generator; None
            for greedy decoding (bit-identical to the greedy-only loop).
        eos_token_id: the decoder's ``eos_token_id``: when set, generation ends with the first EOS committed, even
            inside the accepted drafts (:func:`~dtbench.decoders.base.cut_at_eos`); None: EOS is ignored.

    Yields:
        The prefill's token as the first Step (TTFT); then one Step per verification with tokens = accepted
        drafts + bonus, drafted = depth = drafts proposed, accepted = drafts committed (the last Step cut after EOS).
    """
    proposer.sampling, proposer.generator = sampling, generator  # type: ignore[assignment]
    eos = eos_ids(eos_token_id)
    pending = next_token(target.prefill(input_ids), sampling, generator)
    yield Step(tokens=(pending,))
    if pending in eos:
        return
    proposer.begin(input_ids[0].tolist(), pending)
    produced = 1
    while produced < max_new_tokens:
        drafts = list(proposer.propose(min(k, max_new_tokens - produced - 1)))
        logits = target.verify([pending, *drafts])
        if sampling is None:
            accepted, committed = verify_chain(drafts, logits)
        else:
            accepted, committed = verify_chain_sampled(drafts, proposer.draft_probs if drafts else None,
                                                       sampling.probs(logits), generator)
        target.keep(1 + accepted)
        proposer.accept(drafts, accepted, committed)
        pending = committed[-1]
        produced += len(committed)
        n = len(drafts)
        step, ended = cut_at_eos(Step(tokens=committed, drafted=n, accepted=accepted, depth=n), eos)
        yield step
        if ended:
            return
