"""The one tree loop (the DynaTree paper's Algorithm 1; module docstring of :mod:`dtbench.decoders.tree`): draft a
tree, verify it in one target forward under the tree attention mask, commit the accepted path and the bonus token,
keep the caches by index; at B = 1 (:func:`speculate_tree`) and over ragged batches (:func:`speculate_tree_batch`),
greedy, sampled (SpecInfer's multi-draft rule) or typical acceptance. Every tree decoder runs this loop."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from dtbench.decoders import kv, modelinfo
from dtbench.decoders.base import Step, cut_at_eos, eos_ids, first_tokens, next_token
from dtbench.decoders.roles import drafting
from dtbench.decoders.sampling import SamplingSettings
from dtbench.decoders.tree.draft import (
    DraftSession,
    ExpansionPolicy,
    TreeDrafter,
    TreeSampling,
    check_draft_options,
    draft_tree,
)
from dtbench.decoders.tree.resident import Resident, ResidentDraft, check_resident, draft_tree_resident
from dtbench.decoders.tree.structure import (
    CacheStrategy,
    DraftStrategy,
    Prune,
    TokenTree,
    TreeRoot,
    attention_mask_kind,
    root_offset,
    tree_capacity,
    tree_node_bound,
)
from dtbench.decoders.tree.verify import (  # noqa: F401  (tree_logits, tree_predictions: re-exported)
    tree_logits,
    tree_predictions,
    update_target_cache,
    verify_batched,
    verify_row,
)


def speculate_tree(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    policy: ExpansionPolicy | TreeDrafter,
    cache_strategy: CacheStrategy = "compact",
    draft_strategy: DraftStrategy = "per_level",
    *,
    tree_root: TreeRoot = "paper",
    prune: Prune = "leaf",
    sampling=None,
    generator: torch.Generator | None = None,
    eos_token_id: int | tuple[int, ...] | None = None,
    resident: Resident = "off",
) -> Iterator[Step]:
    """Tree speculative decoding: the loop every tree decoder runs (Algorithm 1, repeated), greedy or sampled.

    Invariant between iterations: the target cache holds every committed token except the newest
    (``pending``, the next tree's root); the draft session holds them minus its backlog. Each iteration:
    draft a tree below ``pending`` (:func:`draft_tree`; the path length capped so no more than the remaining
    tokens are drafted) ->
    one target forward over the tree with the tree mask -> :func:`select_path` -> update the target cache
    (``compact``: ``kv.keep_positions`` the root and the path by index; ``rebuild``: crop to the prefix and re-run
    [root, path], a second target forward) -> keep the path in the draft cache -> ``policy.observe``.

    Args:
        target, draft: causal LMs sharing a vocabulary; attention implementation sdpa or eager.
        input_ids: (1, prompt_len) int64 prompt.
        max_new_tokens: T >= 1.
        policy: a fresh expansion policy (its state is this call's state), or a fresh :class:`TreeDrafter`
            (learned heads, training-free drafters: ``draft`` unused, may be None; under sampling its tree, a function
            of the context, is verified with deterministic children (q one-hot per child, SafeAILab/EAGLE's rule in
            :func:`~dtbench.decoders.sampling.verify_tree_sampled`); the tree is rooted at
            the pending token whatever ``tree_root`` says; the prefill and each verification forward also return
            the drafter's target features, which it receives through ``feed_target``; each verification forward
            also feeds its :meth:`~TreeDrafter.side_branch` and hands all its logits to ``feed_logits``).
        cache_strategy: "compact" (1 target forward per iteration) or "rebuild" (2, the paper's).
        draft_strategy: "per_level" or "per_node" (see :func:`draft_tree`).
        tree_root: "paper" (u0 rooted, Algorithm 1 line 10) or "pending" (module docstring).
        prune: "leaf" (Algorithm 1 lines 14-16) or "skip" (module docstring).
        sampling, generator: :class:`~dtbench.decoders.sampling.SamplingSettings` and the sample's generator; None
            for greedy decoding (unchanged, bit for bit). When sampling, children are drawn without replacement
            from the processed draft distribution (:class:`TreeSampling`) and the tree is verified by recursive
            rejection sampling (:func:`~dtbench.decoders.sampling.verify_tree_sampled`) instead of
            :func:`select_path`; the committed tokens then follow the target's processed distribution exactly.
        resident: "off", "draft" or "full": where drafting decides (:mod:`~dtbench.decoders.tree.resident`).
        eos_token_id: the decoder's ``eos_token_id``: when set, generation ends with the first EOS committed, even
            inside the accepted path (:func:`~dtbench.decoders.base.cut_at_eos`); None: EOS is ignored.

    Yields:
        First the prefill's token as a Step (TTFT); then one Step per iteration with tokens = committed path
        tokens + bonus, drafted = drafted nodes (u0 included), accepted = committed drafted tokens
        before the bonus (u0 counts when the target accepts it), depth = drafted tokens on the tree's longest
        path (paper root: the deepest node's paper depth + 1, u0 being depth 0; pending root: the deepest
        node's depth); the last Step is cut after EOS. The runner counts forwards: 1 target forward per iteration with compact, 2 with rebuild.

    Raises:
        ValueError: unknown strategy, tree_root or prune mode, ``prune="skip"`` with sampling, or a model
            whose attention implementation cannot take a tree mask.
    """
    for steps in speculate_tree_rows(
        target,
        draft,
        [input_ids],
        max_new_tokens,
        [policy],
        cache_strategy,
        draft_strategy,
        tree_root=tree_root,
        prune=prune,
        sampling=sampling,
        generator=generator,
        eos_token_id=eos_token_id,
        resident=resident,
    ):
        yield steps[0]


def speculate_tree_batch(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    policies: list[ExpansionPolicy],
    cache_strategy: CacheStrategy = "compact",
    draft_strategy: DraftStrategy = "per_level",
    *,
    tree_root: TreeRoot = "paper",
    prune: Prune = "leaf",
    eos_token_id: int | tuple[int, ...] | None = None,
) -> Iterator[dict[int, Step]]:
    """Greedy tree speculation of B prompts together (B = ``len(prompts)``): the one tree loop
    (:func:`speculate_tree_rows`) over a :class:`~dtbench.decoders.kv.RaggedBatch`, one expansion policy and one
    draft session per row; yields as :func:`speculate_tree_rows`."""
    yield from speculate_tree_rows(
        target,
        draft,
        prompts,
        max_new_tokens,
        policies,
        cache_strategy,
        draft_strategy,
        tree_root=tree_root,
        prune=prune,
        eos_token_id=eos_token_id,
        batched=True,
    )


def speculate_tree_rows(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    policies: Sequence[ExpansionPolicy | TreeDrafter],
    cache_strategy: CacheStrategy = "compact",
    draft_strategy: DraftStrategy = "per_level",
    *,
    tree_root: TreeRoot = "paper",
    prune: Prune = "leaf",
    sampling: SamplingSettings | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | tuple[int, ...] | None = None,
    batched: bool = False,
    resident: Resident = "off",
) -> Iterator[dict[int, Step]]:
    """The one tree loop (Algorithm 1, repeated) over B rows decoded together; see :func:`speculate_tree`.

    Each row drafts its own tree with its own policy and draft session (a drafter serves one row). ``batched=False``
    (one row): the target keeps a plain cache and every operation is the batch-1 one (:func:`tree_logits`,
    ``kv.keep_positions``), with drafters, side branches and sampling. ``batched=True`` (greedy expansion policies):
    the target is a :class:`~dtbench.decoders.kv.RaggedBatch` and every row's tree is verified in ONE target forward
    (per-row tree masks over per-row prefixes, per-row position ids); each row then keeps exactly its own accepted
    path (``compact``: its KV entries; ``rebuild``: a second batched forward over each row's [root, path]), and a row
    that reached T or committed an EOS leaves the batch, costing no further verification.

    ``resident`` (:mod:`~dtbench.decoders.tree.resident`): where drafting decides; same trees and tokens in every mode.

    Yields:
        Per iteration a dict {row index: Step} of the rows that committed in it (the first: every row's prefill
        token); a row's Steps are those :func:`speculate_tree` yields for that row alone.

    Raises:
        ValueError: as :func:`speculate_tree`; ``batched`` with a :class:`TreeDrafter` or with sampling; ``resident``
            other than "off" with a drafter, sampling, several rows, ``per_node`` drafting or an unknown mode.
    """
    drafter = policies[0] if isinstance(policies[0], TreeDrafter) else None
    _check_options(cache_strategy, draft_strategy, prune, drafter, sampling, batched, len(prompts), resident)
    offset = 0 if drafter else root_offset(tree_root)
    t_kind = attention_mask_kind(target)
    hidden = drafter.hidden_layers if drafter is not None and drafter.hidden_layers else None
    rows = range(len(prompts))
    ragged = kv.RaggedBatch(target) if batched else None
    t_cache, texts, pending, features = _prefill(target, prompts, ragged, hidden, sampling, generator)
    sessions: list[DraftSession] = []  # one per row when expansion policies draft with the draft model
    if drafter is None:
        assert draft is not None, "expansion policies draft with a draft model (the tree decoders need one)"
        sessions = [DraftSession(draft, text) for text in texts]
    if drafter is not None and features is not None:
        drafter.feed_target(features, texts[0][1:] + [pending[0]])
    yield {r: Step(tokens=(pending[r],)) for r in rows}
    eos = eos_ids(eos_token_id)
    produced = [1] * len(prompts)
    active = [r for r in rows if pending[r] not in eos and produced[r] < max_new_tokens]
    if ragged is not None:
        ragged.retain(active)
    while active:
        trees, drafts, drawn = {}, {}, None
        for r in active:
            depth_cap = min(policies[r].depth_limit + offset, max_new_tokens - produced[r] - 1)
            drawn = None if sampling is None else TreeSampling(sampling, generator)
            trees[r], drafts[r] = _draft_row(
                policies[r],
                pending[r],
                depth_cap,
                sessions[r] if sessions else None,
                modelinfo.device_of(target),
                draft_strategy,
                tree_root,
                prune,
                drawn,
                resident,
            )
        positions: dict[int, list[int] | None] = dict.fromkeys(active)
        if ragged is not None:
            chosen = verify_batched(ragged, trees, active, pending, cache_strategy)
        else:
            r = active[0]
            assert t_cache is not None  # a single row keeps a plain cache
            prefix_len = kv.cache_len(t_cache)
            path, committed, positions[r] = verify_row(
                target, t_cache, trees[r], t_kind, drafts[r], resident, drafter, hidden, sampling, drawn, generator
            )
            chosen = {r: (path, committed)}
            update_target_cache(target, t_cache, prefix_len, pending[r], *chosen[r], cache_strategy)
        out, stay = {}, []
        for i, r in enumerate(active):
            if drafter is None:
                sessions[r].commit(pending[r], *chosen[r], positions[r])
            out[r], ended = _commit(policies[r], trees[r], chosen[r][1], eos)
            pending[r] = chosen[r][1][-1]
            produced[r] += len(chosen[r][1])
            if not ended and produced[r] < max_new_tokens:
                stay.append(i)
        yield out
        if len(stay) < len(active):
            if ragged is not None:
                ragged.retain(stay)
            active = [active[i] for i in stay]


def _prefill(
    target: torch.nn.Module,
    prompts: list[torch.Tensor],
    ragged: kv.RaggedBatch | None,
    hidden: tuple[int, ...] | None,
    sampling: SamplingSettings | None,
    generator: torch.Generator | None,
) -> tuple[kv.KVCache | None, list[list[int]], list[int], torch.Tensor | None]:
    """Prefill every row (Algorithm 1's first target forward): (the target cache of a single row or None for a ragged
    batch, the prompts as host ids, each row's first token, a drafter's prefill features or None), in one read."""
    if ragged is not None:
        texts = [p[0].tolist() for p in prompts]  # a ragged prefill takes host ids: the prompts' one read
        first = ragged.prefill(texts)
        return None, texts, [next_token(logits.reshape(-1), sampling, generator) for logits in first], None
    features = None
    if hidden is None:
        cache, logits = kv.prefill(target, prompts[0])
    else:
        cache, logits, features = kv.prefill_features(target, prompts[0], hidden)
    texts, pending = first_tokens(prompts, [logits.reshape(-1)], sampling, generator)  # one read (issue 46)
    return cache, texts, pending, features


def _commit(
    policy: ExpansionPolicy | TreeDrafter, tree: TokenTree, committed: list[int], eos: frozenset[int]
) -> tuple[Step, bool]:
    """One row's Step for its committed tokens (Algorithm 1 line 6), fed back to its policy (line 7, ADJUST), cut
    after an EOS: (the Step, whether the row ended at an EOS)."""
    step = Step(tokens=tuple(committed), drafted=tree.n_drafted, accepted=len(committed) - 1, depth=tree.max_depth)
    policy.observe(step)
    return cut_at_eos(step, eos)


def _check_options(
    cache_strategy: str,
    draft_strategy: str,
    prune: str,
    drafter: TreeDrafter | None,
    sampling: SamplingSettings | None,
    batched: bool,
    rows: int,
    resident: str,
) -> None:
    """Validate :func:`speculate_tree_rows`'s options before any forward runs (its Raises)."""
    if cache_strategy not in ("compact", "rebuild"):
        raise ValueError(f"unknown cache strategy {cache_strategy!r}")
    check_draft_options(draft_strategy, prune, sampling is not None)
    if batched and (drafter is not None or sampling is not None):
        raise ValueError("batched tree decoding takes greedy expansion policies only (no tree drafter, no sampling)")
    if not batched and rows != 1:
        raise ValueError("several rows need batched=True")
    check_resident(resident, drafter is not None, sampling is not None, batched, draft_strategy)


def _draft_row(
    policy: ExpansionPolicy | TreeDrafter,
    pending: int,
    depth_cap: int,
    session: DraftSession | None,
    device: torch.device,
    draft_strategy: DraftStrategy,
    tree_root: TreeRoot,
    prune: Prune,
    drawn: TreeSampling | None,
    resident: Resident,
) -> tuple[TokenTree, ResidentDraft | None]:
    """Draft one row's tree below its pending token (Algorithm 1 line 3): by its :class:`TreeDrafter`, or by the
    draft model under its expansion policy (:func:`draft_tree`, or :func:`draft_tree_resident` when ``resident``);
    a ``depth_cap`` below 1 leaves the root alone. Returns (the tree, the resident draft or None)."""
    if resident == "off":
        capacity = tree_capacity(policy.max_breadth, depth_cap, policy.n_max)
    else:  # the exact bound: ``full`` verifies every slot
        first = 1 if tree_root == "paper" else policy.max_breadth
        capacity = tree_node_bound(first, policy.max_breadth, depth_cap, policy.n_max)
    tree = TokenTree(
        pending, policy.n_max, capacity, device if session is None else session.device, spare=int(resident != "off")
    )
    if depth_cap < 1:
        return tree, None
    with drafting():  # every forward of a tree's drafting is a draft forward, whatever model runs it (issue 68)
        if session is None:
            assert isinstance(policy, TreeDrafter), "a row without a draft session has a tree drafter"
            policy.draft(tree, pending, depth_cap)
            return tree, None
        assert isinstance(policy, ExpansionPolicy), "rows without a tree drafter have expansion policies"
        if resident != "off":
            return tree, draft_tree_resident(
                session, tree, pending, policy, depth_cap, tree_root=tree_root, prune=prune
            )
        draft_tree(
            session, tree, pending, policy, depth_cap, draft_strategy, tree_root=tree_root, prune=prune, sampling=drawn
        )
    return tree, None
