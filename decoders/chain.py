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
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from dtbench.core import DtbenchError
from dtbench.decoders import kv
from dtbench.decoders.base import (
    Step,
    cut_at_eos,
    eos_ids,
    first_tokens,
    greedy_token,
    verify_chain_read,
)
from dtbench.decoders.roles import drafting
from dtbench.decoders.sampling import SamplingSettings, sample, verify_chain_sampled
from dtbench.decoders.static_kv import StaticKV


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
    def propose(self, max_tokens: int) -> list[int] | torch.Tensor:
        """Up to ``max_tokens`` draft token ids continuing the committed text (fewer, or none, is allowed).

        A list of ints, or (device-resident drafts, issue 46) a 1-D int64 tensor on the target's device, which the
        loop verifies without reading it first: the iteration's one device-to-host read then returns the drafts with
        the target's verdict (:func:`~dtbench.decoders.base.verify_chain_read`), and :meth:`accept` gets them as a
        list. ``max_tokens`` is already capped so that the drafts plus the bonus token never pass T (it may be 0).
        """

    def accept(self, drafts: list[int], accepted: int, committed: tuple[int, ...]) -> None:
        """The verification's result: the first ``accepted`` drafts were committed, then the target's bonus token
        ``committed[-1]``, which becomes the new pending token."""


class NoDrafts(Proposer):
    """Proposes nothing: the chain loop then verifies only the pending token, i.e. autoregressive decoding."""

    def propose(self, max_tokens: int) -> list[int]:
        return []


class ChainTarget(ABC):
    """The target model's side of a chain verification: its cache and how a rejected tail is rolled back."""

    @abstractmethod
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed the prompt, shape (1, prompt_len) int64; return the last position's logits, shape (vocab,)."""

    @abstractmethod
    def verify(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """Feed ``[pending, *drafts]`` in one forward (a list, or a (1, n) int64 tensor on the device when the
        drafts are device-resident); logits of shape (n, vocab), row i predicting the token after input i."""

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
        return logits

    def verify(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        self._prefix = kv.cache_len(self.cache)
        return kv.forward(self.model, tokens, self.cache)  # no hidden_layers: logits only

    def keep(self, n: int) -> None:
        kv.crop(self.cache, self._prefix + n)


# New tokens a DraftModelProposer feeds its draft model in one forward after the prefill: the backlog (the pending
# token, after a full acceptance the last draft too) or one draft. What compiled execution compiles for its draft.
DRAFT_FEEDS: tuple[int, ...] = (1, 2)


class DraftModelProposer(Proposer):
    """Greedy drafts from a draft model with its own ``DynamicCache`` (Leviathan et al. 2023).

    Invariant between iterations: the draft cache holds every committed token except ``backlog`` (the pending
    token, and the last draft when all drafts were accepted, since it was never fed); rejected drafts sit at the
    cache's tail, so a crop rolls them back. One draft forward per drafted token, the first feeding the backlog.

    Greedy drafts stay on the device (``resident``, issue 46): each draft forward's argmax is fed to the next one as
    a tensor and :meth:`propose` returns the chain as one tensor, so K drafts cost no device-to-host read; a subclass
    whose :meth:`forward` needs host token ids sets ``resident = False``.

    Args:
        draft: the draft model.
        fused: in compiled execution, a chain of exactly this many greedy drafts runs as ONE compiled region
            (:func:`~dtbench.decoders.draft_region.draft_chain`, issue 46 item 2; ``linear``'s ``fused_draft``);
            0 (the default), or eager execution, or a shorter chain: one forward per draft.
        max_feed: in compiled execution, the most backlog tokens one catch-up forward feeds (a longer backlog is fed
            in pieces of this size, the last piece with the first draft forward), so the draft runs only the buckets
            its decoder's ``compiled_sizes`` declares; None (the default): the whole backlog in one forward, as
            eager execution always does. A proposer whose backlog can outgrow 2 tokens sets it (``suffix``'s
            fallback: the committed tokens of the steps the automaton drafted wait in the backlog; issue 59 item 6,
            found by the kit's B = 3 leg: a backlog of 17+ tokens ran bucket 32 and compiled inside the sample).
    """

    resident: ClassVar[bool] = True

    def __init__(self, draft: torch.nn.Module, fused: int = 0, max_feed: int | None = None):
        self.draft = draft
        self.fused = fused
        self.max_feed = max_feed

    def begin(self, prompt: list[int], pending: int) -> None:
        self.cache = kv.new_cache()
        self.backlog = [*prompt, pending]
        self.context = len(prompt)  # committed tokens before the pending one

    def forward(self, feed: list[int] | torch.Tensor, exact: bool) -> torch.Tensor:
        """Feed tokens to the draft (a list, or a (1, n) int64 tensor on its device); logits of the last one, shape
        (vocab,). ``exact``: committed tokens."""
        return kv.forward(self.draft, feed, self.cache, last_only=True)[-1]

    def rollback(self, length: int) -> None:
        """Drop the draft cache's entries beyond ``length`` tokens."""
        kv.crop(self.cache, length)

    def cached(self) -> int:
        return kv.cache_len(self.cache)

    def catch_up(self) -> None:
        """Compiled execution with ``max_feed``: feed the backlog's head in pieces of ``max_feed`` tokens until at
        most ``max_feed`` are left (fed with the first draft forward). Eager execution, or no ``max_feed``: nothing
        (one forward takes the whole backlog)."""
        cache = getattr(self, "cache", None)
        if self.max_feed is None or not isinstance(cache, StaticKV) or cache.length == 0:
            return
        while len(self.backlog) > self.max_feed:
            self.forward(self.backlog[: self.max_feed], True)
            self.backlog = self.backlog[self.max_feed :]

    def propose(self, max_tokens: int) -> list[int] | torch.Tensor:
        if max_tokens > 0:
            self.catch_up()
        if self.sampling is None and self.resident:
            return self._propose_resident(max_tokens)
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

    def _propose_resident(self, max_tokens: int) -> list[int] | torch.Tensor:
        """Greedy drafts without a read: each argmax, shape (1, 1) int64 on the device, is the next forward's input;
        the chain is returned as one (K,) tensor (``[]`` for K = 0)."""
        self.draft_probs = None
        static = self._fusable() if max_tokens and max_tokens == self.fused else None
        if static is not None:
            from dtbench.decoders import draft_region

            return draft_region.draft_chain(static, self.draft, self.backlog, max_tokens)
        chain: list[torch.Tensor] = []
        feed: list[int] | torch.Tensor = self.backlog
        for _ in range(max_tokens):
            logits = self.forward(feed, len(chain) == 0)
            feed = torch.argmax(logits, dim=-1).view(1, 1)
            chain.append(feed)
        return torch.cat(chain, dim=1).view(-1) if chain else []

    def _fusable(self) -> StaticKV | None:
        """The draft's static cache when this iteration's drafts can run as one compiled region (compiled execution,
        the cache prefilled, a backlog of 1 or 2 ids, this class's own cache operations: a subclass's are kept),
        else None."""
        cls = type(self)
        own = cls.forward is DraftModelProposer.forward and cls.rollback is DraftModelProposer.rollback
        cache = getattr(self, "cache", None)
        if own and isinstance(cache, StaticKV) and cache.length > 0 and len(self.backlog) in DRAFT_FEEDS:
            return cache
        return None

    def accept(self, drafts: list[int], accepted: int, committed: tuple[int, ...]) -> None:
        self.rollback(min(self.cached(), self.context + 1 + accepted))
        if drafts:
            self.backlog = ([drafts[-1]] if accepted == len(drafts) else []) + [committed[-1]]
        else:  # nothing was fed this round
            self.backlog = [*self.backlog, committed[-1]]
        self.context += len(committed)


class RowsTarget(ABC):
    """The target's side of a verification over one or several rows (sequences decoded together).

    :func:`speculate_chain_rows` talks to this; :class:`OneRow` wraps a :class:`ChainTarget` (batch 1, the plain
    cache operations unchanged), :class:`RaggedRows` a :class:`~dtbench.decoders.kv.RaggedBatch` (batch B).
    """

    @abstractmethod
    def prefill(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Feed each row's prompt, shape (1, prompt_len) int64; each row's last-position logits, (vocab,)."""

    @abstractmethod
    def verify(self, rows: list[list[int] | torch.Tensor]) -> list[torch.Tensor]:
        """Feed each active row its ``[pending, *drafts]`` (one forward); per row logits (len(tokens), vocab)."""

    @abstractmethod
    def keep(self, counts: list[int]) -> None:
        """Row i keeps the first ``counts[i]`` tokens of its last verification (pending + accepted drafts)."""

    def retain(self, rows: list[int]) -> None:
        """Only these rows (indices into the active rows) stay in the batch: finished rows stop costing work."""


def _read_all(drafts: list[list[int] | torch.Tensor]) -> list[list[int] | torch.Tensor]:
    """The rows' drafts as host lists, the device-resident ones read together in one read."""
    resident = [d for d in drafts if torch.is_tensor(d)]
    if not resident:
        return drafts
    flat = torch.cat([d.view(-1) for d in resident]).tolist()
    out: list[list[int] | torch.Tensor] = []
    at = 0
    for d in drafts:
        if torch.is_tensor(d):
            n = int(d.shape[0])
            out.append(flat[at : at + n])
            at += n
        else:
            out.append(d)
    return out


def _verify_input(pending: int, drafts: list[int] | torch.Tensor) -> list[int] | torch.Tensor:
    """``[pending, *drafts]``: a list, or with device-resident drafts a (1, K + 1) tensor on their device (the
    pending id copied to the device, not read from it)."""
    if torch.is_tensor(drafts):
        return torch.cat([drafts.new_tensor([pending]), drafts]).view(1, -1)
    return [pending, *drafts]


class OneRow(RowsTarget):
    """One row over a :class:`ChainTarget`: exactly the batch-1 cache operations (no masks, no padding)."""

    def __init__(self, target: ChainTarget):
        self.target = target

    def prefill(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.target.prefill(prompts[0])]

    def verify(self, rows: list[list[int] | torch.Tensor]) -> list[torch.Tensor]:
        return [self.target.verify(rows[0])]

    def keep(self, counts: list[int]) -> None:
        self.target.keep(counts[0])


class RaggedRows(RowsTarget):
    """B rows over one :class:`~dtbench.decoders.kv.RaggedBatch`: causal per row, ragged drafts and acceptance."""

    def __init__(self, model: torch.nn.Module):
        self.batch = kv.RaggedBatch(model)

    def prefill(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.batch.prefill([p[0].tolist() for p in prompts])

    def verify(self, rows: list[list[int] | torch.Tensor]) -> list[torch.Tensor]:
        ids = [r if isinstance(r, list) else r.view(-1).tolist() for r in rows]  # the loop reads them first (_read_all)
        logits = self.batch.forward(ids)
        return [logits[r, : len(t)] for r, t in enumerate(ids)]

    def keep(self, counts: list[int]) -> None:
        self.batch.keep([list(range(c)) for c in counts])

    def retain(self, rows: list[int]) -> None:
        self.batch.retain(rows)


def _proposed(proposer: Proposer, max_tokens: int) -> list[int] | torch.Tensor:
    """``proposer.propose(max_tokens)`` as a list, held to its contract: at most ``max_tokens`` drafts.

    Refused, not clipped (issue 42 item 10): a proposer that returns more than asked has a bug, and clipping would
    hide it while its timing still pays for drafting the extra tokens; every chain loop (:func:`speculate_chain`,
    :func:`speculate_chain_batch`, :func:`speculate_chain_rows`) calls the proposer only through here.

    Raises:
        DtbenchError: more drafts than ``max_tokens`` (the cell fails with this one line).
    """
    with drafting():  # its forwards are draft forwards, whatever model it runs (issue 68 item 2)
        proposed = proposer.propose(max_tokens)
    drafts = proposed.view(-1) if torch.is_tensor(proposed) else list(proposed)
    count = int(drafts.shape[0]) if torch.is_tensor(drafts) else len(drafts)  # a tensor's length: no read
    if count > max_tokens:
        raise DtbenchError(
            f"proposer {type(proposer).__name__} returned {count} drafts when asked for at most {max_tokens} "
            "(Proposer.propose must return at most max_tokens)"
        )
    return drafts


def speculate_chain(
    target: ChainTarget,
    proposer: Proposer,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    k: int,
    sampling: SamplingSettings | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | tuple[int, ...] | None = None,
) -> Iterator[Step]:
    """Chain speculative decoding of one prompt (Leviathan et al. 2023; paper section 4.3): greedy verification, or
    speculative sampling (:func:`~dtbench.decoders.sampling.verify_chain_sampled`) when ``sampling`` is given.

    The one chain loop (:func:`speculate_chain_rows`) with a single row on ``target`` (:class:`OneRow`): each
    iteration proposes at most ``min(k, T - produced - 1)`` drafts (so with the bonus token it never commits past
    T), verifies ``[pending, *drafts]`` in one target forward, keeps the longest matching prefix plus the target's
    bonus token and rolls both sides back.

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
    for steps in speculate_chain_rows(
        OneRow(target), [proposer], [input_ids], max_new_tokens, k, sampling, generator, eos_token_id
    ):
        yield steps[0]


def speculate_chain_batch(
    model: torch.nn.Module,
    proposers: Sequence[Proposer],
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    k: int,
    eos_token_id: int | tuple[int, ...] | None = None,
    *,
    sampling: SamplingSettings | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[dict[int, Step]]:
    """Chain speculation of B prompts together (batch size B = ``len(prompts)``): the one chain loop over a
    :class:`RaggedRows` target, one proposer per row; greedy, or with ``sampling`` each row verified by speculative
    sampling (Leviathan et al. 2023, Algorithm 1), every row drawing from the one ``generator`` (rows are
    independent draws). Yields as :func:`speculate_chain_rows`."""
    yield from speculate_chain_rows(
        RaggedRows(model), proposers, prompts, max_new_tokens, k, sampling, generator, eos_token_id
    )


def decoder_rows(
    decoder: Any, proposers: Sequence[Proposer], prompts: list[torch.Tensor], max_new_tokens: int, k: int
) -> Iterator[dict[int, Step]]:
    """A chain decoder's ``generate_batch``: :func:`speculate_chain_batch` of ``decoder``'s target, EOS, sampling
    settings and generator (``batch_sampling``) over ``prompts`` (each ``(1, L_i)`` int64), one proposer per row,
    at most ``k`` drafts per row and iteration. Yields as :func:`speculate_chain_rows`."""
    return speculate_chain_batch(
        decoder.target,
        proposers,
        prompts,
        max_new_tokens,
        k,
        decoder.eos_token_id,
        sampling=decoder.sampling,
        generator=decoder.generator,
    )


def speculate_chain_rows(
    target: RowsTarget,
    proposers: Sequence[Proposer],
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    k: int,
    sampling: SamplingSettings | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | tuple[int, ...] | None = None,
) -> Iterator[dict[int, Step]]:
    """The one chain loop (prefill, propose, verify, roll back, commit) over B rows decoded together.

    Each row has its own prompt length, its own proposer (a proposer serves one row) and its own acceptance: every
    iteration, each active row proposes up to ``min(k, T - produced - 1)`` drafts, all rows' ``[pending, *drafts]``
    are verified in ONE target forward (ragged: per-row lengths, masks and positions in :class:`RaggedRows`), and
    each row keeps exactly its own accepted prefix plus its bonus token. A row that reached T or committed an EOS
    leaves the batch (:meth:`RowsTarget.retain`), so it costs no further verification. With one row this is
    batch-1 chain speculation, step for step.

    Args:
        target: the rows' target (:class:`OneRow` or :class:`RaggedRows`).
        proposers: one fresh proposer per row.
        prompts: per row the prompt ids, shape (1, prompt_len_r), int64, on the target's device.
        max_new_tokens, k, sampling, generator, eos_token_id: as :func:`speculate_chain` (sampling: the rows share
            the generator, each row an independent draw).

    Yields:
        Per iteration a dict {row index: Step} of the rows that committed in it (the first: every row's prefill
        token, the TTFT); a row's Steps are those of :func:`speculate_chain` on that row alone.
    """
    for proposer in proposers:
        proposer.sampling, proposer.generator = sampling, generator  # type: ignore[assignment]
    eos = eos_ids(eos_token_id)
    first = target.prefill(prompts)
    texts, pending = first_tokens(prompts, first, sampling, generator)
    yield {r: Step(tokens=(t,)) for r, t in enumerate(pending)}
    active = [r for r, t in enumerate(pending) if t not in eos]
    for r in active:
        proposers[r].begin(texts[r], pending[r])
    produced = [1] * len(prompts)
    live = [r for r in active if produced[r] < max_new_tokens]
    if len(live) < len(prompts):
        target.retain([i for i, r in enumerate(range(len(prompts))) if r in live])
    active = live
    while active:
        drafts = [_proposed(proposers[r], min(k, max_new_tokens - produced[r] - 1)) for r in active]
        if not isinstance(target, OneRow):  # a ragged batch takes host ids: every row's drafts in one read
            drafts = _read_all(drafts)
        logits = target.verify([_verify_input(pending[r], d) for r, d in zip(active, drafts)])
        out, counts, stay = {}, [], []
        for i, (r, d, lg) in enumerate(zip(active, drafts, logits)):
            if sampling is None:
                accepted, committed, d = verify_chain_read(d, lg)  # the iteration's one read (B = 1)
            else:
                d = d.tolist() if torch.is_tensor(d) else d  # sampled drafts: read (their probabilities are host-side)
                accepted, committed = verify_chain_sampled(
                    d, proposers[r].draft_probs if d else None, sampling.probs(lg), generator
                )
            counts.append(1 + accepted)
            proposers[r].accept(d, accepted, committed)
            pending[r] = committed[-1]
            produced[r] += len(committed)
            n = len(d)
            out[r], ended = cut_at_eos(Step(tokens=committed, drafted=n, accepted=accepted, depth=n), eos)
            if not ended and produced[r] < max_new_tokens:
                stay.append(i)
        target.keep(counts)
        yield out
        if len(stay) < len(active):
            target.retain(stay)
            active = [active[i] for i in stay]
