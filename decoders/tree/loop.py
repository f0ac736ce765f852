"""The one tree loop (the DynaTree paper's Algorithm 1; module docstring of :mod:`dtbench.decoders.tree`): draft a
tree, verify it in one target forward under the tree attention mask, commit the accepted path and the bonus token,
keep the caches by index; at B = 1 (:func:`speculate_tree`) and over ragged batches (:func:`speculate_tree_batch`),
greedy, sampled (SpecInfer's multi-draft rule) or typical acceptance. Every tree decoder runs this loop."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import overload

import torch

from dtbench.decoders import kv, modelinfo
from dtbench.decoders.base import Step, cut_at_eos, eos_ids, first_tokens, next_token
from dtbench.decoders.sampling import SamplingSettings, verify_tree_sampled, verify_tree_typical
from dtbench.decoders.tree.draft import (
    DraftSession,
    ExpansionPolicy,
    TreeDrafter,
    TreeSampling,
    check_draft_options,
    draft_tree,
)
from dtbench.decoders.tree.structure import (
    CacheStrategy,
    DraftStrategy,
    MaskKind,
    Prune,
    SideBranch,
    TokenTree,
    TreeRoot,
    attention_mask_kind,
    root_offset,
    select_path,
    tree_attention_mask,
    tree_capacity,
    tree_position_ids,
    with_side_branch,
)


def tree_predictions(target: torch.nn.Module, cache: kv.KVCache, tree: TokenTree, kind: MaskKind) -> torch.Tensor:
    """One target forward over [root, drafted nodes] with the tree mask (Algorithm 1 line 4), greedy.

    Args:
        target: the target causal LM; ``cache`` holds the committed prefix without the root.
        tree: the drafted tree.
        kind: the target's mask format (:func:`attention_mask_kind`).

    Returns:
        (size,) int64 greedy predictions: entry u is argmax p_T(. | prefix, path to u); entry 0 is the
        paper's y_hat_{t+1} (argmax of the prefix logits s_last). The cache grows by ``size`` positions.
    """
    return torch.argmax(tree_logits(target, cache, tree, kind), dim=-1).to(tree.device)


@overload
def tree_logits(
    target: torch.nn.Module,
    cache: kv.KVCache,
    tree: TokenTree,
    kind: MaskKind,
    hidden_layers: None = None,
    side: SideBranch | None = None,
) -> torch.Tensor: ...


@overload
def tree_logits(
    target: torch.nn.Module,
    cache: kv.KVCache,
    tree: TokenTree,
    kind: MaskKind,
    hidden_layers: tuple[int, ...] | None = None,
    side: SideBranch | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def tree_logits(
    target: torch.nn.Module,
    cache: kv.KVCache,
    tree: TokenTree,
    kind: MaskKind,
    hidden_layers: tuple[int, ...] | None = None,
    side: SideBranch | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The target forward of :func:`tree_predictions`, returning its logits: (size, vocab) in the target's dtype,
    row u the target's logits of the token after the path to u. The cache grows by ``size`` positions.
    With ``hidden_layers`` (a :class:`TreeDrafter`'s), the pair (logits, features (size, F)) from the same forward
    (:func:`kv.forward`). With a ``side`` branch (m tokens, :class:`SideBranch`), its tokens are fed after the tree
    in the same forward (:func:`with_side_branch`): logits and features get m more rows and the cache m more
    positions, after the tree's."""
    n = tree.size
    prefix_len = kv.cache_len(cache)
    dev = modelinfo.device_of(target)
    tokens = tree.tokens[:n].to(dev)
    if side is None and n == 1:  # root only: a plain causal step
        return kv.forward(target, tokens.unsqueeze(0), cache, hidden_layers=hidden_layers)
    relation, depths = tree.ancestors().to(dev), tree.depths[:n].to(dev)
    if side is not None:
        relation = with_side_branch(relation, side)
        tokens = torch.cat([tokens, side.tokens.to(dev)])
        depths = torch.cat([depths, side.offsets.to(dev)])
    mask = tree_attention_mask(relation, prefix_len, kind, modelinfo.dtype_of(target))
    return kv.forward(
        target,
        tokens.unsqueeze(0),
        cache,
        position_ids=tree_position_ids(depths, prefix_len),
        attention_mask=mask,
        hidden_layers=hidden_layers,
    )


def _row_probs(sampling: SamplingSettings, rows: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """``u -> sampling.probs(rows[u])``: the target's processed distribution after the path to node u."""
    return lambda u: sampling.probs(rows[u])


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
) -> Iterator[dict[int, Step]]:
    """The one tree loop (Algorithm 1, repeated) over B rows decoded together; see :func:`speculate_tree`.

    Each row drafts its own tree with its own policy and draft session (a drafter serves one row). ``batched=False``
    (one row): the target keeps a plain cache and every operation is the batch-1 one (:func:`tree_logits`,
    ``kv.keep_positions``), with drafters, side branches and sampling. ``batched=True`` (greedy expansion policies):
    the target is a :class:`~dtbench.decoders.kv.RaggedBatch` and every row's tree is verified in ONE target forward
    (per-row tree masks over per-row prefixes, per-row position ids); each row then keeps exactly its own accepted
    path (``compact``: its KV entries; ``rebuild``: a second batched forward over each row's [root, path]), and a row
    that reached T or committed an EOS leaves the batch, costing no further verification.

    Yields:
        Per iteration a dict {row index: Step} of the rows that committed in it (the first: every row's prefill
        token); a row's Steps are those :func:`speculate_tree` yields for that row alone.

    Raises:
        ValueError: as :func:`speculate_tree`; ``batched`` with a :class:`TreeDrafter` or with sampling.
    """
    if cache_strategy not in ("compact", "rebuild"):
        raise ValueError(f"unknown cache strategy {cache_strategy!r}")
    check_draft_options(draft_strategy, prune, sampling is not None)
    drafter = policies[0] if isinstance(policies[0], TreeDrafter) else None
    if batched and (drafter is not None or sampling is not None):
        raise ValueError("batched tree decoding takes greedy expansion policies only (no tree drafter, no sampling)")
    if not batched and len(prompts) != 1:
        raise ValueError("several rows need batched=True")
    offset = 0 if drafter else root_offset(tree_root)
    t_kind = attention_mask_kind(target)
    hidden = drafter.hidden_layers if drafter is not None and drafter.hidden_layers else None
    rows = range(len(prompts))
    ragged = kv.RaggedBatch(target) if batched else None
    if ragged is not None:
        texts = [p[0].tolist() for p in prompts]  # a ragged prefill takes host ids: the prompts' one read
        first = ragged.prefill(texts)
        pending = [next_token(logits.reshape(-1), sampling, generator) for logits in first]
    else:
        if hidden is None:
            t_cache, logits = kv.prefill(target, prompts[0])
        else:
            t_cache, logits, features = kv.prefill_features(target, prompts[0], hidden)
        texts, pending = first_tokens(prompts, [logits.reshape(-1)], sampling, generator)  # one read (issue 46)
    sessions: list[DraftSession] = []  # one per row when expansion policies draft with the draft model
    if drafter is None:
        assert draft is not None, "expansion policies draft with a draft model (the tree decoders need one)"
        sessions = [DraftSession(draft, text) for text in texts]
    if drafter is not None and hidden is not None:
        drafter.feed_target(features, texts[0][1:] + [pending[0]])
    yield {r: Step(tokens=(pending[r],)) for r in rows}
    eos = eos_ids(eos_token_id)
    produced = [1] * len(prompts)
    active = [r for r in rows if pending[r] not in eos and produced[r] < max_new_tokens]
    if ragged is not None:
        ragged.retain(active)
    while active:
        trees, drawn = {}, None
        for r in active:
            policy = policies[r]
            depth_cap = min(policy.depth_limit + offset, max_new_tokens - produced[r] - 1)
            tree = TokenTree(
                pending[r],
                policy.n_max,
                tree_capacity(policy.max_breadth, depth_cap, policy.n_max),
                modelinfo.device_of(target) if drafter else sessions[r].device,
            )
            drawn = None if sampling is None else TreeSampling(sampling, generator)
            if depth_cap >= 1:
                if drafter is not None:
                    drafter.draft(tree, pending[r], depth_cap)
                else:
                    assert isinstance(policy, ExpansionPolicy), "rows without a tree drafter have expansion policies"
                    draft_tree(
                        sessions[r],
                        tree,
                        pending[r],
                        policy,
                        depth_cap,
                        draft_strategy,
                        tree_root=tree_root,
                        prune=prune,
                        sampling=drawn,
                    )
            trees[r] = tree
        chosen: dict[int, tuple[list[int], list[int]]] = {}
        if ragged is not None:
            logits = ragged.forward(
                [trees[r].tokens[: trees[r].size].tolist() for r in active],
                [trees[r].ancestors() if trees[r].size > 1 else None for r in active],
                [trees[r].depths[: trees[r].size] for r in active],
            )
            for i, r in enumerate(active):
                tree, n = trees[r], trees[r].size
                pred = torch.argmax(logits[i, :n], dim=-1).to(tree.device)
                chosen[r] = select_path(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ancestors(), pred)
            if cache_strategy == "compact":
                ragged.keep([chosen[r][0] for r in active])
            else:
                ragged.keep([[] for _ in active])
                ragged.forward([[pending[r], *chosen[r][1][:-1]] for r in active])
                ragged.keep([list(range(len(chosen[r][1]))) for r in active])
        else:
            r, tree = active[0], trees[active[0]]
            prefix_len = kv.cache_len(t_cache)
            n = tree.size
            if drafter is not None:
                side = drafter.side_branch()
                verified = tree_logits(target, t_cache, tree, t_kind, hidden, side)
                logits, tree_features = (
                    verified if isinstance(verified, tuple) else (verified, None)
                )  # a pair with hidden layers
                drafter.feed_logits(tree, logits[:n], None if side is None else logits[n:])
                if sampling is None:
                    pred = torch.argmax(logits[:n], dim=-1).to(tree.device)
                    path, committed = select_path(
                        tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ancestors(), pred
                    )
                elif (typical := getattr(drafter, "typical", None)) is not None:  # medusa's opt-in lossy mode
                    threshold, alpha = typical
                    path, committed = verify_tree_typical(
                        tree.tokens[:n].tolist(),
                        tree.parents[:n].tolist(),
                        logits[:n],
                        sampling.temperature,
                        threshold,
                        alpha,
                        generator,
                    )
                else:  # a drafter's tree is a function of the context: deterministic children (q one-hot)
                    path, committed = verify_tree_sampled(
                        tree.tokens[:n].tolist(),
                        tree.parents[:n].tolist(),
                        _row_probs(sampling, logits),
                        {},
                        generator,
                    )
                if tree_features is not None:
                    drafter.feed_target(tree_features[path], committed)
            elif sampling is None:
                pred = tree_predictions(target, t_cache, tree, t_kind)
                path, committed = select_path(
                    tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ancestors(), pred
                )
            else:
                logits = tree_logits(target, t_cache, tree, t_kind)
                assert drawn is not None  # sampling: a TreeSampling per tree
                path, committed = verify_tree_sampled(
                    tree.tokens[:n].tolist(),
                    tree.parents[:n].tolist(),
                    _row_probs(sampling, logits),
                    drawn.draft_probs,
                    generator,
                )
            if cache_strategy == "compact":
                kv.keep_positions(t_cache, prefix_len, [prefix_len + u for u in path])
            else:
                kv.crop(t_cache, prefix_len)
                kv.forward(target, [pending[r], *committed[:-1]], t_cache, last_only=True)
            chosen[r] = (path, committed)
        out, stay = {}, []
        for i, r in enumerate(active):
            path, committed = chosen[r]
            tree = trees[r]
            if drafter is None:
                sessions[r].commit(pending[r], path, committed)
            step = Step(
                tokens=tuple(committed), drafted=tree.n_drafted, accepted=len(committed) - 1, depth=tree.max_depth
            )
            policies[r].observe(step)
            pending[r] = committed[-1]
            produced[r] += len(committed)
            out[r], ended = cut_at_eos(step, eos)
            if not ended and produced[r] < max_new_tokens:
                stay.append(i)
        yield out
        if len(stay) < len(active):
            if ragged is not None:
                ragged.retain(stay)
            active = [active[i] for i in stay]
