"""The token-tree toolkit shared by every tree speculative decoder (``fixed_tree``, ``dynatree``, ...).

One implementation of each piece of paper sections 3.3-3.5 and Appendix D (Algorithm 1), used by all tree
decoders; a decoder only supplies an :class:`ExpansionPolicy` (which nodes to expand, with how many children):

- :class:`TokenTree`: the nodes (token, parent, depth, draft log-prob, cumulative log-prob; paper 3.3) as
  device tensors, stored flattened in breadth-first order (paper 3.4), plus the ancestor matrix.
- :func:`bfs_order`, :func:`ancestor_matrix`: the flattening and the ancestor relation for arbitrary trees.
- :func:`tree_attention_mask`, :func:`attention_mask_kind`, :func:`tree_position_ids`: the tree attention
  mask of paper 3.4 in the format the model's attention implementation needs, and the position ids.
- :func:`select_path`: greedy longest-path selection with the bonus token and the one-token fallback (3.5).
- :class:`DraftSession` and :func:`draft_tree`: tree drafting with a single draft KV cache (Algorithm 1,
  DRAFTTREE), either one draft forward per expanded node (``per_node``, the paper) or one per tree level
  (``per_level``).
- :func:`speculate_tree`: the verification driver (draft tree -> verify in one target forward -> select
  path -> update target and draft caches), with the two cache strategies ``compact`` and ``rebuild``.
- :class:`TreeParams`, :class:`TreeDecoder`: the params and the Decoder base both tree decoders subclass.

Design. Node 0 of every tree is the *pending* token: the newest committed token, which the target cache does
not hold yet (the invariant of ``ar`` and ``linear``). Drafted nodes are its descendants at depth >= 1. The
verification forward feeds [root, drafted nodes] with the tree mask, so its logits at the root are the
paper's prefix logits ``s_last`` and its logits at node u are ``s(u)``; the bonus token becomes the root of the
next tree. Consequences:

- ``compact``: ONE target forward per iteration. The root and the accepted path already sit in the target
  cache (computed under the tree mask, i.e. with exactly their sequential context), so ``kv.keep_positions`` keeps
  them by index and drops the rest.
- ``rebuild`` (the paper's 3.5 / Algorithm 1 line 6): crop the target cache back to the prefix and re-run
  the committed tokens [root, path]: two target forwards per iteration.
- Two tree shapes (``tree_root``). ``paper`` (Algorithm 1 line 10): the draft's top-1 token after the
  prefix, u0, is the single drafted node of the first level and the paper's root, depth 0; D, D_0 and D_max
  count from u0, so a paper tree of depth D holds D + 1 drafted tokens on its longest path. u0 is verified
  like any node: if the target rejects it, the committed token is the target's own greedy token at the root
  position (``pred[0]``, the one-token fallback of SELECTCOMMIT). ``pending`` (a dtbench variant): the first
  drafted level is chosen by the same expansion rule as every other level (the pending token is expanded like
  any node, up to B_max children), and depths count drafted tokens after the pending one, so a chain of depth
  K is exactly linear speculation with K drafts. Internally both store the pending token as node 0 and drafted
  nodes at internal depth k >= 1 (k = drafted tokens on the path); the policies see the depth of the chosen
  convention, k - :func:`root_offset`.
- Pruning (3.3, p(u) < tau; ``prune``). ``leaf`` is Algorithm 1 (lines 14-16, 28): every top-B(u) child is
  added to the tree (until N_max) and verified; one whose path probability is below tau is never expanded, so
  it stays a leaf. ``skip`` (a dtbench variant) does not create such a child at all: p is non-increasing along
  a path, so a node below tau can only root a subtree below tau, and this is the tree left by iterated leaf
  pruning, without verifying the leaves. In ``paper`` mode u0 is always in the tree (line 10), whatever tau.
- The draft cache holds the committed prefix (root included) and then the expanded tree nodes in the order
  they were fed; after verification it keeps the accepted path's expanded nodes by index too (no draft
  recomputation). Path nodes that were leaves (never fed to the draft) are fed at the next iteration's root
  forward together with the new root.

Host/device synchronisation: one ``tolist()`` per expansion step (per level or per node) and one per
verification; masks, position ids, the ancestor matrix and path selection are tensor operations.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, ClassVar, Literal, TypeVar, overload

import torch
from pydantic import Field

from dtbench.decoders import kv, modelinfo
from dtbench.decoders.base import Decoder, DecoderParams, Step, cut_at_eos, eos_ids, next_token
from dtbench.decoders.sampling import SamplingSettings, verify_tree_sampled, verify_tree_typical
from dtbench.decoders.tree.draft import (  # noqa: F401
    SKIP_WITH_SAMPLING,
    DraftSession,
    ExpansionPolicy,
    TreeDrafter,
    TreeSampling,
    check_draft_options,
    draft_tree,
)
from dtbench.decoders.tree.structure import (  # noqa: F401  (the toolkit's names, re-exported)
    CacheStrategy,
    DraftStrategy,
    MaskKind,
    Prune,
    SideBranch,
    TokenTree,
    TreeNode,
    TreeRoot,
    ancestor_matrix,
    attention_mask_kind,
    bfs_order,
    root_offset,
    select_path,
    tree_attention_mask,
    tree_capacity,
    tree_position_ids,
    with_side_branch,
)

# ----------------------------------------------------------------------------------------------------------
# Verification driver (Algorithm 1, one iteration; paper 3.4-3.5)
# ----------------------------------------------------------------------------------------------------------


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
    sessions: list[DraftSession] = []  # one per row when expansion policies draft with the draft model
    if drafter is None:
        assert draft is not None, "expansion policies draft with a draft model (the tree decoders need one)"
        sessions = [DraftSession(draft, p[0].tolist()) for p in prompts]
    ragged = kv.RaggedBatch(target) if batched else None
    if ragged is not None:
        first = ragged.prefill([p[0].tolist() for p in prompts])
    elif hidden is None:
        t_cache, logits = kv.prefill(target, prompts[0])
        first = [logits]
    else:
        t_cache, logits, features = kv.prefill_features(target, prompts[0], hidden)
        first = [logits]
    pending = [next_token(logits.reshape(-1), sampling, generator) for logits in first]
    if drafter is not None and hidden is not None:
        drafter.feed_target(features, prompts[0][0, 1:].tolist() + [pending[0]])
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


class TreeParams(DecoderParams):
    """Hyperparameters every tree decoder shares.

    Attributes:
        tree_root: "paper" roots the tree at the draft's top-1 token u0 at depth 0 (Algorithm 1 line 10; D,
            D_0, D_max count from u0); "pending" expands the pending token like any node, depths counting
            drafted tokens after it (the dtbench v1 tree, one level shallower for the same D).
        prune: "leaf" keeps a child whose path probability is below tau as a verified, unexpanded leaf
            (Algorithm 1 lines 14-16, 28); "skip" never creates it (the dtbench v1 tree).
        cache_strategy: "compact" keeps the accepted path's target KV entries by index (one target forward
            per iteration); "rebuild" is the paper's crop-and-re-run (section 3.5; two target forwards).
        draft_strategy: "per_level" drafts a whole tree level in one draft forward with the tree mask;
            "per_node" runs one cached draft step per expanded node (the paper's Algorithm 1).
        tau: pruning threshold on cumulative draft path probability p(u) (paper 3.3; Table 1 uses 0.1);
            0 disables pruning.
        n_max: node budget N_max, drafted nodes per tree (paper Appendix A: 256). ``"auto"`` (an extension, not
            the paper's default): the runner sets it before the first cell to the largest calibrated n whose
            tree verification (root + n nodes, one target forward) costs at most ``n_max_factor`` x one AR token
            (:func:`dtbench.harness.curves.auto_budget`); the chosen value is stored in the cell's params.
        n_max_factor: the factor of ``n_max: "auto"`` (default 2.0); unused otherwise.

    Defaults: ``tree_root="paper"`` and ``prune="leaf"``, so a bare ``{name: dynatree}`` or ``{name: fixed_tree}``
    is the paper's construction. Until decoder version 2 the only behaviour was pending/skip; cells store
    the decoder version, so stored version-1 results (whose params JSON has neither key) keep their meaning.

    The default strategies (compact, per_level) are the fastest lossless combination measured by
    ``suites/tree-strategies.yaml`` on the embedded SmolLM2 pair (CPU); they also run the fewest forwards
    (1 target forward per iteration, one draft forward per tree level), which matters more on a GPU.
    """

    tree_root: TreeRoot = Field(
        "paper",
        description="'paper': rooted at the draft's top-1 token u0, depth 0 (Algorithm 1 line 10); "
        "'pending': the pending token expanded like any node",
    )
    prune: Prune = Field(
        "leaf",
        description="'leaf': a child with p < tau is a verified leaf (Algorithm 1 lines 14-16); "
        "'skip': it is not created",
    )
    cache_strategy: CacheStrategy = Field(
        "compact", description="target cache update: 'compact' (keep path KV, 1 forward) or 'rebuild' (paper, 2)"
    )
    draft_strategy: DraftStrategy = Field(
        "per_level", description="'per_level' (one draft forward per depth) or 'per_node' (paper, one per node)"
    )
    tau: float = Field(0.1, ge=0.0, lt=1.0, description="pruning threshold on cumulative path probability p(u)")
    n_max: Annotated[int, Field(ge=1, le=4096)] | Literal["auto"] = Field(
        256,
        description="node budget N_max (drafted nodes per tree); 'auto': chosen by the runner from "
        "the calibrated verify curve (harness/curves.py auto_budget; an extension, not the paper's)",
    )
    n_max_factor: float = Field(
        2.0,
        gt=1.0,
        le=1000.0,
        description="n_max: auto takes the largest n whose tree verify costs at most this many times one AR token",
    )


N_MAX_AUTO_CEILING = 256  # n_max: auto chooses at most this many drafted nodes (the paper's N_max)

TP = TypeVar("TP", bound=TreeParams)  # a tree decoder's params model


def resolved_n_max(params: TreeParams) -> int:
    """``params.n_max`` as an int: ``"auto"`` is replaced by the calibrated budget before any cell decodes (the
    runner, :func:`dtbench.harness.curves.auto_budget`), so an expansion policy never sees it."""
    assert params.n_max != "auto", "n_max: auto is resolved before the first cell"
    return params.n_max


class TreeDecoder(Decoder[TP]):
    """Base of the tree speculative decoders: subclasses only build their :class:`ExpansionPolicy`.

    Lossless for greedy decoding (paper 3.6): the committed tokens equal the target's greedy tokens. Lossless
    under sampling too (issue 13): multi-draft speculative sampling over the tree (:func:`speculate_tree`), the
    committed tokens distributed exactly as the target's processed distribution; ``prune: skip`` is refused then.
    """

    Params: ClassVar[type[DecoderParams]] = TreeParams
    needs_draft = True
    lossless = True
    supports_sampling = True
    family = "tree"
    batching = True
    compiles = True
    version = "2"  # 2: tree_root/prune options, defaults paper/leaf (1: the pending/skip tree only)

    @classmethod
    @abstractmethod
    def tree_bounds(cls, params: TP) -> tuple[int, int]:
        """(largest breadth B, largest depth D) a tree of this configuration can have (params only)."""

    @classmethod
    def verify_sizes(cls, params: TP) -> tuple[int, int]:
        """(1, root + nodes): the largest tree :func:`~dtbench.decoders.tree.structure.tree_capacity` allows for
        :meth:`tree_bounds` and N_max (``n_max: auto`` searches up to :data:`N_MAX_AUTO_CEILING`)."""
        breadth, depth = cls.tree_bounds(params)
        n_max = N_MAX_AUTO_CEILING if params.n_max == "auto" else int(params.n_max)
        return 1, tree_capacity(max(breadth, 1), max(depth, 1), n_max)

    @abstractmethod
    def make_policy(self) -> ExpansionPolicy:
        """A fresh expansion policy for one generate() call (adaptive state starts from the params)."""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Run :func:`speculate_tree` with this decoder's policy and strategies (see there for the Steps)."""
        p = self.params
        yield from speculate_tree(
            self.target,
            self.draft,
            input_ids,
            max_new_tokens,
            self.make_policy(),
            p.cache_strategy,
            p.draft_strategy,
            tree_root=p.tree_root,
            prune=p.prune,
            sampling=self.sampling,
            generator=self.generator,
            eos_token_id=self.eos_token_id,
        )

    @torch.inference_mode()
    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int) -> Iterator[dict[int, Step]]:
        """B prompts through :func:`speculate_tree_batch`: a fresh policy and draft session per row, every row's
        tree verified in one batched target forward."""
        p = self.params
        assert self.draft is not None  # needs_draft: Decoder.__init__ refuses a missing draft model
        yield from speculate_tree_batch(
            self.target,
            self.draft,
            prompts,
            max_new_tokens,
            [self.make_policy() for _ in prompts],
            p.cache_strategy,
            p.draft_strategy,
            tree_root=p.tree_root,
            prune=p.prune,
            eos_token_id=self.eos_token_id,
        )

    @classmethod
    def sampling_error(cls, params: DecoderParams) -> str | None:
        """``prune: skip`` cannot sample losslessly (it drops children by their drawn value)."""
        return SKIP_WITH_SAMPLING if getattr(params, "prune", None) == "skip" else None
